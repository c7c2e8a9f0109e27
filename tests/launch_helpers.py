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


def torchrun_nodes(nprocs: int, args_per_node: list[list[str]], timeout: int = 600):
    """One torchrun per node on this host (``--nnodes N --node_rank k``, a static master), each with
    its own arguments (e.g. its own --output-dir: nodes without a shared folder). Every node's
    launch runs in its own process group, killed on a timeout; fails with every node's output."""
    port, nodes = free_port(), len(args_per_node)
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node_rank",
                               str(k), "--nproc_per_node", str(nprocs), "--master_addr", "127.0.0.1", "--master_port",
                               str(port), TRAIN, *args], cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
             for k, args in enumerate(args_per_node)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout))
    except subprocess.TimeoutExpired:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
        logs = [p.communicate() for p in procs]
        raise AssertionError("nodes timed out:\n" + "\n".join(o[-3000:] + e[-5000:] for o, e in logs))
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] + e[-5000:] for o, e in logs)
    return logs


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
