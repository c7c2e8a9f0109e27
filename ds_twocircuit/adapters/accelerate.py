"""Hugging Face Accelerate / Trainer integration of the DP compression backends.

Accelerate does not support DeepSpeed pipeline parallelism, so what plugs into an existing
Hugging Face pipeline is the data-parallel part: PowerSGD, DiLoCo, Streaming DiLoCo. Put the
``"twocircuit": {"dp": {...}}`` section into the DeepSpeed JSON your ``accelerate config`` points
to, then, after ``accelerator.prepare(...)``::

    from ds_twocircuit.adapters.accelerate import enable_dp_compression
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    enable_dp_compression(accelerator)

With the Trainer: ``trainer.add_callback(DPCompressionCallback(trainer))``. At the end of
training call ``finalize_dp(accelerator)`` (or let the callback do it) so that in-flight DiLoCo
syncs are finished and the replicas hold one model before you save it.
"""
from __future__ import annotations

from .plain_engine import attach_dp_backend


def _engine(accelerator):
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    if wrapped is None:
        raise RuntimeError("enable_dp_compression: the accelerator has no DeepSpeed engine; configure "
                           "Accelerate with distributed_type DEEPSPEED and call accelerator.prepare() first")
    return wrapped.engine


def enable_dp_compression(accelerator, dp: dict | None = None):
    """Switch the prepared DeepSpeed engine's DP all-reduce to the configured backend."""
    return attach_dp_backend(_engine(accelerator), dp)


def finalize_dp(accelerator) -> None:
    engine = _engine(accelerator)
    backend = getattr(engine, "dp_backend", None)
    if backend is not None:
        backend.finalize()


try:
    from transformers import TrainerCallback
except ImportError:  # transformers is a dependency; keep the module importable regardless
    TrainerCallback = object


class DPCompressionCallback(TrainerCallback):
    """Trainer callback: attach the backend when training starts, finalize it when it ends."""

    def __init__(self, trainer, dp: dict | None = None):
        self.trainer, self.dp = trainer, dp

    def on_train_begin(self, args, state, control, **kwargs):
        attach_dp_backend(self.trainer.model_wrapped, self.dp)

    def on_train_end(self, args, state, control, **kwargs):
        backend = getattr(self.trainer.model_wrapped, "dp_backend", None)
        if backend is not None:
            backend.finalize()
