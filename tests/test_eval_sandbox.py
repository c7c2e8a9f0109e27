"""The sandbox for model-written code: every escape is contained and the evaluator survives.

Each test fails if the side effect happens (a file outside the work dir, a connection to the
test's own listening socket, a process left behind, the test process killed)."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from eval.sandbox import Limits, Sandbox

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux sandbox")
TIMEOUT = 3.0


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(Limits(timeout_s=TIMEOUT))


def _sandbox_processes() -> list[int]:
    """Processes started by any sandbox (they carry DS_TWOCIRCUIT_SANDBOX in their environment)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if b"DS_TWOCIRCUIT_SANDBOX=" in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def _assert_no_leftovers(deadline_s: float = 5.0):
    end = time.monotonic() + deadline_s
    while _sandbox_processes():
        assert time.monotonic() < end, f"sandbox processes still alive: {_sandbox_processes()[:10]}"
        time.sleep(0.05)


def test_strong_isolation_on_this_machine(sandbox):
    """Where namespaces work (root or user namespaces), the sandbox must use them."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare here")
    assert sandbox.isolation in ("namespaces", "userns")
    if os.geteuid() == 0:
        assert sandbox.isolation == "namespaces"
        r = sandbox.run("import os; print(os.getuid(), os.getgid(), os.getgroups())")
        assert r.passed and r.stdout.split()[0] == "65534"  # runs as nobody


def test_ok_program_passes_and_can_use_its_workdir(sandbox):
    r = sandbox.run_check("open('scratch.txt', 'w').write('x' * 10)\nassert open('scratch.txt').read() == 'x' * 10\n"
                          "import hashlib, math\nprint(hashlib.md5(b'a').hexdigest(), math.pi)")
    assert r.status == "passed", r.stderr
    assert "0cc175b9c0f1b6a831c399e269772661" in r.stdout


def test_failing_and_early_exit_programs_do_not_pass(sandbox):
    assert sandbox.run_check("assert 1 == 2").status == "failed"
    assert sandbox.run_check("raise SystemExit(0)\n").status == "failed"   # exits 0 before the marker
    assert sandbox.run_check("import os\nos._exit(0)\n").status == "failed"
    assert sandbox.run_check("def f(:\n").status == "failed"               # syntax error


def test_infinite_loop_times_out(sandbox):
    t0 = time.monotonic()
    r = sandbox.run_check("while True:\n    pass\n")
    assert r.status == "timed out"
    assert time.monotonic() - t0 < TIMEOUT + 3
    _assert_no_leftovers()


def test_sleeping_program_times_out_on_wall_clock(sandbox):
    r = sandbox.run_check("import time\ntime.sleep(3600)\n")
    assert r.status == "timed out"


def test_fork_bomb_is_contained(sandbox):
    bomb = ("import os, time\n"
            "while True:\n"
            "    try:\n"
            "        os.fork()\n"
            "    except OSError:\n"
            "        time.sleep(0.001)\n")
    if sandbox.isolation == "none" and os.geteuid() == 0:
        pytest.fail("no PID namespace and RLIMIT_NPROC does not bind root: a fork bomb is not contained")
    t0 = time.monotonic()
    r = sandbox.run_check(bomb)
    assert r.status in ("timed out", "failed")
    assert time.monotonic() - t0 < TIMEOUT + 5
    _assert_no_leftovers()
    assert subprocess.run(["true"]).returncode == 0  # the evaluator can still start processes


def test_daemonised_children_die_with_the_program(sandbox):
    prog = ("import os, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    time.sleep(3600)\n"
            "print('parent done')\n")
    r = sandbox.run(prog)
    assert r.passed and "parent done" in r.stdout
    _assert_no_leftovers()


def test_huge_allocation_fails_without_hurting_the_evaluator(sandbox):
    r = sandbox.run_check("x = bytearray(50 * 1024 ** 3)\n")
    assert r.status == "failed" and "MemoryError" in r.stderr
    small = Sandbox(Limits(timeout_s=TIMEOUT, memory_mb=512))  # growth until the limit, quickly
    r = small.run_check("chunks = []\nwhile True:\n    chunks.append(bytearray(256 * 1024 ** 2))\n")
    assert r.status == "failed" and "MemoryError" in r.stderr


def test_writes_outside_the_workdir_fail(sandbox, tmp_path):
    target = tmp_path / "escaped.txt"
    host_tmp = f"/tmp/ds_tc_escape_{os.getpid()}.txt"
    cwd_escape = os.path.join(os.getcwd(), f"ds_tc_escape_{os.getpid()}.txt")
    for path in (str(target), cwd_escape):
        r = sandbox.run_check(f"open({path!r}, 'w').write('escaped')\n")
        assert r.status == "failed", path
        assert not os.path.exists(path), f"the sandbox wrote {path}"
    # /tmp inside the sandbox is a private tmpfs: writing there works but never reaches the host
    r = sandbox.run_check(f"open({host_tmp!r}, 'w').write('escaped')\n")
    try:
        assert not os.path.exists(host_tmp), "the sandbox wrote to the host's /tmp"
    finally:
        if os.path.exists(host_tmp):
            os.remove(host_tmp)


def test_cannot_open_sockets_to_the_host():
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(5)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    try:
        sb = Sandbox(Limits(timeout_s=TIMEOUT))
        prog = ("import socket\n"
                f"s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                "s.sendall(b'escaped')\n")
        r = sb.run_check(prog)
        assert r.status == "failed", r.stdout
        with pytest.raises((socket.timeout, BlockingIOError)):
            conn, _ = listener.accept()
            conn.close()
        r = sb.run_check("import socket\nsocket.getaddrinfo('pypi.org', 443)\n")
        assert r.status == "failed"
    finally:
        listener.close()


def test_cannot_kill_the_evaluator(sandbox):
    me, group = os.getpid(), os.getpgrp()
    prog = ("import os, signal\n"
            "errors = []\n"
            f"for target in ({me}, {os.getppid()}, 1):\n"
            "    try:\n"
            "        os.kill(target, signal.SIGKILL)\n"
            "    except OSError as e:\n"
            "        errors.append(type(e).__name__)\n"
            "try:\n"
            f"    os.killpg({group}, signal.SIGKILL)\n"
            "except OSError as e:\n"
            "    errors.append(type(e).__name__)\n"
            "print(errors)\n")
    if sandbox.isolation == "none":
        pytest.fail("without namespaces the sandbox cannot keep a same-user program from signalling the evaluator")
    sandbox.run(prog)
    if sandbox.isolation == "namespaces":  # kill(-1) is safe only inside a PID namespace
        sandbox.run("import os, signal\nos.kill(-1, signal.SIGKILL)\n")
    assert os.getpid() == me  # still here
    assert subprocess.run(["true"]).returncode == 0


def test_output_flood_is_bounded(sandbox):
    r = sandbox.run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n")
    assert r.status in ("failed", "timed out")
    assert len(r.stdout) < 100_000


def test_run_many_keeps_order_and_isolates_failures(sandbox):
    progs = ["print(1)", "while True: pass", "assert False", "print(2)"]
    t0 = time.monotonic()
    res = sandbox.run_many(progs, workers=2, check=True, progress=False)
    assert [r.status for r in res] == ["passed", "timed out", "failed", "passed"]
    assert time.monotonic() - t0 < 2 * TIMEOUT + 5


def test_no_namespace_fallback_keeps_timeouts_and_memory_limits():
    sb = Sandbox(Limits(timeout_s=2.0), isolation="none")
    assert sb.isolation == "none"
    assert sb.run_check("print('ok')").status == "passed"
    assert sb.run_check("while True: pass").status == "timed out"
    r = sb.run_check("x = bytearray(50 * 1024 ** 3)")
    assert r.status == "failed" and "MemoryError" in r.stderr
    _assert_no_leftovers()


def test_unknown_isolation_is_rejected():
    with pytest.raises(ValueError):
        Sandbox(isolation="chroot")


def test_sigterm_handler_in_program_does_not_prevent_kill(sandbox):
    prog = ("import signal, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "while True:\n    time.sleep(0.01)\n")
    # the dispositions this process inherited (a background launch ignores SIGINT): the program's
    # handlers must not leak into them, whatever they were
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    assert sandbox.run_check(prog).status == "timed out"
    _assert_no_leftovers()
    assert {s: signal.getsignal(s) for s in before} == before


def test_long_output_keeps_the_pass_marker(sandbox):
    r = sandbox.run_check("for i in range(20000):\n    print('line', i)\n")
    assert r.status == "passed" and "bytes omitted" in r.stdout and "line 19999" in r.stdout
