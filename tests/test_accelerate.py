"""The Accelerate path for real: ``accelerate launch`` with 2 CPU processes through DeepSpeed, the
shipped Accelerate configs and the example loop, with the DP backend in place of the all-reduce."""
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from launch_helpers import ROOT, env, free_port

pytestmark = pytest.mark.multiproc

ACCELERATE = os.path.join(os.path.dirname(sys.executable), "accelerate")
EXAMPLE = os.path.join(ROOT, "examples", "accelerate_loop.py")


def _config(tmp_path, name: str, dp: dict | None) -> str:
    """The shipped Accelerate config ``name`` pointing at its DeepSpeed JSON with ``dp`` (None: no
    twocircuit section at all)."""
    ds = json.load(open(os.path.join(ROOT, "ds_configs", "accelerate", f"{name}.json")))
    if dp is None:
        ds.pop("twocircuit")
    else:
        ds["twocircuit"]["dp"] = dp
    ds_path = tmp_path / f"{name}.json"
    ds_path.write_text(json.dumps(ds))
    yaml = open(os.path.join(ROOT, "ds_configs", "accelerate", f"{name}.yaml")).read()
    assert f"deepspeed_config_file: ds_configs/accelerate/{name}.json" in yaml
    out = tmp_path / f"{name}.yaml"
    out.write_text(yaml.replace(f"ds_configs/accelerate/{name}.json", str(ds_path)))
    return str(out)


def _launch(tmp_path, name, dp, steps, *extra):
    out = tmp_path / "out"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [ACCELERATE, "launch", "--config_file", _config(tmp_path, name, dp),
           "--main_process_port", str(free_port()), EXAMPLE, "--model", "tiny", "--steps", str(steps),
           "--output-dir", str(out), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.load(open(out / "summary.json"))
    weights = load_file(str(out / "hf" / "model.safetensors"))
    return summary, weights, proc.stdout


def test_allreduce_backend_equals_stock_deepspeed_under_accelerate(tmp_path):
    stock, w_stock, _ = _launch(tmp_path, "powersgd", None, 3, "--stock")
    ours, w_ours, out = _launch(tmp_path, "powersgd", {"backend": "allreduce"}, 3)
    assert stock["backend"] == "deepspeed" and ours["backend"] == "allreduce"
    assert w_stock.keys() == w_ours.keys()
    assert all(torch.equal(w_stock[k], w_ours[k]) for k in w_stock)     # the same training, bit for bit
    assert ours["replicas_identical"] and stock["replicas_identical"]
    # Accelerate + DeepSpeed on a CPU host says 1 process per rank; the DP world is still 2
    assert ours["accelerate_num_processes"] == 1 and ours["world_size"] == ours["dp/world_size"] == 2
    # every step a ring all-reduce of every fp32 gradient: 2 (n-1)/n x 4 bytes x params, n = 2
    n_params = sum(t.numel() for k, t in w_ours.items())
    assert ours["dp/allreduce_bytes"] == 3 * 4 * n_params
    assert ours["dp/bytes_sent"] == ours["dp/allreduce_bytes"] and ours["dp/compression_ratio"] == 1.0
    assert out.count("saved ") == 1                                       # saved once


@pytest.mark.parametrize("name, dp, ratio", [
    ("diloco", {"backend": "diloco", "inner_steps": 2}, 2.0),
    ("streaming_diloco", {"backend": "streaming_diloco", "inner_steps": 2, "num_fragments": 2,
                          "overlap": False}, 2.0),
])
def test_diloco_backends_under_accelerate(tmp_path, name, dp, ratio):
    s, _, _ = _launch(tmp_path, name, dp, 4)
    assert s["backend"] == dp["backend"] and s["dp/steps"] == 4
    # one sync of the whole model every 2 steps (each fragment every 2 steps): half the all-reduce
    # bytes; the last step synced everything, so the final average sends nothing more
    assert s["dp/compression_ratio"] == ratio
    assert s["replicas_identical"] and s["dp/replicas_in_sync"] == 1.0


def test_overlapped_syncs_report_their_seconds_under_accelerate(tmp_path):
    """The shipped Streaming DiLoCo config (overlapped, PowerSGD): a sync launched in one step and
    waited for in the next books its seconds there (they were lost with the launch step's stats,
    so ``dp/comm_s`` and ``dp/hidden_comm_s`` read 0.0), and the time hidden behind compute is part
    of the total."""
    dp = json.load(open(os.path.join(ROOT, "ds_configs", "accelerate", "streaming_diloco.json")))["twocircuit"]["dp"]
    dp = {**dp, "inner_steps": 2}                          # a fragment's sync every step, 5 of them in 6 steps
    s, _, _ = _launch(tmp_path, "streaming_diloco", dp, 6)
    assert s["dp/collectives"] > 0 and s["dp/comm_s"] > 0
    assert 0 < s["dp/hidden_comm_s"] <= s["dp/comm_s"]


def test_trainer_callback_logs_dp_metrics(tmp_path):
    """examples/hf_trainer.py under accelerate launch: the callback attaches DiLoCo (H = 2), every
    log carries the DP totals so far, and the last entry (after the end-of-run sync) the run's."""
    cfg = _config(tmp_path, "diloco", {"backend": "diloco", "inner_steps": 2})
    out = tmp_path / "trainer"
    cmd = [ACCELERATE, "launch", "--config_file", cfg, "--main_process_port", str(free_port()),
           os.path.join(ROOT, "examples", "hf_trainer.py"), "--model", "tiny", "--steps", "4",
           "--output-dir", str(out), "--report-to", "tensorboard"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    history = json.load(open(out / "trainer_state.json"))["log_history"]
    steps = [h for h in history if "loss" in h]
    assert [h["dp/steps"] for h in steps] == [1, 2, 3, 4]
    weights = load_file(str(out / "hf" / "model.safetensors"))
    if json.load(open(out / "hf" / "config.json")).get("tie_word_embeddings"):
        weights.pop("lm_head.weight", None)               # one tensor, saved under both names
    n_params = sum(t.numel() for t in weights.values())
    full = 4 * n_params                                   # one ring all-reduce of the fp32 model, n = 2
    assert [h["dp/allreduce_bytes"] for h in steps] == [full, 2 * full, 3 * full, 4 * full]
    assert [h["dp/bytes_sent"] for h in steps] == [0, full, full, 2 * full]   # syncs after steps 2, 4
    assert [h["dp/replicas_in_sync"] for h in steps] == [0.0, 1.0, 0.0, 1.0]
    final = history[-1]
    assert final["dp/final"] == 1.0 and final["dp/bytes_sent"] == 2 * full
    assert final["dp/compression_ratio"] == 2.0 and final["dp/world_size"] == 2
    # report_to: the TensorBoard reporter got the same values as the log history
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = glob.glob(str(out / "**" / "events.out.tfevents.*"), recursive=True)
    assert events, "no TensorBoard event file"
    acc = EventAccumulator(os.path.dirname(events[0]))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "train/dp/bytes_sent" in tags, tags
    logged = [e.value for e in acc.Scalars("train/dp/bytes_sent")]
    assert logged[:4] == [0, full, full, 2 * full]
    # the CSV log: one row per log with the same values, the last one the final totals
    import csv
    rows = list(csv.DictReader(open(out / "dp_metrics.csv")))
    with_dp = [h for h in history if "dp/steps" in h]     # the step logs, the Trainer's summary, final
    assert len(rows) == len(with_dp) >= 5 and [int(r["step"]) for r in rows][:4] == [1, 2, 3, 4]
    for r, h in zip(rows, with_dp):
        assert int(r["step"]) == h["step"]
        for k in ("dp/steps", "dp/bytes_sent", "dp/allreduce_bytes", "dp/collectives"):
            assert int(r[k]) == h[k], (k, r, h)
        assert float(r["dp/replicas_in_sync"]) == h["dp/replicas_in_sync"]
        assert (r["dp/compression_ratio"] == "") == ("dp/compression_ratio" not in h)
    assert rows[-1]["dp/final"] == "1.0" and rows[0]["dp/final"] == ""
    # summary.json (written after training, as the Accelerate loop's) holds the final log's totals
    summary = json.load(open(out / "summary.json"))
    assert summary["replicas_identical"] and summary["world_size"] == 2 and summary["backend"] == "diloco"
    assert {k: v for k, v in summary.items() if k.startswith("dp/")} == \
        {k: v for k, v in final.items() if k.startswith("dp/") and k != "dp/final"}
