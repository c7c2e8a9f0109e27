"""Process-group setup for one launch that may hold two circuits.

``deepspeed``/``torchrun`` start ``WORLD_SIZE`` processes. The first ``fast`` ranks form the fast
circuit's world, the remaining ``anchor`` ranks the anchor circuit's world: a DeepSpeed pipeline
topology must span its whole world, so each circuit gets its own default process group. Both
rendezvous through the launcher's store (``env://``, hosted on MASTER_ADDR; no assumption that
ranks share a host) under different prefixes, so one launch line starts both circuits on any
number of nodes.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta

CHILD_ENV = "DS_TWOCIRCUIT_ANCHOR_CHILD"


@dataclass
class World:
    role: str            # "fast" or "anchor"
    rank: int            # rank inside the circuit's world
    size: int            # size of the circuit's world
    global_rank: int
    global_size: int
    local_rank: int
    backend: str
    store_prefix: str = ""   # this circuit's keys on the launcher's store (faults.PeerCensus)

    # the collectives the Trainer needs (its single-process world, trainer.LocalWorld, has the same)
    def sum(self, values: dict) -> dict:
        return sum_over_ranks(values, self)

    def max(self, x: float) -> float:
        return max_over_ranks(x, self)

    def barrier(self) -> None:
        import torch.distributed as dist
        dist.barrier()


def sum_over_ranks(values: dict, world) -> dict:
    """Every rank's ``values`` (floats) summed over the circuit's world, in one float64 collective
    on the comm device."""
    import torch
    import torch.distributed as dist
    keys = sorted(values)
    vec = to_comm(torch.tensor([values[k] for k in keys], dtype=torch.float64))
    if world.size > 1:
        dist.all_reduce(vec)
    return dict(zip(keys, from_comm(vec).tolist()))


def max_over_ranks(x: float, world) -> float:
    """The largest ``x`` over the circuit's ranks (one float64 all-reduce): every rank then takes
    the same decision."""
    import torch
    import torch.distributed as dist
    t = to_comm(torch.tensor([x], dtype=torch.float64))
    if world.size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(from_comm(t)[0])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_env() -> tuple[int, int, int]:
    """(global rank, global world size, local rank); a plain ``python`` run is a world of one."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1",
                          MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port())))
    os.environ.setdefault("LOCAL_RANK", "0")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])


def prepare_runtime() -> None:
    """Process-wide settings that must precede ``import deepspeed`` side effects."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ds_twocircuit",
        "torch_extensions"))
    import deepspeed  # noqa: F401
    from deepspeed.accelerator import get_accelerator
    if get_accelerator().device_name() == "cpu":
        # The shared-memory comm op (~1 min JIT build) only serves inference all-reduce.
        import importlib
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def comm_device():
    """Where a tensor must live to cross the default process group: the rank's accelerator under
    NCCL (which rejects CPU tensors), the CPU under gloo."""
    import torch
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_backend() == "nccl":
        from deepspeed.accelerator import get_accelerator
        return torch.device(get_accelerator().current_device_name())
    return torch.device("cpu")


def to_comm(t):
    """``t`` on :func:`comm_device`: every tensor of ours handed to a collective goes through here
    (float64 and the other NCCL dtypes only; our counters are float64)."""
    return t.to(comm_device())


def from_comm(t):
    """A collective's result back on the CPU, to read it."""
    return t.cpu()


def comm_backend() -> str:
    from deepspeed.accelerator import get_accelerator
    name = get_accelerator().communication_backend_name()
    return "gloo" if name == "ccl" else name  # oneCCL has no send/recv (DeepSpeed #5313)


def store_attempt() -> str:
    """What names this launch attempt's keys on the launcher's store: torchrun's restart count where
    its agent store outlives a restart (every agent restarts together there), else "0" (each
    rendezvous round has a fresh store, and a node that joined late counts its restarts from 0)."""
    return (os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True) else "0")


def _spares_store(timeout_s: float = 60.0):
    return census_store(f"twocircuit/attempt{store_attempt()}/spares/", timeout_s)


def sit_out(grank: int, gsize: int, dp: int, pp: int, timeout_s: float) -> int:
    """A rank left over after a regroup (the ranks are not a multiple of ``--pp``: a pipeline lost
    a stage and drops out as a whole) takes no part in training: it answers the launcher's
    rendezvous, then waits for the run's end (exit 0 with the run) or for torchrun to restart the
    group when a node joins, when it becomes a rank of a whole pipeline again."""
    import torch.distributed as dist
    print(f"[ds_twocircuit] rank {grank} sits out: {gsize} ranks make {dp} whole pipeline(s) of --pp {pp} "
          f"({gsize - dp * pp} left over); it waits for the next regroup (a node joining) or the end of the run",
          file=sys.stderr, flush=True)
    next(dist.rendezvous("env://", rank=grank, world_size=gsize, timeout=timedelta(seconds=max(timeout_s, 60))))
    try:
        store = _spares_store(max(timeout_s, 60))
        store.wait(["done"], timedelta(days=365))
        return 0 if store.get("done") == b"0" else 1
    except Exception:   # the store's host is gone without a word: the run failed, and torchrun restarts it
        return 1


def release_spares(rc: int) -> None:
    """Rank 0, at the run's end: the ranks sitting out end with the run's exit code."""
    _spares_store().set("done", str(rc))


def init_world(anchor_ranks: int = 0, timeout_s: float = 1800, spare_ranks: int = 0) -> World:
    """Initialise torch.distributed (and DeepSpeed's comm) for this process's circuit.

    ``timeout_s`` bounds every wait on a peer (``--peer-timeout``): the world's own operations
    and the sub-groups DeepSpeed creates later (data-parallel, tied-embedding), which would
    otherwise take torch's module default of 30 minutes -- ``new_group`` offers no way in, so
    that default is set here, once, for this process."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    import deepspeed

    c10d.default_pg_timeout = timedelta(seconds=timeout_s)
    if isinstance(getattr(c10d, "default_pg_nccl_timeout", None), timedelta):
        c10d.default_pg_nccl_timeout = timedelta(seconds=timeout_s)

    grank, gsize, lrank = launcher_env()
    backend = comm_backend()
    fast = gsize - anchor_ranks - spare_ranks   # spares (sit_out) never get here: no anchors then
    role = "fast" if grank < fast else "anchor"
    rank, size = (grank, fast) if role == "fast" else (grank - fast, anchor_ranks)
    import torch
    if backend == "nccl":
        torch.cuda.set_device(lrank)
    elif "OMP_NUM_THREADS" not in os.environ:
        # N ranks on one CPU host: split the cores, or intra-op threads oversubscribe them
        # (measured: 3x slower per step with 2 ranks x 2 threads on 2 cores).
        local = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 1)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))
    # One store prefix per circuit and per torchrun restart where the store outlives a restart
    # (store_attempt): torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE) keeps the previous
    # attempt's keys (gloo's peer addresses), which would send a restarted group to dead ports;
    # every agent restarts together there. Where each rendezvous round gets a fresh store (elastic
    # --nnodes MIN:MAX with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), the agents' restart counts
    # differ once a node joins late, so the count must not name the keys.
    store, _, _ = next(dist.rendezvous("env://", rank=grank, world_size=gsize,
                                       timeout=timedelta(seconds=max(timeout_s, 60))))
    prefix = f"twocircuit/attempt{store_attempt()}/{role}/"
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, store),
                            rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s))
    if anchor_ranks:
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(size)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    return World(role, rank, size, grank, gsize, lrank, backend, prefix)


def shutdown_world() -> None:
    """Destroy the process group at a clean end (all ranks finished, everything saved). Without it
    gloo's worker threads can outlive the interpreter, and a rank then aborts after its work is done
    (SIGABRT, "terminate called without an active exception"), failing the whole launch. Not called
    after a lost peer: tearing down a group with a dead member can hang."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


def weights_digest(named_parameters) -> str:
    """SHA-256 of every parameter's bytes, in name order (the bytes never leave the rank)."""
    import hashlib
    import torch
    h = hashlib.sha256()
    for _, p in sorted(named_parameters, key=lambda np_: np_[0]):
        h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def group_agrees(value: str, group, size: int) -> bool:
    """Whether every rank of ``group`` holds the same ``value`` (a digest: 64 characters each)."""
    import torch.distributed as dist
    values = [None] * size
    dist.all_gather_object(values, value, group=group)
    return len(set(values)) == 1


def supervise(argv) -> int:
    """Run the anchor worker as a child process; never fail the launch because of it."""
    env = dict(os.environ, **{CHILD_ENV: "1"})
    cmd = [sys.executable, "-m", "ds_twocircuit.train", *argv]
    child = subprocess.Popen(cmd, env=env)
    pidfile = os.environ.get("DS_TWOCIRCUIT_ANCHOR_PIDFILE")

    def forward(sig, _frame):
        if child.poll() is None:
            child.send_signal(sig)
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    if pidfile:
        with open(f"{pidfile}.{os.environ.get('RANK', '0')}", "w") as f:
            f.write(str(child.pid))
    rc = child.wait()
    if rc != 0:
        print(f"[ds_twocircuit] anchor worker (global rank {os.environ.get('RANK')}) ended with code {rc}; "
              "the fast circuit is unaffected", file=sys.stderr, flush=True)
    return 0


def census_store(prefix: str, timeout_s: float = 10.0):
    """A client of the launcher's store of its own (the process group's client serialises its
    operations, so a blocked ``wait`` there would stall everything else)."""
    import torch.distributed as dist
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                           timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    return dist.PrefixStore(prefix, client)
