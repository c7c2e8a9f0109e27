"""Plain averaging all-reduce of the gradients: the synchronous data-parallel SGD reference
(what DeepSpeed itself does, Li et al. 2020, "PyTorch Distributed").

Invariant: after ``reduce_gradients(step)`` every replica's ``p.grad`` is the mean of the replicas'
gradients, bitwise identical on all ranks.  Gradients are coalesced into one flat buffer per dtype
(see :class:`ds_twocircuit.dp.base.CoalescedMean`).
"""
from __future__ import annotations

from dataclasses import dataclass

from ds_twocircuit.dp.base import CoalescedMean, DPBackend, check_finite
from ds_twocircuit.dp.config import BackendConfig


@dataclass(frozen=True)
class AllReduceConfig(BackendConfig):
    """``"dp": {"backend": "allreduce"}``: the plain mean has nothing to tune, so no other key."""
    backend: str = "allreduce"


class AllReduce(DPBackend):
    backend_name = "allreduce"
    config_class = AllReduceConfig
    loop_bytes_dtype = "grad"   # DeepSpeed's own all-reduce too: bf16 with bf16.enabled

    def reduce_gradients(self, step: int) -> None:
        grads = self._grads()
        check_finite(step, self.names, grads)
        if self.world_size > 1:  # one replica: the mean is the gradient itself (no copies)
            CoalescedMean(grads, self.comm).wait()
