"""A dead or hung rank in a real multi-process run: one line of diagnosis, nothing committed is
lost, a half-written checkpoint is never chosen, and the run comes back (by hand with
``--resume auto``, or by itself under ``torchrun --max-restarts``) ending exactly where an
uninterrupted run ends. Faults are real signals (SIGKILL / SIGSTOP), raised by the rank itself at
a chosen step through ``DS_TWOCIRCUIT_FAULT``."""
import os
import time

import pytest
import torch

from launch_helpers import CONFIGS, deepspeed_launch, read_metrics, read_summary, read_weights, torchrun

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

M95 = os.path.join(CONFIGS, "m95.json")
COMMON = ["--model", "tiny", "--steps", "8", "--seq-len", "16", "--eval-sequences", "0", "--save-interval", "2"]
FAULT = "DS_TWOCIRCUIT_FAULT"


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted reference: PP = 2 (m95). (A killed rank of PP = 2 x DP = 2: the regroup
    test in tests/test_elastic.py; DiLoCo's exact resume: tests/test_dp_pipeline.py.)"""
    tmp = tmp_path_factory.mktemp("straight")
    pp2 = str(tmp / "pp2")
    torchrun(2, ["--deepspeed", M95, *COMMON, "--output-dir", pp2])
    return {"pp2": pp2}


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


def test_hung_rank_is_detected_within_the_peer_timeout(tmp_path):
    """A stopped (SIGSTOP) peer is given up on after --peer-timeout, with one line. The launch is
    ended as soon as the line is out: what comes after is DeepSpeed's launcher giving the stopped
    rank 30 s before its SIGKILL."""
    import signal
    import subprocess
    import sys
    import threading
    from launch_helpers import ROOT, TRAIN, env, free_port
    out = str(tmp_path / "run")
    ds = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [ds, "--num_gpus", "2", "--master_port", str(free_port()), TRAIN, "--deepspeed", M95, *COMMON,
           "--output-dir", out, "--peer-timeout", "5"]
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, cwd=ROOT, env=env({FAULT: "stop:rank=1:step=3"}), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    timer = threading.Timer(600, lambda: os.killpg(p.pid, signal.SIGKILL))
    timer.start()
    lines, seen = [], []
    try:
        for line in p.stderr:
            seen.append(line)
            if line.strip().startswith("[ds_twocircuit] rank"):
                lines.append(line.strip())
                took = time.monotonic() - t0
                break
    finally:
        timer.cancel()
        os.killpg(p.pid, signal.SIGKILL)      # the stopped rank too (SIGKILL reaches a stopped process)
        p.wait()
    assert lines, "".join(seen)[-3000:]
    assert lines[0].startswith("[ds_twocircuit] rank 0 (stage 0, replica 0) stopped at step 3: "
                               "rank 1 (stage 1, replica 0) stopped or cannot be reached (no answer within 5000 ms")
    assert "global_step2 (step 2; 1 step(s) to redo)" in lines[0]
    # start-up, 5 s of silence and the census: far below the 300 s default, let alone torch's 30 minutes
    assert took < 120, took
