"""DP backends inside the masked pipeline engine: PP=2 x DP=2 on the tiny preset."""
import json
import os
import re

import pytest
import torch

from launch_helpers import CONFIGS, read_metrics, read_summary, read_weights, torchrun

pytestmark = pytest.mark.multiproc

SEQ = 16


def _cfg(tmp_path, name, dp):
    cfg = json.load(open(os.path.join(CONFIGS, "m95.json")))
    cfg["twocircuit"]["dp"] = dp
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


BACKENDS = {
    "allreduce": {"backend": "allreduce"},
    "powersgd": {"backend": "powersgd", "powersgd": {"matrix_approximation_rank": 2, "start_powerSGD_iter": 1}},
    "diloco": {"backend": "diloco", "inner_steps": 3},
    # a 2-step overlap window with the delayed merge rule: PowerSGD's P goes out after a sync's
    # step, its Q one step later, the update lands a step after that (the default "mix" rule runs
    # through DeepSpeed in tests/test_elastic.py's merge test and every shipped DP config)
    "streaming_diloco": {"backend": "streaming_diloco", "inner_steps": 4, "num_fragments": 2,
                         "overlap_steps": 2, "merge_rule": "delayed", "compression": "powersgd",
                         "powersgd": {"matrix_approximation_rank": 2, "start_powerSGD_iter": 0}},
}


def _train(tmp_path, name, dp_cfg, steps, extra=()):
    out = str(tmp_path / name)
    torchrun(4, ["--model", "tiny", "--deepspeed", _cfg(tmp_path, name, dp_cfg), "--pp", "2", "--dp", "2",
                 "--steps", str(steps), "--seq-len", str(SEQ), "--output-dir", out, "--eval-sequences", "0",
                 *extra])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp")
    # allreduce also scores 16 held-out windows at the start and the end: whether training moved
    # the model is read on the same windows (the first and last batches differ in content)
    return {name: _train(tmp, name, cfg, 6, ("--eval-sequences", "16") if name == "allreduce" else ())
            for name, cfg in BACKENDS.items()}


def test_allreduce_bytes_and_identical_replicas(runs):
    s = read_summary(runs["allreduce"])
    w = read_weights(os.path.join(runs["allreduce"], "hf"))
    n_params = sum(t.numel() for t in w.values())
    # ring all-reduce over 2 replicas: every rank sends its whole stage once per step, so the
    # 4 ranks together send 2 x the model per step
    assert s["wire_bytes"]["dp"] == 6 * 2 * n_params * 4
    assert s["dp_replicas_identical"] is True
    assert s["heldout_loss"] < s["heldout_loss_first"] - 0.01, (s["heldout_loss_first"], s["heldout_loss"])


def test_powersgd_sends_less_and_keeps_replicas_identical(runs):
    a, p = read_summary(runs["allreduce"]), read_summary(runs["powersgd"])
    assert 0 < p["wire_bytes"]["dp"] < a["wire_bytes"]["dp"] / 3
    assert p["dp_replicas_identical"] is True
    m = read_metrics(runs["powersgd"])
    assert m[0]["dp.dense"] is True and m[1]["dp.dense"] is False   # start_powerSGD_iter = 1
    assert all(r["dp_s"] >= 0 for r in m)


def test_diloco_syncs_every_h_steps_and_ends_identical(runs):
    s = read_summary(runs["diloco"])
    m = read_metrics(runs["diloco"])
    sent = [r.get("wire_bytes_rank0", {}).get("dp", 0) for r in m]
    assert [i for i, b in enumerate(sent) if b] == [2, 5]     # after steps H-1 and 2H-1
    assert s["dp_replicas_identical"] is True
    # the last step was a sync: nothing more to send at the end; 2 syncs of the whole model
    a = read_summary(runs["allreduce"])
    assert s["dp_final_sync_bytes"] == 0
    assert s["wire_bytes"]["dp"] == a["wire_bytes"]["dp"] // 6 * 2


def test_streaming_diloco_staggers_fragments(runs):
    m = read_metrics(runs["streaming_diloco"])
    synced = [r.get("dp.synced_fragments") for r in m]
    # H=4, F=2: fragment 0 after step 3, fragment 1 after step 5 (offset 2)
    assert synced[3] == [0] and synced[5] == [1]
    assert all(not synced[i] for i in (0, 1, 2, 4))
    s = read_summary(runs["streaming_diloco"])
    assert s["dp_replicas_identical"] is True                 # flushed at the end
    # with overlap the last in-flight sync is merged, so both fragments are averaged once more,
    # exactly, at the end: one dense all-reduce of the model (as one all-reduce step sends), plus
    # the compressed second half (PowerSGD's Q) of the sync that was still in flight (launched
    # after step 5, its Q due after step 6)
    dense_step = read_summary(runs["allreduce"])["wire_bytes"]["dp"] // 6
    assert dense_step < s["dp_final_sync_bytes"] < 1.05 * dense_step
    assert s["wire_bytes"]["dp"] < read_summary(runs["allreduce"])["wire_bytes"]["dp"] / 5


@pytest.mark.parametrize("name", ["streaming_diloco"])   # the most state; every backend on 2 simulated
def test_resume_continues_exactly(tmp_path, runs, name):   # replicas: test_reference_engine
    # saved after 5 steps: fragment 0's sync (launched after step 3) has its Q all-reduce in flight
    # (launched after step 4) and lands, with the delayed rule, after step 5 of the resumed run
    first = _train(tmp_path, f"{name}_a", BACKENDS[name], 5, ["--save-checkpoint", "--no-save-model"])
    resumed = str(tmp_path / f"{name}_b")
    ckpt = os.path.join(first, "checkpoint")
    torchrun(4, ["--model", "tiny", "--deepspeed", _cfg(tmp_path, name, BACKENDS[name]), "--pp", "2",
                 "--dp", "2", "--steps", "6", "--seq-len", str(SEQ), "--output-dir", resumed,
                 "--eval-sequences", "0", "--resume", ckpt])
    straight = read_weights(os.path.join(runs[name], "hf"))
    again = read_weights(os.path.join(resumed, "hf"))
    for k in straight:
        assert torch.equal(straight[k], again[k]), k
    assert [r["loss"] for r in read_metrics(resumed)] == [r["loss"] for r in read_metrics(runs[name])][5:]
    assert read_metrics(resumed)[0]["dp.completed_fragments"] == [0]


def test_start_up_broadcast_only_when_replicas_differ(tmp_path, runs):
    """DeepSpeed broadcasts the whole model from each DP group's first replica at start-up; replicas
    that loaded the same weights skip it (a digest compared per DP group). Here one replica's
    stage-1 weights are perturbed before the engine is built: only that stage's group broadcasts
    (its parameter bytes, received by replica 1), and the run ends with identical replicas."""
    s0 = read_summary(runs["allreduce"])
    assert s0["dp_init_broadcast_bytes"] == 0 and s0["dp_replicas_identical"] is True
    script = tmp_path / "perturbed_train.py"
    script.write_text(
        "import os, sys, torch\n"
        "import ds_twocircuit.adapters.pipe_module as pm\n"
        "from ds_twocircuit.train import run\n"
        "build = pm.build_pipeline\n"
        "def perturbed(*a, **k):\n"
        "    module = build(*a, **k)\n"
        "    stage = module._topo.get_coord(int(os.environ['RANK'])).pipe\n"
        "    if os.environ['RANK'] == '3':\n"
        "        with torch.no_grad():\n"
        "            next(module.parameters()).add_(1e-3)\n"
        "    n = sum(p.numel() * p.element_size() for p in module.parameters())\n"
        "    sys.stdout.write(f'STAGE_BYTES {stage} {n}\\n')  # one write: four ranks share the pipe\n"
        "    sys.stdout.flush()\n"
        "    return module\n"
        "pm.build_pipeline = perturbed\n"
        "sys.exit(run(sys.argv[1:]))\n")
    out = str(tmp_path / "run")
    p = torchrun(4, ["--model", "tiny", "--deepspeed", os.path.join(CONFIGS, "dense.json"), "--pp", "2", "--dp", "2",
                     "--steps", "2", "--seq-len", "32", "--eval-sequences", "0", "--output-dir", out],
                 script=str(script))
    # the ranks' lines may still interleave on the shared pipe: match the records, not whole lines
    stage_bytes = dict(re.findall(r"STAGE_BYTES (\d+) (\d+)", p.stdout))
    s = read_summary(out)
    assert s["dp_replicas_identical"] is True
    assert s["dp_init_broadcast_bytes"] == int(stage_bytes["1"]) > 0


# resuming on another DP width (every backend, both directions, pipeline = reference): tests/test_elastic.py


def test_the_dp_candidates_sync_is_the_same_on_deepspeed_and_the_reference_engine(tmp_path):
    """The DP candidate's sync (ds_configs/dense_dp200_sqrtlr_q3_delayed.json: 3-bit pseudo-gradients
    all-gathered, error feedback, the delayed merge rule, the inner lr times sqrt(N)), shortened to
    fit a tiny run (H 4, 2 fragments, a 2-step window: fragment 0's sync lands in step 5, fragment
    1's in step 7, then the end-of-run average), on PP 2 x DP 2 through DeepSpeed and on the
    reference engine the quality studies run: the same losses, lrs, DP bytes and final weights.
    The two engines compute the same pseudo-gradients bit for bit (the final weights are equal
    here, not just close), which the 3-bit rounding needs: a level decided differently would show
    far above the tolerance."""
    from ds_twocircuit.train import run
    cfg = json.load(open(os.path.join(CONFIGS, "dense_dp200_sqrtlr_q3_delayed.json")))
    dp = cfg["twocircuit"]["dp"]
    assert (dp["merge_rule"], dp["compression"], dp["quant"]["bits"], dp["inner_lr_scale"]) == \
        ("delayed", "quant", 3, "sqrt_replicas")
    dp.update(inner_steps=4, num_fragments=2, overlap_steps=2)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.05}}
    cfg["gradient_clipping"] = 0.0
    cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"] = 2, 2
    path = tmp_path / "candidate.json"
    path.write_text(json.dumps(cfg))
    args = lambda out: ["--model", "tiny", "--deepspeed", str(path), "--pp", "2", "--dp", "2", "--steps", "9",
                        "--seq-len", str(SEQ), "--eval-sequences", "0", "--output-dir", out]
    pipe, ref = str(tmp_path / "pipe"), str(tmp_path / "ref")
    torchrun(4, args(pipe))
    assert run(["--engine", "reference", *args(ref)]) == 0
    a, b = read_metrics(pipe), read_metrics(ref)
    assert len(a) == 9 and [m["loss"] for m in a] == pytest.approx([m["loss"] for m in b], rel=1e-5)
    landed = [[m["step"], m["dp.completed_fragments"]] for m in a if m["dp.completed_fragments"]]
    assert landed == [[m["step"], m["dp.completed_fragments"]] for m in b if m["dp.completed_fragments"]] \
        == [[5, [0]], [7, [1]]]                         # both syncs land inside the loop, alike
    assert [m["lr"] for m in a] == [m["lr"] for m in b] == pytest.approx([0.05 * 2 ** 0.5] * 9)
    sa, sb = read_summary(pipe), read_summary(ref)
    assert sa["wire_bytes"]["dp"] == sb["wire_bytes"]["dp"] > 0
    assert sa["dp_replicas_identical"] is True          # the end-of-run average
    w, r = read_weights(os.path.join(pipe, "hf")), read_weights(os.path.join(ref, "hf"))
    assert w.keys() == r.keys() and max(float((w[k] - r[k]).abs().max()) for k in w) < 1e-5
