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


def dp_comm(group, world_size: int) -> Communicator:
    """The DP replicas' communicator: :class:`LocalComm` for one replica (no process group needed),
    else :class:`TorchComm` over ``group``, paced on the ring link when a software throttle is set
    (:mod:`ds_twocircuit.pacing`)."""
    if type(world_size) is not int or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if world_size == 1:
        return LocalComm()
    comm = TorchComm(group, world_size)
    pacer = pacing.current()
    return pacing.PacedComm(comm, pacer.link("dp")) if pacer is not None else comm
