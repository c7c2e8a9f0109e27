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
        return dist.all_gather_into_tensor(out, t, group=self.group, async_op=async_op)

    def all_to_all_into(self, out: torch.Tensor, t: torch.Tensor, async_op: bool = False):
        return dist.all_to_all_single(out, t, group=self.group, async_op=async_op)


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
