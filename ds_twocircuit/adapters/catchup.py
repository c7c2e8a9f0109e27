"""Fetch the files of a checkpoint this rank's disk lacks from the ranks that have them
(``ds_twocircuit.catchup`` decides who sends what).

Every rank of the fast circuit calls :func:`catch_up` at ``--resume auto``, before DeepSpeed loads
the checkpoint. Where the output folder is shared (or every node already holds what it loads),
nothing is sent but the inventories. Otherwise each file travels once per disk, point to point,
from a rank of the receiver's own stage where one has it (a DP link); the receiver writes it
atomically and the commit marker last. Counted as wire kind ``catch_up`` where sent: rank 0's
nonce, the inventories (each rank's record to every other rank) and, per file, 8 bytes of length
plus its bytes.
"""
from __future__ import annotations

import os
import pickle
import uuid

from .. import wire
from ..catchup import Inventory, needed_files, plan
from ..config import ConfigError
from ..faults import COMMITTED, STATE_DIR
from ..files import atomic_write

CHUNK = 64 << 20          # bytes per message: bounds the memory a large file takes on either side
DISK_ID = ".disk"


def disk_id(folder: str, nonce: str) -> str:
    """A name for the disk ``folder`` is on, shared by every rank that sees the same folder (the
    first rank to look writes ``.disk.<nonce>`` there; a node without a shared folder gets its
    own). ``nonce`` is this catch-up's (from rank 0): a file left by an earlier one, or copied
    along with a folder, never makes two disks look like one. Removed at the end of
    :func:`catch_up`."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{DISK_ID}.{nonce}")
    if not os.path.isfile(path):
        tmp = f"{path}.{uuid.uuid4().hex}"
        with open(tmp, "w") as f:
            f.write(uuid.uuid4().hex)
        try:
            os.link(tmp, path)        # fails if another rank was first: its name stands
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    return open(path).read().strip()


def inventory(tag_dir: str) -> dict[str, int]:
    """The checkpoint's files under ``tag_dir`` (relative path -> size)."""
    out = {}
    for root, _, files in os.walk(tag_dir):
        for f in files:
            if f.startswith(".") or ".tmp" in f:
                continue
            path = os.path.join(root, f)
            out[os.path.relpath(path, tag_dir)] = os.path.getsize(path)
    return out


def stage_files(ds, root: str, tag: str) -> list[str]:
    """The DeepSpeed files this rank's stage loads: its layer files and the engine state files of
    every stage (DeepSpeed's loader reads stage 0's to check the stage count against the files
    it finds, then this stage's own)."""
    tag_dir = os.path.join(root, tag)
    layers = [os.path.relpath(ds.module.ckpt_layer_path(tag_dir, idx), tag_dir)
              for idx, layer in enumerate(ds.module.forward_funcs) if hasattr(layer, "state_dict")]
    states = [os.path.relpath(ds._get_ckpt_name(root, tag, mp_placeholder=f"{s:02d}"), tag_dir)
              for s in range(ds.num_stages)]
    return [*layers, *states]


def catch_up(ds, root: str, step: int, world) -> None:
    """Make ``<root>/global_step<step>`` loadable on this rank (what it sends is counted)."""
    import torch.distributed as dist
    if world.size == 1:
        return
    tag = f"global_step{step}"
    tag_dir = os.path.join(root, tag)
    marker = os.path.join(tag_dir, STATE_DIR, COMMITTED)
    nonce = [uuid.uuid4().hex if world.rank == 0 else None]
    dist.broadcast_object_list(nonce, src=0)
    if world.rank == 0:
        wire.count("catch_up", len(nonce[0]) * (world.size - 1), messages=world.size - 1)
    meta = None
    if os.path.isfile(marker):
        import json
        meta = json.load(open(marker))
    mine = {"inv": Inventory(world.rank, ds.stage_id, disk_id(root, nonce[0]),
                             inventory(tag_dir) if os.path.isdir(tag_dir) else {},
                             stage_files(ds, root, tag)),
            "dp_rank": ds.grid.get_data_parallel_id(), "meta": meta}
    records = [None] * world.size
    dist.all_gather_object(records, mine)
    wire.count("catch_up", len(pickle.dumps(mine)) * (world.size - 1), messages=world.size - 1)
    meta = next((r["meta"] for r in records if r["meta"] is not None), None)
    if meta is None:
        raise ConfigError(f"--resume auto: no rank holds the commit marker of {tag} ({STATE_DIR}/{COMMITTED})")
    invs = []
    for r in records:
        inv = r["inv"]
        inv.need = needed_files(inv.stage, r["dp_rank"], meta["dp"], ds.dp_world_size, inv.need)
        invs.append(inv)
    transfers, missing = plan(invs)
    if missing:
        raise ConfigError(
            f"--resume auto: {tag} cannot be assembled on every node: "
            + "; ".join(f"rank {r} needs {', '.join(names)}, which no rank has" for r, names in sorted(missing.items()))
            + ". A replica's own state lives only on its node: resume on the width whose files survive "
            "(--dp), or use a shared --output-dir")
    for t in transfers:
        if t.src == world.rank:
            _send_file(os.path.join(tag_dir, t.name), t.size, t.dst)
        elif t.dst == world.rank:
            _recv_file(os.path.join(tag_dir, t.name), t.size, t.src)
    dist.barrier()        # every file is in place on every disk before anyone loads
    try:                  # every rank has named its disk: the checkpoint folder keeps only checkpoints
        os.remove(os.path.join(root, f"{DISK_ID}.{nonce[0]}"))
    except FileNotFoundError:
        pass


def _send_file(path: str, size: int, dst: int) -> int:
    import torch
    import torch.distributed as dist
    from .dist import to_comm
    if os.path.getsize(path) != size:
        raise ConfigError(f"{path} changed while it was being sent ({os.path.getsize(path)} bytes, listed {size})")
    dist.send(to_comm(torch.tensor([size], dtype=torch.int64)), dst)
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            dist.send(to_comm(torch.frombuffer(bytearray(chunk), dtype=torch.uint8)), dst)
    messages = 1 + (size + CHUNK - 1) // CHUNK
    wire.count("catch_up", 8 + size, messages=messages)
    return 8 + size


def _recv_file(path: str, size: int, src: int) -> None:
    import torch
    import torch.distributed as dist
    from .dist import from_comm, to_comm
    n = to_comm(torch.zeros(1, dtype=torch.int64))
    dist.recv(n, src)
    if int(from_comm(n)[0]) != size:
        raise ConfigError(f"{path}: rank {src} sends {int(from_comm(n)[0])} bytes, its inventory said {size}")
    os.makedirs(os.path.dirname(path), exist_ok=True)

    def write(f):
        left = size
        while left:
            buf = to_comm(torch.empty(min(CHUNK, left), dtype=torch.uint8))
            dist.recv(buf, src)
            f.write(from_comm(buf).numpy().tobytes())
            left -= buf.numel()
    atomic_write(path, write, binary=True)
