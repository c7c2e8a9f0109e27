"""Run model-written Python in a confined child process (HumanEval, MBPP).

Invariant: nothing a program does can kill, hang or outgrow the evaluator, reach the network, or
leave a file behind outside its own throwaway working directory. Layers, strongest first:

* ``namespaces`` (root): ``unshare --net --pid --mount --fork --kill-child``: no network (a fresh
  network namespace with only a downed loopback), its own PID namespace (the program is PID 1:
  when it exits or is killed the kernel kills every process it started, fork bombs included),
  every mount read-only, fresh tmpfs over ``/tmp``, ``/var/tmp``, ``/dev/shm``, and the program
  runs as ``nobody``;
* ``userns`` (unprivileged users where user namespaces are enabled): the same namespaces inside a
  user namespace; files stay protected by the read-only mounts instead of the uid switch;
* ``none`` (no namespaces at all): a child in its own session with the same limits; a warning is
  logged and the isolation level is recorded with the results.

Always: a wall-clock deadline after which the whole process group is SIGKILLed, ``RLIMIT_AS``
(memory), ``RLIMIT_CPU``, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``, ``RLIMIT_NPROC``, no core dumps,
``oom_score_adj = 1000`` (the OOM killer takes the program, never the evaluator), output captured
to bounded files rather than pipes (a program that daemonises cannot hold the evaluator's read).
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import logging
import math
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

log = logging.getLogger(__name__)

INIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_init.py")
SETUP_FAILED = 97
ISOLATIONS = ("namespaces", "userns", "none")
_NS_FLAGS = ["--net", "--pid", "--mount", "--fork", "--kill-child", "--mount-proc"]
_OUTPUT_LIMIT = 64 * 1024


@dataclasses.dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0     # wall clock, from start to SIGKILL of the whole tree
    memory_mb: int = 2048       # RLIMIT_AS per process
    file_mb: int = 16           # RLIMIT_FSIZE: largest file (and captured output) a program writes
    nofile: int = 64
    nproc: int = 64             # RLIMIT_NPROC (per uid; root ignores it, hence the PID namespace)
    tmpfs_mb: int = 64

    @property
    def cpu_s(self) -> int:
        return int(math.ceil(self.timeout_s)) + 1


@dataclasses.dataclass
class ExecResult:
    status: str                 # "passed" | "failed" | "timed out"
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def _nobody() -> tuple[int, int]:
    try:
        pw = pwd.getpwnam("nobody")
        return pw.pw_uid, pw.pw_gid
    except KeyError:
        return 65534, 65534


def _read_bounded(f) -> str:
    """The output, or its head and tail when it is long (the pass marker is the last line)."""
    size = f.seek(0, os.SEEK_END)
    f.seek(0)
    if size <= _OUTPUT_LIMIT:
        return f.read().decode("utf-8", "replace")
    half = _OUTPUT_LIMIT // 2
    head = f.read(half)
    f.seek(size - half)
    tail = f.read(half)
    return (head.decode("utf-8", "replace") + f"\n[... {size - 2 * half} bytes omitted ...]\n"
            + tail.decode("utf-8", "replace"))


class Sandbox:
    """``run(source)`` executes one program; ``run_many`` a batch on a small thread pool."""

    def __init__(self, limits: Limits | None = None, isolation: str = "auto",
                 python: str | None = None):
        if isolation not in ("auto",) + ISOLATIONS:
            raise ValueError(f"sandbox isolation {isolation!r}; allowed: auto, {', '.join(ISOLATIONS)}")
        self.limits = limits or Limits()
        self.python = python or getattr(sys, "_base_executable", None) or sys.executable
        self._requested = isolation
        self._isolation: str | None = None
        self._lock = threading.Lock()

    # -------------------------------------------------------------- isolation level
    @property
    def isolation(self) -> str:
        with self._lock:
            if self._isolation is None:
                self._isolation = self._choose()
        return self._isolation

    def _choose(self) -> str:
        unshare = shutil.which("unshare")
        candidates = ISOLATIONS if self._requested == "auto" else (self._requested,)
        reasons = []
        for iso in candidates:
            if iso == "namespaces" and os.geteuid() != 0:
                reasons.append("namespaces: needs root")
                continue
            if iso in ("namespaces", "userns") and unshare is None:
                reasons.append(f"{iso}: the unshare command (util-linux) is missing")
                continue
            probe = self._run(f"import os\nprint('sandbox-ok', os.getuid())\n", iso, Limits(timeout_s=20))
            if probe.returncode == 0 and "sandbox-ok" in probe.stdout:
                if iso == "none":
                    log.warning("sandbox: no Linux namespaces available (%s); model-written code "
                                "runs with timeouts and resource limits only, without network or "
                                "filesystem isolation", "; ".join(reasons) or "requested")
                return iso
            reasons.append(f"{iso}: {(probe.stderr.strip().splitlines() or ['probe failed'])[-1][:200]}")
            if self._requested != "auto":
                break
        raise RuntimeError("sandbox: no usable isolation level (" + "; ".join(reasons) + ")")

    # -------------------------------------------------------------- execution
    def run(self, source: str) -> ExecResult:
        """Run ``source``; ``passed`` means exit status 0."""
        return self._run(source, self.isolation, self.limits)

    def run_check(self, program: str) -> ExecResult:
        """Run a test program; ``passed`` only if it exits 0 *after* printing a fresh secret marker
        appended to its end (so an early ``exit(0)`` in model code does not count as a pass)."""
        marker = "__sandbox_done_" + secrets.token_hex(8)
        res = self.run(program + f"\n\nprint({marker!r}, flush=True)\n")
        if res.status == "passed" and marker not in res.stdout.splitlines()[-1:]:
            res.status = "failed"
        res.stdout = res.stdout.replace(marker, "").rstrip("\n")
        return res

    def run_many(self, programs: list[str], workers: int | None = None, check: bool = True,
                 desc: str = "executing", progress: bool = True) -> list[ExecResult]:
        from tqdm.auto import tqdm
        workers = workers or min(4, os.cpu_count() or 1)
        self.isolation  # probe once before the pool starts
        fn = self.run_check if check else self.run
        out: list[ExecResult | None] = [None] * len(programs)
        with cf.ThreadPoolExecutor(max_workers=max(1, workers)) as pool, \
                tqdm(total=len(programs), desc=desc, unit="prog", leave=False, disable=not progress) as bar:
            futs = {pool.submit(fn, p): i for i, p in enumerate(programs)}
            for f in cf.as_completed(futs):
                out[futs[f]] = f.result()
                bar.update(1)
        return out  # type: ignore[return-value]

    def _run(self, source: str, isolation: str, limits: Limits) -> ExecResult:
        host = tempfile.mkdtemp(prefix="ds_tc_sandbox_")
        os.chmod(host, 0o700)
        try:
            program = os.path.join(host, "program.py")
            with open(program, "w", encoding="utf-8") as f:
                f.write(source)
            ns = isolation in ("namespaces", "userns")
            workdir = None
            if not ns:
                workdir = os.path.join(host, "work")
                os.mkdir(workdir, 0o700)
            settings = {"program": program, "mount_namespace": ns, "workdir": workdir,
                        "drop_to": list(_nobody()) if os.geteuid() == 0 and isolation != "userns" else None,
                        "memory_mb": limits.memory_mb, "cpu_s": limits.cpu_s, "file_mb": limits.file_mb,
                        "nofile": limits.nofile, "nproc": limits.nproc, "tmpfs_mb": limits.tmpfs_mb,
                        "tag": secrets.token_hex(6)}
            if workdir is not None and settings["drop_to"]:
                os.chmod(host, 0o711)  # nobody must reach work/ (it gets chowned by the init)
            cmd = [self.python, "-I", "-S", INIT, json.dumps(settings)]
            if isolation == "namespaces":
                cmd = ["unshare", *_NS_FLAGS, "--"] + cmd
            elif isolation == "userns":
                cmd = ["unshare", "--user", "--map-root-user", *_NS_FLAGS, "--"] + cmd
            return self._spawn(cmd, limits.timeout_s)
        finally:
            shutil.rmtree(host, ignore_errors=True)

    @staticmethod
    def _spawn(cmd: list[str], timeout: float) -> ExecResult:
        t0 = time.monotonic()
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True, close_fds=True)
            # Wait *without reaping*: while the leader is an unreaped zombie its pid (= the process
            # group id) cannot be reused, so the group kill below can never hit another process.
            timed_out = not _wait_exit(proc.pid, timeout)
            try:  # the whole group: with no namespaces, stray children die here too
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            rc = proc.wait()
            wall = time.monotonic() - t0
            stdout, stderr = _read_bounded(out), _read_bounded(err)
        if timed_out:
            status = "timed out"
        elif rc == SETUP_FAILED and "[sandbox setup]" in stderr:
            status = "failed"
            stderr = "sandbox setup failed: " + stderr
        else:
            status = "passed" if rc == 0 else "failed"
        return ExecResult(status, rc, stdout, stderr, round(wall, 4))


def _wait_exit(pid: int, timeout: float) -> bool:
    """Block until ``pid`` (our child) exits or ``timeout`` passes; never reaps it."""
    deadline = time.monotonic() + timeout
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        import select
        try:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                if poller.poll(min(left, 60.0) * 1000):
                    return True
        finally:
            os.close(fd)
    delay = 0.001
    while True:  # no pidfd: poll waitid(WNOWAIT)
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is not None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.02)
