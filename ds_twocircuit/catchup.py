"""Catching up on a checkpoint without a shared folder: who sends which file to whom.

A node that joins a run (a new one, or one whose disk was replaced) resumes from the newest
committed checkpoint, but where the output folder is not shared between nodes the files are where
the ranks that wrote them ran: each stage's layer files and DeepSpeed state on the node of the
stage's first replica, each replica's own state file (``twocircuit/stage{S}_dp{D}.pt``) on its
node, the commit marker on rank 0's. At ``--resume auto`` every rank says which files of that
checkpoint its disk holds and which it needs; :func:`plan` decides, the same way on every rank, who
sends what: one receiver per disk (ranks that share a disk need a file once), the sender a rank of
the receiver's own stage where one has the file (the DP link: the same stage's files travel between
replicas) and the lowest such rank. The commit marker goes last, so a transfer cut short leaves no
committed checkpoint behind. The adapter (``adapters/catchup.py``) moves the bytes and counts them
as wire kind ``catch_up`` where they are sent.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MARKER_LAST = "twocircuit/COMPLETE.json"


@dataclass
class Inventory:
    """One rank's view: its stage, its disk (ranks sharing a disk see the same files), the files of
    the checkpoint that disk holds (relative path -> size) and the files this rank needs."""
    rank: int
    stage: int
    disk: str
    have: dict = field(default_factory=dict)
    need: list = field(default_factory=list)


@dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    name: str
    size: int


def plan(inventories: list[Inventory]) -> tuple[list[Transfer], dict[int, list[str]]]:
    """The transfers (in the order every rank executes them) and, per receiving rank, the files no
    rank has. Deterministic: it depends on the inventories only."""
    by_rank = {inv.rank: inv for inv in inventories}
    disks: dict[str, list[Inventory]] = {}
    for inv in sorted(inventories, key=lambda i: i.rank):
        disks.setdefault(inv.disk, []).append(inv)
    transfers, missing = [], {}
    for disk, members in sorted(disks.items(), key=lambda kv: kv[1][0].rank):
        receiver = members[0]
        have = set().union(*(m.have for m in members))
        wanted = sorted({n for m in members for n in m.need} - have, key=lambda n: (n == MARKER_LAST, n))
        stages = {m.stage for m in members}
        for name in wanted:
            holders = [i for i in sorted(by_rank.values(), key=lambda i: (i.stage not in stages, i.rank))
                       if name in i.have and i.disk != disk]
            if not holders:
                missing.setdefault(receiver.rank, []).append(name)
                continue
            transfers.append(Transfer(holders[0].rank, receiver.rank, name, int(holders[0].have[name])))
    return transfers, missing


def needed_files(stage: int, dp_rank: int, old_dp: int, new_dp: int, stage_files: list[str]) -> list[str]:
    """What a rank loads to resume: its stage's DeepSpeed files (``stage_files``: its layer files and
    the engine state files of every stage, which DeepSpeed's loader counts), its own replica state
    file (same width) or every old replica's of its stage (another width: they are merged), and the
    commit marker."""
    replicas = [dp_rank] if old_dp == new_dp else list(range(old_dp))
    return [*stage_files, *(f"twocircuit/stage{stage:02d}_dp{d:04d}.pt" for d in replicas), MARKER_LAST]
