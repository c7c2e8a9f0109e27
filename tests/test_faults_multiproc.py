"""A dead or hung rank in a real multi-process run: one line of diagnosis, nothing committed is
lost, a half-written checkpoint is never chosen, and the run comes back (by hand with
``--resume auto``, or by itself under ``torchrun --max-restarts``) ending exactly where an
uninterrupted run ends. Faults are real signals (SIGKILL / SIGSTOP), raised by the rank itself at
a chosen step through ``DS_TWOCIRCUIT_FAULT``."""
import json
import os
import time

import pytest
import torch

from launch_helpers import CONFIGS, deepspeed_launch, read_metrics, read_summary, read_weights, torchrun

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

M95 = os.path.join(CONFIGS, "m95.json")
COMMON = ["--model", "tiny", "--steps", "8", "--seq-len", "16", "--eval-sequences", "0", "--save-interval", "2"]
FAULT = "DS_TWOCIRCUIT_FAULT"


def _diloco_cfg(tmp_path):
    cfg = json.load(open(M95))
    cfg["twocircuit"]["dp"] = {"backend": "diloco", "inner_steps": 3}
    path = tmp_path / "diloco.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Uninterrupted references: PP = 2 (m95), and PP = 2 x DP = 2 with DiLoCo."""
    tmp = tmp_path_factory.mktemp("straight")
    pp2, dp2 = str(tmp / "pp2"), str(tmp / "dp2")
    torchrun(2, ["--deepspeed", M95, *COMMON, "--output-dir", pp2])
    torchrun(4, ["--deepspeed", _diloco_cfg(tmp), "--pp", "2", *COMMON, "--output-dir", dp2])
    return {"pp2": pp2, "dp2": dp2, "diloco_cfg": _diloco_cfg(tmp)}


def _diagnosis(stderr: str) -> list[str]:
    return [l.strip() for l in stderr.splitlines() if l.strip().startswith("[ds_twocircuit] rank")]


def _same_run(out, ref):
    a, b = read_weights(os.path.join(ref, "hf")), read_weights(os.path.join(out, "hf"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # every step once in metrics.jsonl, with the uninterrupted run's losses
    assert [(r["step"], r["loss"]) for r in read_metrics(out)] == [(r["step"], r["loss"]) for r in read_metrics(ref)]


def test_killed_rank_says_what_happened_and_resume_auto_finishes_the_run(tmp_path, straight):
    out = str(tmp_path / "run")
    p = deepspeed_launch(2, ["--deepspeed", M95, *COMMON, "--output-dir", out], check=False,
                         extra_env={FAULT: "kill:rank=1:step=5"})
    assert p.returncode != 0
    lines = _diagnosis(p.stderr)
    assert len(lines) == 1, p.stderr[-3000:]
    assert lines[0].startswith("[ds_twocircuit] rank 0 (stage 0, replica 0) stopped at step 5: "
                               "rank 1 (stage 1, replica 0) stopped or cannot be reached")
    assert f"Last committed checkpoint: {out}/checkpoint/global_step4 (step 4; 1 step(s) to redo)" in lines[0]
    cmd = lines[0].split("Resume: ")[1]
    assert cmd.startswith("deepspeed --num_gpus 2 launch/train.py ") and cmd.endswith(" --resume auto")
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout
    # resume exactly as the line says (the launcher's own flags aside)
    args = cmd.split("launch/train.py ")[1].split()
    q = deepspeed_launch(2, args)
    assert f"--resume auto: continuing from {out}/checkpoint/global_step4" in q.stdout + q.stderr
    assert read_summary(out)["first_step"] == 4
    _same_run(out, straight["pp2"])
    assert sorted(os.listdir(os.path.join(out, "checkpoint"))) == ["global_step6", "global_step8", "latest"]


def test_elastic_restart_skips_a_half_written_checkpoint(tmp_path, straight):
    """Rank 1 dies after writing its part of the step-4 checkpoint, before the commit: torchrun
    restarts the group, which resumes from step 2 (never from the half-written 4)."""
    out = str(tmp_path / "run")
    p = torchrun(2, ["--deepspeed", M95, *COMMON, "--output-dir", out], max_restarts=1,
                 extra_env={FAULT: "kill-in-checkpoint:rank=1:step=4"})
    lines = _diagnosis(p.stderr)
    assert len(lines) == 1 and "stopped while writing the checkpoint of step 4" in lines[0], p.stderr[-3000:]
    assert f"Last committed checkpoint: {out}/checkpoint/global_step2 (step 2; 2 step(s) to redo)" in lines[0]
    assert f"--resume auto: continuing from {out}/checkpoint/global_step2" in p.stdout + p.stderr
    s = read_summary(out)
    assert s["first_step"] == 2 and s["steps"] == 6
    _same_run(out, straight["pp2"])


def test_killed_rank_in_pp2_x_dp2_diloco_resumes_exactly(tmp_path, straight):
    out = str(tmp_path / "run")
    args = ["--deepspeed", straight["diloco_cfg"], "--pp", "2", *COMMON, "--output-dir", out]
    p = deepspeed_launch(4, args, check=False, extra_env={FAULT: "kill:rank=2:step=5"})
    assert p.returncode != 0
    lines = _diagnosis(p.stderr)
    assert lines and lines[0].startswith("[ds_twocircuit] rank 0 (stage 0, replica 0) stopped at step 5: "
                                         "rank 2 (stage 1, replica 0) stopped or cannot be reached"), p.stderr[-3000:]
    assert "resume the 1 replica(s) left with --dp 1" in lines[0]      # the way on without the node
    assert "Traceback" not in p.stderr
    deepspeed_launch(4, args + ["--resume", "auto"])
    _same_run(out, straight["dp2"])
    assert read_summary(out)["dp_replicas_identical"] is True


def test_hung_rank_is_detected_within_the_peer_timeout(tmp_path):
    out = str(tmp_path / "run")
    t0 = time.monotonic()
    p = deepspeed_launch(2, ["--deepspeed", M95, *COMMON, "--output-dir", out, "--peer-timeout", "5"],
                         check=False, extra_env={FAULT: "stop:rank=1:step=3"})
    took = time.monotonic() - t0
    assert p.returncode != 0
    lines = _diagnosis(p.stderr)
    assert len(lines) == 1, p.stderr[-3000:]
    assert lines[0].startswith("[ds_twocircuit] rank 0 (stage 0, replica 0) stopped at step 3: "
                               "rank 1 (stage 1, replica 0) stopped or cannot be reached (no answer within 5000 ms")
    assert "global_step2 (step 2; 1 step(s) to redo)" in lines[0]
    # start-up, 5 s of silence, the census, and the launcher's 30 s grace for the stopped rank --
    # far below the 300 s default, let alone torch's 30 minutes
    assert took < 150, took
