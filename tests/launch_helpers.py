"""Run launch/train.py in real multi-process worlds (torchrun or the deepspeed launcher)."""
import json
import os
import signal
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "launch", "train.py")
CONFIGS = os.path.join(ROOT, "ds_configs")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(extra: dict | None = None) -> dict:
    e = dict(os.environ, **(extra or {}))
    e.setdefault("OMP_NUM_THREADS", "1")
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    return e


def torchrun(nprocs: int, args: list[str], timeout: int = 600, check: bool = True, extra_env=None,
             max_restarts: int = 0, script: str = TRAIN):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nprocs),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           *(["--max-restarts", str(max_restarts)] if max_restarts else []), script] + args
    return _run(cmd, timeout, check, extra_env)


def deepspeed_launch(nprocs: int, args: list[str], timeout: int = 900, check: bool = True, extra_env=None):
    ds = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [ds, "--num_gpus", str(nprocs), "--master_port", str(free_port()), TRAIN] + args
    return _run(cmd, timeout, check, extra_env)


def _run(cmd, timeout, check, extra_env=None):
    """Run a launch in its own process group. On a timeout the whole group is killed (the launcher's
    workers and the anchor circuit's children too: left behind, they slow every later test) and the
    failure shows what the launch printed until then."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(extra_env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} timed out after {timeout} s:\n{out[-4000:]}\n{err[-8000:]}")
    p = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}")
    return p


def read_metrics(out_dir) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(l) for l in f if l.strip()]


def read_summary(out_dir) -> dict:
    with open(os.path.join(out_dir, "summary.json")) as f:
        return json.load(f)


def read_weights(hf_dir) -> dict:
    """Every tensor of a run's hf/ folder (one shard per pipeline stage, or one file)."""
    from ds_twocircuit.export import read_state
    return read_state(hf_dir)


def hub_offline(monkeypatch) -> None:
    """No Hugging Face hub for this test: the environment variables, and the libraries' own flags
    (read when they are imported, which an earlier test may have done; without them the hub client
    retries with back-off for minutes on a machine with no network)."""
    import datasets
    import huggingface_hub.constants
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
