"""The pure parts of fault handling: checkpoint policy, committed checkpoints, pruning, lost-peer
diagnosis, the resume command, the peer census and fault-injection specs."""
import json
import os
import time

import pytest
import torch.distributed as dist

from ds_twocircuit.config import ConfigError
from ds_twocircuit.faults import (COMMITTED, STATE_DIR, CheckpointPolicy, PeerCensus, Stopped,
                                  committed_checkpoints, lost_peer_reason, newest_committed,
                                  parse_fault, prune, resume_command)


def test_policy_steps_win_and_minutes_calibrate():
    p = CheckpointPolicy(every_steps=3, every_minutes=10, keep=2)
    assert not p.needs_calibration
    assert [s for s in range(1, 10) if p.due(s, 10)] == [3, 6, 9]
    assert not p.due(9, 9)                      # the end of the run is the caller's business
    m = CheckpointPolicy(every_steps=0, every_minutes=1.0)
    assert m.needs_calibration and not m.due(5, 100)
    assert m.calibrate(7.0) == 8                 # 60 s / 7 s per step -> every 8 steps
    assert not m.needs_calibration and m.due(16, 100) and not m.due(17, 100)
    assert CheckpointPolicy(every_minutes=0.001).calibrate(30.0) == 1   # never 0
    off = CheckpointPolicy(0, 0.0)
    assert not off.enabled and not off.needs_calibration and not off.due(1, 10)


@pytest.mark.parametrize("kw, key", [({"every_steps": -1}, "--save-interval"),
                                     ({"every_minutes": -2.0}, "--save-interval-minutes"),
                                     ({"every_minutes": float("nan")}, "--save-interval-minutes"),
                                     ({"keep": 0}, "--keep-checkpoints")])
def test_policy_rejects_bad_values(kw, key):
    with pytest.raises(ConfigError, match=key):
        CheckpointPolicy(**kw)


def _tag(root, step, committed=True):
    d = root / f"global_step{step}" / STATE_DIR
    d.mkdir(parents=True)
    (d / "stage00_dp0000.pt").write_bytes(b"x")
    if committed:
        (d / COMMITTED).write_text(json.dumps({"global_steps": step}))


def test_committed_and_newest_ignore_half_written(tmp_path):
    for s, c in ((2, True), (10, True), (4, True), (12, False)):
        _tag(tmp_path, s, c)
    (tmp_path / "latest").write_text("global_step12")       # DeepSpeed's pointer: not trusted
    (tmp_path / "global_stepX").mkdir()
    assert [s for s, _ in committed_checkpoints(str(tmp_path))] == [2, 4, 10]
    assert newest_committed(str(tmp_path)) == (10, str(tmp_path / "global_step10"))
    assert newest_committed(str(tmp_path / "missing")) is None


def test_prune_keeps_the_newest_committed(tmp_path):
    for s in (2, 4, 6):
        _tag(tmp_path, s)
    _tag(tmp_path, 8, committed=False)                       # in progress: newer, kept
    assert prune(str(tmp_path), 2, [2, 4, 6]) == ["global_step2"]
    assert sorted(os.listdir(tmp_path)) == ["global_step4", "global_step6", "global_step8"]
    assert prune(str(tmp_path), 5, [4, 6]) == []             # fewer than keep: nothing goes


def test_lost_peer_reason_recognises_gloo_and_timeouts():
    closed = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by "
                          "peer [127.0.0.1]:45173")
    assert lost_peer_reason(closed) == "connection closed by peer 127.0.0.1"
    hung = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
                        "waiting 5000ms for recv operation to complete")
    assert lost_peer_reason(hung) == "no answer within 5000 ms, recv timed out"
    assert lost_peer_reason(Stopped("stopped by the launcher (SIGTERM)")).startswith("stopped by")
    assert lost_peer_reason(RuntimeError("Socket Timeout\nmore")) == "timed out: Socket Timeout"
    assert lost_peer_reason(RuntimeError("size mismatch for weight")) is None
    assert lost_peer_reason(ValueError("Connection closed by peer")) is None   # not a comm error


def test_resume_command_keeps_arguments_and_names_the_launcher():
    argv = ["--deepspeed", "ds_configs/m95.json", "--steps", "100", "--resume", "old/ckpt", "--local_rank=0"]
    cmd = resume_command(argv, {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    assert cmd == "deepspeed --num_gpus 2 launch/train.py --deepspeed ds_configs/m95.json --steps 100 --resume auto"
    assert resume_command(["--steps", "3"], {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                                             "TORCHELASTIC_RUN_ID": "x"}).startswith("torchrun --nproc_per_node 2 ")
    assert resume_command([], {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}).startswith(
        "<your launch command on every node> launch/train.py")
    assert resume_command(["--output-dir", "a b"], {}) == "python launch/train.py --output-dir 'a b' --resume auto"


def test_census_names_the_ranks_that_never_answer():
    store = dist.HashStore()
    census = [PeerCensus(store, r, 4).start_answering(poll_s=0.05) for r in (1, 3)]   # rank 2 is gone
    time.sleep(0.2)
    assert all(c._thread.is_alive() for c in census)          # waiting, nothing answered yet
    assert not store.check(["twocircuit/census/1"])
    assert PeerCensus(store, 0, 4).missing(wait_s=1.0) == [2]
    for c in census:
        c._thread.join(2.0)
        assert not c._thread.is_alive()                       # answered once, done
    full = dist.HashStore()
    answering = [PeerCensus(full, r, 3).start_answering(poll_s=0.05) for r in (1, 2)]
    t0 = time.monotonic()
    assert PeerCensus(full, 0, 3).missing(wait_s=10.0) == []   # returns as soon as all answered
    assert time.monotonic() - t0 < 5.0
    idle = PeerCensus(dist.HashStore(), 1, 2).start_answering(poll_s=5.0)
    t0 = time.monotonic()
    idle.stop()                                               # the end of a run: stops at once
    assert not idle._thread.is_alive() and time.monotonic() - t0 < 1.0

    class Gone:
        def set(self, *a):
            raise RuntimeError("Connection reset by peer")

        def check(self, *a):
            raise RuntimeError("Connection reset by peer")
    assert PeerCensus(Gone(), 0, 2).missing(0.1) is None
    PeerCensus(Gone(), 1, 2).answer_when_asked()              # returns quietly


def test_fault_specs():
    f = parse_fault("kill-in-checkpoint:rank=1:step=4")
    assert (f.action, f.rank, f.step) == ("kill-in-checkpoint", 1, 4)
    assert parse_fault("") is None and parse_fault(None) is None
    for bad in ("explode:rank=1:step=2", "kill:rank=1", "kill:rank=a:step=2", "kill:node=1:step=2"):
        with pytest.raises(ConfigError, match="DS_TWOCIRCUIT_FAULT"):
            parse_fault(bad)


@pytest.mark.multiproc
def test_a_clean_run_destroys_its_process_group(tmp_path):
    """Every rank ends a finished run with its process group destroyed, as PyTorch asks: left alive,
    gloo's threads can outlive the interpreter, and a rank that saved everything then aborts at
    exit (SIGABRT, "terminate called without an active exception"), failing the launch (seen once
    in CI under ``accelerate launch``). Also after a configuration error found after start-up."""
    from launch_helpers import CONFIGS, torchrun
    script = tmp_path / "wrapped_train.py"
    script.write_text("import sys, torch.distributed as dist\n"
                      "from ds_twocircuit.train import run\n"
                      "rc = run(sys.argv[1:])\n"
                      "print(f'RC {rc} GROUP_ALIVE {dist.is_initialized()}', flush=True)\n")
    common = ["--model", "tiny", "--deepspeed", os.path.join(CONFIGS, "m95.json"), "--seq-len", "16",
              "--eval-sequences", "0"]
    ok = torchrun(2, [*common, "--steps", "2", "--output-dir", str(tmp_path / "ok")], script=str(script))
    assert ok.stdout.count("RC 0 GROUP_ALIVE False") == 2, ok.stdout[-3000:] + ok.stderr[-3000:]
    bad = torchrun(2, [*common, "--steps", "2", "--output-dir", str(tmp_path / "bad"),
                       "--resume", str(tmp_path / "nowhere")], script=str(script), check=False)
    assert bad.stdout.count("RC 2 GROUP_ALIVE False") == 2, bad.stdout[-3000:] + bad.stderr[-3000:]
