"""Inside the sandbox, before the untrusted program: confine, then exec it.

Run by :mod:`eval.sandbox` as ``python -I -S _sandbox_init.py <settings json>``: under
``unshare --mount --net --pid --fork --kill-child --mount-proc`` (isolation ``namespaces`` or
``userns``) or as a plain child in its own session (isolation ``none``). Standard library only:
nothing from the evaluator is imported here. Steps, in order:

1. (mount namespace) make every inherited mount private and read-only, mount fresh size-limited
   tmpfs over ``/tmp``, ``/var/tmp`` and ``/dev/shm``, create the working directory in the new
   ``/tmp``, and bind the Python installation read-only where an unprivileged user can reach it;
2. copy the program (a root-only file on the host) into the working directory;
3. make this process tree the OOM killer's first choice, set the resource limits;
4. (root) drop to ``nobody`` with no supplementary groups;
5. exec the interpreter on the program.

Any failure of a promised confinement exits with :data:`SETUP_FAILED` so that the evaluator never
runs model code under weaker isolation than it reports.
"""
import ctypes
import json
import os
import resource
import stat
import sys

SETUP_FAILED = 97

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 32, 1024, 2048, 4096
MS_REC, MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 16384, 1 << 18, 1 << 21, 1 << 24
_OPT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
              "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
# Kernel filesystems whose read-only remount may be refused; nothing writable to nobody lives there.
_PSEUDO = {"proc", "sysfs", "cgroup", "cgroup2", "devpts", "mqueue", "securityfs", "debugfs",
           "tracefs", "pstore", "bpf", "configfs", "fusectl", "binfmt_misc", "hugetlbfs", "autofs",
           "efivarfs", "rpc_pipefs", "nsfs"}

_libc = ctypes.CDLL(None, use_errno=True)


def _fail(msg):
    sys.stderr.write(f"[sandbox setup] {msg}\n")
    sys.stderr.flush()
    os._exit(SETUP_FAILED)


def _mount(src, target, fstype, flags, data=None):
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    if _libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), target)


def _unescape(path):
    return path.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def _mounts():
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            out.append((_unescape(fields[4]), fields[5].split(","), right.split()[0]))
    return out


def _readonly_everything():
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    for target, opts, fstype in _mounts():
        if target == "/proc" or target.startswith("/proc/"):
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for o in opts:
            flags |= _OPT_FLAGS.get(o, 0)
        try:
            _mount(None, target, None, flags)
        except OSError as e:
            if fstype not in _PSEUDO:
                _fail(f"cannot make {target} ({fstype}) read-only: {e}")


def _reachable_by_others(path):
    """True when a user with no special rights can traverse to ``path`` and read it."""
    p = os.path.abspath(path)
    while True:
        try:
            if not os.stat(p).st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
        parent = os.path.dirname(p)
        if parent == p:
            return True
        p = parent


def _private_tmp(s):
    size = f"size={int(s['tmpfs_mb'])}m"
    for t in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(t):
            _mount("tmpfs", t, "tmpfs", MS_NOSUID | MS_NODEV, f"{size},mode=1777")
    work = "/tmp/work"
    os.mkdir(work, 0o700)
    exe = os.path.realpath(sys.executable)
    prefix = sys.base_prefix
    if not _reachable_by_others(os.path.dirname(exe)) and exe.startswith(prefix + os.sep):
        mirror = "/tmp/.python"
        os.mkdir(mirror, 0o755)
        _mount(prefix, mirror, None, MS_BIND | MS_REC)
        _mount(None, mirror, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        exe = mirror + exe[len(prefix):]
    return work, exe


def _limits(s):
    mb = 1 << 20
    lim = [(resource.RLIMIT_AS, int(s["memory_mb"]) * mb), (resource.RLIMIT_CPU, int(s["cpu_s"])),
           (resource.RLIMIT_FSIZE, int(s["file_mb"]) * mb), (resource.RLIMIT_NOFILE, int(s["nofile"])),
           (resource.RLIMIT_NPROC, int(s["nproc"])), (resource.RLIMIT_CORE, 0)]
    for what, value in lim:
        resource.setrlimit(what, (value, value))


def main():
    s = json.loads(sys.argv[1])
    try:
        with open(s["program"], "rb") as f:  # read before /tmp is replaced
            source = f.read()
        if s["mount_namespace"]:
            _readonly_everything()
            work, exe = _private_tmp(s)
        else:
            work, exe = s["workdir"], os.path.realpath(sys.executable)
        program = os.path.join(work, "program.py")
        with open(program, "wb") as f:
            f.write(source)
        try:
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")
        except OSError:
            pass
        drop = s["drop_to"] if os.geteuid() == 0 else None
        if drop is not None and not s["mount_namespace"] and not _reachable_by_others(os.path.dirname(exe)):
            drop = None  # isolation "none" as root: nobody could not start this interpreter
        if drop is not None:
            uid, gid = drop
            os.chown(work, uid, gid)
            os.chown(program, uid, gid)
        _limits(s)
        os.chdir(work)
        if drop is not None:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            if os.getuid() != uid or os.geteuid() != uid:
                _fail("privileges were not dropped")
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - any setup error means: do not run the program
        _fail(f"{type(e).__name__}: {e}")
    env = {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", "DS_TWOCIRCUIT_SANDBOX": s["tag"]}
    sys.stdout.flush()
    try:
        os.execve(exe, [exe, "-I", "program.py"], env)
    except OSError as e:
        _fail(f"cannot start {exe}: {e}")


if __name__ == "__main__":
    main()
