"""When a rank dies: bounded loss of work, one clear line, and an automatic way back.

Pure pieces (no process group): the checkpoint policy (every N steps, or every M minutes turned
into a step interval that all ranks agree on), finding the newest *committed* checkpoint (its
``twocircuit/COMPLETE.json`` is written last, after every rank's files are in place, so a crash
mid-write never leaves one that looks complete), pruning, recognising a lost peer in an
exception, and the resume command. :class:`PeerCensus` asks the launcher's store which ranks are
still alive after a fault. :func:`maybe_inject` is the fault-injection hook the tests (and users
rehearsing a failure) drive through ``DS_TWOCIRCUIT_FAULT``.
"""
from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import signal
import threading
import time
from dataclasses import dataclass

from .config import ConfigError

STATE_DIR = "twocircuit"
COMMITTED = "COMPLETE.json"
FAULT_ENV = "DS_TWOCIRCUIT_FAULT"
EXIT_PEER_LOST = 3
_TAG = re.compile(r"^global_step(\d+)$")


# ------------------------------------------------------------------------------------------------
# checkpoint policy

@dataclass
class CheckpointPolicy:
    """``every_steps`` > 0 wins; else ``every_minutes`` > 0 becomes a step interval once the step
    time is known (:meth:`calibrate`, fed the same measured value on every rank); both 0: off."""
    every_steps: int = 0
    every_minutes: float = 0.0
    keep: int = 2

    def __post_init__(self):
        if self.every_steps < 0:
            raise ConfigError(f"--save-interval must be >= 0 steps, got {self.every_steps}")
        if not (self.every_minutes >= 0 and math.isfinite(self.every_minutes)):
            raise ConfigError(f"--save-interval-minutes must be >= 0, got {self.every_minutes}")
        if self.keep < 1:
            raise ConfigError(f"--keep-checkpoints must be >= 1, got {self.keep}")
        self.interval = self.every_steps

    @property
    def enabled(self) -> bool:
        return self.every_steps > 0 or self.every_minutes > 0

    @property
    def needs_calibration(self) -> bool:
        return self.every_steps == 0 and self.every_minutes > 0 and self.interval == 0

    def calibrate(self, step_seconds: float) -> int:
        """Turn the time interval into steps from the (agreed) seconds per step."""
        self.interval = max(1, int(self.every_minutes * 60.0 // max(step_seconds, 1e-9)))
        return self.interval

    def due(self, done_steps: int, total_steps: int) -> bool:
        """After ``done_steps`` optimizer steps (global count): write one now? The end of the run
        is handled by the caller (``--save-checkpoint``)."""
        return self.interval > 0 and done_steps % self.interval == 0 and done_steps < total_steps


# ------------------------------------------------------------------------------------------------
# committed checkpoints

def tag_step(tag: str) -> int | None:
    m = _TAG.match(tag)
    return int(m.group(1)) if m else None


def is_committed(ckpt_dir: str, tag: str) -> bool:
    return os.path.isfile(os.path.join(ckpt_dir, tag, STATE_DIR, COMMITTED))


def committed_checkpoints(ckpt_dir: str) -> list[tuple[int, str]]:
    """(step, tag folder) of every committed checkpoint under ``ckpt_dir``, oldest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    out = []
    for tag in os.listdir(ckpt_dir):
        step = tag_step(tag)
        if step is not None and is_committed(ckpt_dir, tag):
            out.append((step, os.path.join(ckpt_dir, tag)))
    return sorted(out)


def newest_committed(ckpt_dir: str) -> tuple[int, str] | None:
    found = committed_checkpoints(ckpt_dir)
    return found[-1] if found else None


def prune(ckpt_dir: str, keep: int, committed_steps: list[int]) -> list[str]:
    """Delete every ``global_step*`` folder older than the ``keep`` newest committed steps (the
    committed ones this run wrote: on a node without a shared filesystem the marker may live only
    on rank 0's node, so this is decided from the run's own record). Returns what was removed."""
    if len(committed_steps) < keep:
        return []
    oldest_kept = sorted(committed_steps)[-keep]
    removed = []
    for tag in sorted(os.listdir(ckpt_dir)) if os.path.isdir(ckpt_dir) else []:
        step = tag_step(tag)
        if step is not None and step < oldest_kept:
            shutil.rmtree(os.path.join(ckpt_dir, tag), ignore_errors=True)
            removed.append(tag)
    return removed


# ------------------------------------------------------------------------------------------------
# recognising a lost peer

class Stopped(RuntimeError):
    """Raised by the SIGTERM handler: the launcher is stopping this rank (another one failed)."""


_PEER_PATTERNS = (
    (re.compile(r"Connection closed by peer \[?([^\]\s]*)\]?:?(\d*)", re.I), "connection closed by peer {0}"),
    (re.compile(r"Connection reset by peer", re.I), "connection reset by peer"),
    (re.compile(r"Broken pipe", re.I), "broken pipe to a peer"),
    (re.compile(r"Timed out waiting (\d+)ms for (\w+)", re.I), "no answer within {0} ms, {1} timed out"),
    (re.compile(r"timed out|timeout", re.I), "timed out: {msg}"),
    (re.compile(r"NCCL (error|communicator was aborted)|ncclRemoteError|ncclSystemError", re.I),
     "NCCL reported a remote failure"),
)


def lost_peer_reason(exc: BaseException) -> str | None:
    """A short reason when ``exc`` says a peer stopped, hung or became unreachable; None when
    it is some other error (which should keep its traceback)."""
    if isinstance(exc, Stopped):
        return str(exc)
    if not isinstance(exc, RuntimeError):   # gloo/NCCL errors and torch's DistError are RuntimeErrors
        return None
    text = f"{type(exc).__name__}: {exc}"
    for pattern, fmt in _PEER_PATTERNS:
        m = pattern.search(text)
        if m:
            first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
            return fmt.format(*[g for g in m.groups() if g is not None], msg=first)
    return None


def resume_command(argv: list[str], env: dict | None = None) -> str:
    """The launch command that resumes this run: the same arguments plus ``--resume auto``."""
    env = os.environ if env is None else env
    args, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--resume":
            skip = True
            continue
        if a.startswith("--resume=") or a.startswith("--local_rank") or a.startswith("--local-rank"):
            continue
        args.append(a)
    args += ["--resume", "auto"]
    tail = "launch/train.py " + " ".join(shlex.quote(a) for a in args)
    world = int(env.get("WORLD_SIZE", "1"))
    local = int(env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or world)
    if world <= 1:
        return f"python {tail}"
    if "TORCHELASTIC_RUN_ID" in env and local == world:
        return f"torchrun --nproc_per_node {world} {tail}"
    if local == world:
        return f"deepspeed --num_gpus {world} {tail}"
    return f"<your launch command on every node> {tail}"


# ------------------------------------------------------------------------------------------------
# who is still there

class PeerCensus:
    """Which ranks are still there after a fault. Every rank keeps a thread that looks at the
    launcher's store once a second (one tiny ``check`` request; no blocking call, so the thread
    stops cleanly with the run); the rank that hits a fault rings (``<key>/roll``), every living
    rank's thread answers -- also while its main thread is stuck in a collective -- and ranks that
    never answer within ``wait_s`` are the ones that stopped, hung (SIGSTOP stops the thread too)
    or became unreachable. If the store itself is gone (it lives on torchrun's agent, or in global
    rank 0 under the DeepSpeed launcher), :meth:`missing` returns None and the diagnosis names no
    rank."""

    def __init__(self, store, rank: int, size: int, key: str = "twocircuit/census"):
        self.store, self.rank, self.size, self.key = store, rank, size, key
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def answer_when_asked(self, poll_s: float = 1.0) -> None:
        """Until :meth:`stop`: answer a ring; return quietly if the store goes away."""
        while not self._stop.is_set():
            try:
                if self.store.check([f"{self.key}/roll"]):
                    self.store.set(f"{self.key}/{self.rank}", str(os.getpid()))
                    return
            except Exception:
                return
            self._stop.wait(poll_s)

    def start_answering(self, poll_s: float = 1.0) -> "PeerCensus":
        self._thread = threading.Thread(target=self.answer_when_asked, args=(poll_s,),
                                        name="twocircuit-census", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)

    def missing(self, wait_s: float = 3.0) -> list[int] | None:
        try:
            self.store.set(f"{self.key}/{self.rank}", str(os.getpid()))
            self.store.set(f"{self.key}/roll", str(self.rank))
            deadline = time.monotonic() + wait_s
            while True:
                gone = [r for r in range(self.size) if not self.store.check([f"{self.key}/{r}"])]
                if not gone or time.monotonic() >= deadline:
                    return gone
                time.sleep(0.1)
        except Exception:  # the store went with the rank that hosted it
            return None


# ------------------------------------------------------------------------------------------------
# fault injection (tests, rehearsals)

@dataclass
class Fault:
    action: str      # kill | stop | kill-in-checkpoint
    rank: int
    step: int


def parse_fault(spec: str | None) -> Fault | None:
    """``DS_TWOCIRCUIT_FAULT="kill:rank=1:step=3"`` (also ``stop`` = SIGSTOP, and
    ``kill-in-checkpoint``: SIGKILL after this rank's checkpoint files are written, before the
    checkpoint is committed). Fires only in a launch's first attempt (torchrun restarts are
    left alone), once."""
    if not spec:
        return None
    parts = spec.split(":")
    action = parts[0]
    if action not in ("kill", "stop", "kill-in-checkpoint"):
        raise ConfigError(f"{FAULT_ENV}={spec!r}: action must be kill, stop or kill-in-checkpoint")
    kv = {}
    for p in parts[1:]:
        k, _, v = p.partition("=")
        if k not in ("rank", "step") or not v.isdigit():
            raise ConfigError(f"{FAULT_ENV}={spec!r}: expected <action>:rank=R:step=S")
        kv[k] = int(v)
    if set(kv) != {"rank", "step"}:
        raise ConfigError(f"{FAULT_ENV}={spec!r}: expected <action>:rank=R:step=S")
    return Fault(action, kv["rank"], kv["step"])


def maybe_inject(fault: Fault | None, action: str, rank: int, step: int) -> None:
    if fault is None or fault.action != action or fault.rank != rank or fault.step != step:
        return
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    os.kill(os.getpid(), signal.SIGSTOP if action == "stop" else signal.SIGKILL)
