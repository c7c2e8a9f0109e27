#!/usr/bin/env python
"""Run a training launch over an emulated slow mesh on one Linux machine.

Every rank runs in its own network namespace ("node"), joined to the others by a bridge, with a
kernel-enforced bandwidth cap on every directed link (HTB). The ranks rendezvous exactly as on a
multi-node cluster (MASTER_ADDR = the first node's address), either started directly (one process
per node) or through the README's own multi-node launch lines (``--per-node-launcher``), so what
crosses the links is what would cross a real network. After the run, the kernel's own byte counters per
directed link are written next to the run's summary (``mesh.json``): a check of the project's
byte accounting against the kernel's, TCP/IP and gloo framing included.

    sudo python launch/mesh.py --ranks 2 --mbit 200 -- launch/train.py --deepspeed ds_configs/m95.json --output-dir runs/m95_mesh
    python launch/mesh.py --ranks 4 --mbit 200 --link 0-1:50 -- launch/train.py --deepspeed ds_configs/m95_dp.json --pp 2 --dp 2
    python launch/mesh.py --ranks 2 --procs-per-node 2 --per-node-launcher deepspeed -- launch/train.py --deepspeed ds_configs/m95_ap.json

Needs root (network namespaces) and iproute2 (``ip``, ``tc``). Namespaces get a unique prefix per
run and are always removed, also when the run fails or is stopped (Ctrl-C, SIGTERM, SIGHUP). A run
killed outright (SIGKILL, a lost machine) cannot clean up: the next run names what it left, and
``python launch/mesh.py --remove-stale`` removes the namespaces of runs that are gone (each run holds
a lock in /run/ds-twocircuit-mesh while it lives; namespaces without one are never removed).
Traffic only flows between the namespaces this run created: there is no route out.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUBNET = "10.77.0"
UNCAPPED_MBIT = 10000   # --mbit 0: the per-link classes run at 10 Gbit/s (faster than 2 cores can send)


def sh(*cmd, check=True):
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def burst(mbit: float) -> int:
    """HTB bucket. An idle link refills its whole bucket, which then crosses at line rate, so the
    bucket is traffic the cap lets through free at the start of every transfer: 256 KiB let a
    third of a 0.76 MB all-reduce through free at 8 Mbit/s, and 16 KiB made 2-stage pipeline
    steps 13% faster than the link allows. About 1 ms of traffic (at least 3000 bytes, two
    packets) below 1 Gbit/s; 10 ms from 1 Gbit/s, where smaller buckets under-shoot the rate."""
    if mbit >= 1000:
        return int(mbit * 1e6 / 8 / 100)
    return max(3000, int(mbit * 1e6 / 8 / 1000))


class Mesh:
    def __init__(self, ranks: int, mbit: float, links: dict[tuple[int, int], float]):
        self.n, self.mbit, self.links = ranks, mbit, links
        self.prefix = f"tcm{os.getpid()}x"   # unique among live runs; <= 15 characters with "v{i}"
        self.up_done = False
        self.lock = None

    def ns(self, i) -> str:
        return f"{self.prefix}{i}"

    def rate(self, i, j) -> float:
        return self.links.get((i, j), self.mbit)

    def up(self):
        # held while this run lives (the kernel drops it when the process dies, even by SIGKILL):
        # how a later run tells a dead run's namespaces from a live one's, whatever its pid space
        os.makedirs(LOCK_DIR, exist_ok=True)
        self.lock = open(os.path.join(LOCK_DIR, f"{self.prefix}.lock"), "w")
        fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        sw = f"{self.prefix}sw"
        sh("ip", "netns", "add", sw)
        self.up_done = True
        sh("ip", "-n", sw, "link", "set", "lo", "up")
        sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", sw, "link", "set", "br0", "up")
        for i in range(self.n):
            ns = self.ns(i)
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")  # a rank reaches its own address via lo
            sh("ip", "link", "add", f"{self.prefix}v{i}", "netns", ns, "type", "veth", "peer", "name", f"p{i}",
               "netns", sw)
            sh("ip", "-n", ns, "link", "set", f"{self.prefix}v{i}", "name", "eth0")
            sh("ip", "-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", sw, "link", "set", f"p{i}", "master", "br0")
            sh("ip", "-n", sw, "link", "set", f"p{i}", "up")
            sh("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "1")
            sh("tc", "-n", ns, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:1", "htb", "rate",
               "10gbit", "burst", "1mb", "cburst", "1mb", "quantum", "60000")
            for j in range(self.n):
                if j == i:
                    continue
                r = self.rate(i, j) or UNCAPPED_MBIT   # 0: no cap, but the link's bytes are still counted
                b = burst(r)
                link = f"1:{10 + j}"
                sh("tc", "-n", ns, "class", "add", "dev", "eth0", "parent", "1:", "classid", link, "htb",
                   "rate", f"{r}mbit", "ceil", f"{r}mbit", "burst", str(b), "cburst", str(b), "quantum", "60000")
                # Two leaves share the link's rate: pure TCP ACKs first, then data. In a two-way
                # exchange (an all-reduce) each direction's ACKs would otherwise queue behind the
                # other flow's data and slow it (measured: 13-15% at 8 Mbit/s); a real link's
                # ACKs do not wait behind a shaper's backlog.
                ack, data = f"1:{1000 + 2 * j}", f"1:{1001 + 2 * j}"
                for leaf, share, prio in ((ack, 0.1, "0"), (data, 0.9, "1")):
                    sh("tc", "-n", ns, "class", "add", "dev", "eth0", "parent", link, "classid", leaf, "htb",
                       "rate", f"{r * share:.6g}mbit", "ceil", f"{r}mbit", "burst", str(b), "cburst", str(b),
                       "prio", prio, "quantum", "60000")
                dst = ["match", "ip", "dst", f"{SUBNET}.{j + 1}/32"]
                # IPv4 without options, TCP, shorter than 64 bytes, flags = ACK only
                sh("tc", "-n", ns, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1",
                   "u32", *dst, "match", "ip", "protocol", "6", "0xff", "match", "u8", "0x05", "0x0f", "at", "0",
                   "match", "u16", "0x0000", "0xffc0", "at", "2", "match", "u8", "0x10", "0xff", "at", "33",
                   "flowid", ack)
                sh("tc", "-n", ns, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "2",
                   "u32", *dst, "flowid", data)

    def link_bytes(self) -> dict[str, int]:
        """Bytes the kernel sent on each directed link (IP packets, headers included)."""
        out = {}
        for i in range(self.n):
            text = sh("tc", "-n", self.ns(i), "-s", "class", "show", "dev", "eth0").stdout
            for m in re.finditer(r"class htb 1:(\d+) .*?\n\s*Sent (\d+) bytes", text):
                cls, sent = int(m.group(1)), int(m.group(2))
                if 10 <= cls < 1000:   # the link's class (its two leaves, 1:1000 and up, are in it)
                    out[f"{i}->{cls - 10}"] = sent
        return out

    def down(self):
        if self.lock is not None:
            os.remove(self.lock.name)
            self.lock.close()
            self.lock = None
        if not self.up_done:
            return
        for i in range(self.n):
            sh("ip", "netns", "del", self.ns(i), check=False)
        sh("ip", "netns", "del", f"{self.prefix}sw", check=False)


def parse_links(specs) -> dict[tuple[int, int], float]:
    links = {}
    for s in specs or []:
        m = re.fullmatch(r"(\d+)-(\d+):([\d.]+)", s)
        if not m:
            sys.exit(f"error: --link {s!r}: expected I-J:MBIT, e.g. 0-1:50")
        links[(int(m.group(1)), int(m.group(2)))] = float(m.group(3))
    return links


STALE = re.compile(r"(tcm\d+x)")
LOCK_DIR = "/run/ds-twocircuit-mesh"


def _held(prefix: str) -> bool:
    """Whether the run that named ``prefix`` still holds its lock. No lock file: a run of another
    version or one whose /run this host does not see -- never taken for dead."""
    path = os.path.join(LOCK_DIR, f"{prefix}.lock")
    if not os.path.exists(path):
        return True
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        return False


def stale_namespaces() -> list[str]:
    """Namespaces of mesh runs that died without cleaning up (killed outright): their lock is free."""
    listing = sh("ip", "netns", "list", check=False).stdout
    names = [line.split()[0] for line in listing.splitlines() if line.strip()]
    return [n for n in names if (m := STALE.match(n)) and not _held(m.group(1))]


def remove_stale() -> list[str]:
    gone = stale_namespaces()
    for n in gone:
        sh("ip", "netns", "del", n, check=False)
    for prefix in {STALE.match(n).group(1) for n in gone}:
        os.remove(os.path.join(LOCK_DIR, f"{prefix}.lock"))
    return gone


def _stop(signum, frame):
    raise SystemExit(128 + signum)


def output_dir_of(argv) -> str | None:
    for k, a in enumerate(argv):
        if a == "--output-dir" and k + 1 < len(argv):
            return argv[k + 1]
        if a.startswith("--output-dir="):
            return a.split("=", 1)[1]
    return None


LAUNCHERS = ("none", "deepspeed", "torchrun", "torchrun-c10d")


def node_command(launcher: str, node: int, nodes: int, port: int, script: list[str], hostfile: str,
                 env: dict, procs_per_node: int = 1) -> list[str]:
    """The command node ``node`` runs: the README's multi-node launch lines (``none``: one process
    per node, started directly), the first node's address as the master / rendezvous endpoint."""
    master = f"{SUBNET}.1"
    if launcher == "none":
        env.update(RANK=str(node), WORLD_SIZE=str(nodes), LOCAL_RANK="0", LOCAL_SIZE="1",
                   MASTER_ADDR=master, MASTER_PORT=str(port))
        return [sys.executable, *script]
    ppn = str(procs_per_node)
    if launcher == "deepspeed":
        return [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", hostfile, "--no_ssh",
                "--node_rank", str(node), "--master_addr", master, "--master_port", str(port), *script]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc_per_node", ppn,
                "--node_rank", str(node), "--master_addr", master, "--master_port", str(port), *script]
    # c10d rendezvous: the namespaces share one host name, which resolves to none of their mesh
    # addresses, so each node names its own address (--local-addr: what it advertises as the
    # workers' master) and the first node is told it hosts the rendezvous store (the README says
    # when a real cluster needs the same)
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc_per_node", ppn,
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{master}:{port}", "--local-addr", f"{SUBNET}.{node + 1}",
            *(["--rdzv-conf", "is_host=1"] if node == 0 else []), *script]


# what lets a node join a running elastic job: a fresh rendezvous store every round (torch 2.13's
# shared store publishes the workers' master address in the first round only)
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def elastic_node_command(min_nodes: int, max_nodes: int, endpoint: str, script: list[str], *, host: bool,
                         procs_per_node: int = 1, last_call_timeout_s: int | None = None,
                         max_restarts: int = 100, local_addr: str | None = None) -> list[str]:
    """The line one node runs to take part in an elastic job (torchrun ``--nnodes MIN:MAX``, c10d
    rendezvous at ``endpoint``, hosted by the node with ``host``); run it with :data:`ELASTIC_ENV` in
    its environment and ``--resume auto`` in ``script``'s arguments. ``local_addr``: the address the
    node advertises (needed where nodes share a host name, as the mesh's namespaces do)."""
    conf = [f"is_host={int(host)}"] + ([f"last_call_timeout={last_call_timeout_s}"]
                                       if last_call_timeout_s is not None else [])
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", f"{min_nodes}:{max_nodes}",
            "--nproc_per_node", str(procs_per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--rdzv-conf", ",".join(conf), "--max-restarts", str(max_restarts),
            *(["--local-addr", local_addr] if local_addr else []), *script]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--remove-stale"]:
        if os.geteuid() != 0:
            sys.exit("error: removing network namespaces needs root (run with sudo)")
        gone = remove_stale()
        print(f"mesh: removed {len(gone)} namespaces of runs no longer alive: {' '.join(gone) or '(none)'}")
        return 0
    if "--" not in argv:
        sys.exit("usage: mesh.py --ranks N [--mbit M] [--link I-J:MBIT ...] -- SCRIPT [ARGS...]\n"
                 "       mesh.py --remove-stale   (namespaces left by runs that were killed outright)")
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="launch/mesh.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, required=True, help="emulated nodes (network namespaces)")
    p.add_argument("--procs-per-node", type=int, default=1,
                   help="processes per node (default 1); ranks of one node talk over its loopback, "
                        "uncapped and uncounted, as on a real machine")
    p.add_argument("--mbit", type=float, default=200.0,
                   help="cap of every directed link (default 200; 0: uncapped, bytes still counted)")
    p.add_argument("--link", action="append", help="per-link cap I-J:MBIT (repeatable)")
    p.add_argument("--port", type=int, default=29500, help="rendezvous port on rank 0's address")
    p.add_argument("--timeout", type=int, default=3600, help="seconds before the run is stopped")
    p.add_argument("--per-node-launcher", choices=LAUNCHERS, default="none",
                   help="how each node starts its rank: none (RANK/WORLD_SIZE/MASTER_* set directly), or "
                        "exactly as the README's multi-node commands: deepspeed (hostfile, --no_ssh, "
                        "--node_rank), torchrun (static master), torchrun-c10d (c10d rendezvous)")
    args = p.parse_args(argv[:cut])
    script = argv[cut + 1:]
    if not script:
        sys.exit("error: nothing to run after --")
    if os.geteuid() != 0:
        sys.exit("error: network namespaces need root (run with sudo). Without them, train.py's software "
                 "throttle paces the project's own sends instead: launch/train.py ... --pace-mbit RATE")
    if args.mbit < 0:
        sys.exit(f"error: --mbit must be >= 0 (0: uncapped), got {args.mbit}")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            sys.exit(f"error: '{tool}' not found: install iproute2")
    if args.ranks < 1:
        sys.exit("error: --ranks must be >= 1")
    if args.procs_per_node < 1 or (args.procs_per_node > 1 and args.per_node_launcher == "none"):
        sys.exit("error: --procs-per-node must be >= 1, and > 1 needs --per-node-launcher "
                 "deepspeed, torchrun or torchrun-c10d")
    stale = stale_namespaces()
    if stale:
        sys.stderr.write(f"mesh: warning: {len(stale)} namespaces left by runs killed outright ({' '.join(stale)}); "
                         "they do not disturb this run; remove them with: sudo python launch/mesh.py --remove-stale\n")
    mesh = Mesh(args.ranks, args.mbit, parse_links(args.link))
    # SIGTERM / SIGHUP unwind like Ctrl-C, so the namespaces are removed
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stop)
    hostfile = os.path.join(ROOT, ".cache", f"{mesh.prefix}hostfile")
    procs = []
    t0 = time.time()
    rc = 1
    try:
        try:
            mesh.up()
        except subprocess.CalledProcessError as e:
            what = " ".join(e.cmd[:4])
            sys.stderr.write(
                f"error: cannot build the emulated mesh: '{what} ...' failed: {(e.stderr or '').strip()}\n"
                "This host does not allow network namespaces or traffic control (an unprivileged "
                "container?). What is missing: CAP_NET_ADMIN and CAP_SYS_ADMIN (ip netns) and the sch_htb "
                "kernel module (tc). Without them, use the software throttle, which paces the "
                "project's own sends: launch/train.py ... --pace-mbit RATE (or DS_TWOCIRCUIT_PACE_MBIT=RATE)\n")
            return 1
        cores = os.cpu_count() or 1
        if args.per_node_launcher == "deepspeed":
            os.makedirs(os.path.dirname(hostfile), exist_ok=True)
            with open(hostfile, "w") as f:
                f.write("".join(f"{SUBNET}.{i + 1} slots={args.procs_per_node}\n" for i in range(args.ranks)))
        for i in range(args.ranks):
            env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", PYTHONUNBUFFERED="1")
            for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT"):
                env.pop(k, None)
            env.setdefault("OMP_NUM_THREADS", str(max(1, cores // (args.ranks * args.procs_per_node))))
            cmd = ["ip", "netns", "exec", mesh.ns(i), *node_command(args.per_node_launcher, i, args.ranks,
                                                                   args.port, script, hostfile, env,
                                                                   args.procs_per_node)]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True,
                                          stdout=None if i == 0 else subprocess.DEVNULL,
                                          stderr=None if i == 0 else subprocess.PIPE, text=True))
        deadline = time.time() + args.timeout
        while any(pr.poll() is None for pr in procs):
            if time.time() > deadline or any(pr.poll() not in (None, 0) for pr in procs):
                break
            time.sleep(0.5)
        codes = [pr.poll() for pr in procs]
        rc = 0 if all(c == 0 for c in codes) else 1
        if rc:
            for k, pr in enumerate(procs):
                if pr.poll() not in (None, 0) and k > 0 and pr.stderr:
                    sys.stderr.write(f"--- rank {k} (exit {pr.poll()}):\n{pr.stderr.read()[-3000:]}\n")
            sys.stderr.write(f"mesh: run failed (exit codes {codes})\n")
        links = mesh.link_bytes()
        out = output_dir_of(script)
        report = {"ranks": args.ranks, "mbit": args.mbit, "namespace_prefix": mesh.prefix, "links_mbit": {f"{i}->{j}": r for (i, j), r in
                                                                        mesh.links.items()},
                  "kernel_bytes": links, "kernel_bytes_total": sum(links.values()),
                  "wall_s": round(time.time() - t0, 2), "command": " ".join(["python", "launch/mesh.py", *argv])}
        if out and os.path.isdir(out):
            with open(os.path.join(out, "mesh.json"), "w") as f:
                json.dump(report, f, indent=2)
        print(f"mesh: kernel bytes per link {links} (total {sum(links.values()):,})", flush=True)
    finally:
        for pr in procs:
            if pr.poll() is None:
                try:
                    os.killpg(pr.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for pr in procs:
            try:
                pr.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        mesh.down()
        if os.path.exists(hostfile):
            os.remove(hostfile)
    return rc


if __name__ == "__main__":
    sys.exit(main())
