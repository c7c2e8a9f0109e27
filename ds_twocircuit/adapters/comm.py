"""The data-parallel backends' transport over ``torch.distributed``.

:class:`ds_twocircuit.dp.base.Communicator` is what a DP backend needs (world size, rank, an
in-place sum all-reduce); this is its ``torch.distributed`` implementation. Every DP byte a
backend sends leaves through :meth:`TorchComm.all_reduce_sum` (counted before, by
:class:`ds_twocircuit.dp.base.Collective`, as wire kind ``"dp"``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import pacing
from ..dp.base import Communicator, LocalComm


class TorchComm(Communicator):
    """Sum all-reduce over a ``torch.distributed`` process group (``None``: the default group).

    The tensors are the parameters' own gradients or weights, so they already live on the
    backend's device (the rank's GPU under NCCL)."""

    def __init__(self, group=None, world_size: int | None = None):
        if not dist.is_initialized():
            raise ValueError("a DP world of more than one replica needs torch.distributed to be initialized")
        n = dist.get_world_size(group)
        if world_size is not None and n != world_size:
            raise ValueError(f"DP group has {n} ranks, world_size says {world_size}")
        self.group, self.world_size, self.rank = group, n, dist.get_rank(group)

    def all_reduce_sum(self, t: torch.Tensor, async_op: bool = False):
        return dist.all_reduce(t, group=self.group, async_op=async_op)

    def all_gather_into(self, out: torch.Tensor, t: torch.Tensor, async_op: bool = False):
        n, step = t.numel(), _chunk_numel(t)
        if n <= step:
            return dist.all_gather_into_tensor(out, t, group=self.group, async_op=async_op)
        rows = out.view(self.world_size, n)
        works = [dist.all_gather([rows[r, s:s + step] for r in range(self.world_size)], t[s:s + step],
                                 group=self.group, async_op=True) for s in range(0, n, step)]
        return _finished(_Chunked(works), async_op)

    def all_to_all_into(self, out: torch.Tensor, t: torch.Tensor, async_op: bool = False):
        k, step = t.shape[1], _chunk_numel(t)
        if k <= step:
            return dist.all_to_all_single(out, t, group=self.group, async_op=async_op)
        works, pieces = [], []
        for s in range(0, k, step):
            src = t[:, s:s + step].contiguous()
            dst = torch.empty_like(src)
            works.append(dist.all_to_all_single(dst, src, group=self.group, async_op=True))
            pieces.append((s, dst))

        def place():
            for s, dst in pieces:
                out[:, s:s + dst.shape[1]].copy_(dst)
        return _finished(_Chunked(works, place), async_op)


# A collective of more than this many bytes per rank goes out in pieces of it, launched together.
# Measured with launch/mesh.py (kernel-capped links, both ways at once, as a sync sends): one gloo
# all-gather of 4 MB a rank at 8 Mbit/s took 5.1-6.3 s, 1.24-1.5x its bytes' time (10 MB at 7.17
# Mbit/s ran at 4.6 Mbit/s; an all-to-all or a pair of isend/irecv at 3.6), where gloo's ring
# all-reduce of the same bytes, which sends in pieces itself, takes 4.2 s every time; in pieces
# of 1 MiB 4.2-4.7 s (512 KiB: 4.2-4.45; 2 MiB: 4.2-5.3). Two-way traffic on one connection,
# each side's ACKs queued behind its own data, is what a single large exchange suffers from. A
# link with latency pays some of it per piece; gloo runs two pieces at once (its worker threads).
# tests/test_mesh.py holds the all-gather to its bytes' time.
CHUNK_BYTES = 1 << 20


def _chunk_numel(t: torch.Tensor) -> int:
    return max(1, CHUNK_BYTES // t.element_size())


class _Chunked:
    """One collective sent as several (``works``): ``wait()`` waits for all of them, then runs
    ``finish`` once (placing the pieces); ``get_future()`` completes when all have."""

    def __init__(self, works, finish=None):
        self._works, self._finish = works, finish
        self._fut = torch.futures.collect_all([w.get_future() for w in works])

    def wait(self) -> bool:
        for w in self._works:
            w.wait()
        if self._finish is not None:
            self._finish()
            self._finish = None
        return True

    def get_future(self):
        return self._fut


def _finished(work: _Chunked, async_op: bool):
    if async_op:
        return work
    work.wait()
    return None


def own_group(group):
    """A process group of its own over the ranks of ``group`` (``None``: the world).

    The DP sync runs in the background (Streaming DiLoCo: tens of MB over several steps), while the
    engine keeps using its DP group every step (DeepSpeed's pipeline all-reduces each step's loss
    over it). On one group both share each peer's connection, so the engine's few bytes queue
    behind the sync's: measured on a 7.17 Mbit/s link, the step after each launch stalled 40 s.
    Its own group has its own connections (gloo) or communicator (NCCL). Only the group's ranks
    take part in creating it (``use_local_synchronization``), so each DP group of a pipeline is
    made by its own ranks."""
    ranks = sorted(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    return dist.new_group(ranks, use_local_synchronization=True)


def dp_comm(group, world_size: int) -> Communicator:
    """The DP replicas' communicator: :class:`LocalComm` for one replica (no process group needed),
    else :class:`TorchComm` over a group of its own with the ranks of ``group`` (:func:`own_group`),
    paced on the ring link when a software throttle is set (:mod:`ds_twocircuit.pacing`)."""
    if type(world_size) is not int or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if world_size == 1:
        return LocalComm()
    if not dist.is_initialized():
        raise ValueError("a DP world of more than one replica needs torch.distributed to be initialized")
    comm = TorchComm(own_group(group), world_size)
    pacer = pacing.current()
    return pacing.PacedComm(comm, pacer.link("dp")) if pacer is not None else comm
