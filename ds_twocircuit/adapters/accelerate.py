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

import csv
import os

from .dist import prepare_runtime
from .plain_engine import DPTotals, attach_dp_backend

# A user imports this module before ``Accelerator()`` / ``TrainingArguments`` start DeepSpeed's
# process group: on a CPU host that is the moment to skip DeepSpeed's JIT build of its shared-memory
# op (about a minute on 2 cores, on every fresh machine; it serves only inference all-reduce), as
# launch/train.py does.
prepare_runtime()

# the columns of the callback's CSV log, in order (a metric absent from a log is an empty cell)
CSV_COLUMNS = ("step", *DPTotals.KEYS, "dp/final")


def _engine(accelerator):
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    if wrapped is None:
        raise RuntimeError("enable_dp_compression: the accelerator has no DeepSpeed engine; configure "
                           "Accelerate with distributed_type DEEPSPEED and call accelerator.prepare() first")
    return wrapped.engine


def enable_dp_compression(accelerator, dp: dict | None = None):
    """Switch the prepared DeepSpeed engine's DP all-reduce to the configured backend."""
    return attach_dp_backend(_engine(accelerator), dp)


def finalize_dp(accelerator) -> bool:
    """End of training: finish in-flight syncs and average drifted replicas once (DiLoCo), so
    every replica holds the same model before it is saved. True if the weights changed."""
    return _finalize(_engine(accelerator))


def _finalize(engine) -> bool:
    backend = getattr(engine, "dp_backend", None)
    if backend is None:
        return False
    changed = backend.finalize()
    engine.dp_totals.add(backend.pop_step_stats(), backend, optimizer_step=False)
    return changed


def dp_metrics(accelerator_or_engine) -> dict:
    """This rank's DP totals so far (``dp/bytes_sent``, ``dp/compression_ratio`` against a plain
    all-reduce of the same steps, ``dp/comm_s``, ``dp/replicas_in_sync``, ...); {} before
    :func:`enable_dp_compression`."""
    engine = getattr(accelerator_or_engine, "deepspeed_engine_wrapped", None)
    engine = engine.engine if engine is not None else accelerator_or_engine
    totals = getattr(engine, "dp_totals", None)
    return totals.metrics() if totals is not None else {}


def replicas_identical(accelerator_or_engine) -> bool:
    """Whether every DP replica holds bitwise-identical weights (a digest per replica, as
    launch/train.py checks; no weights cross the wire). Call it on every rank."""
    from deepspeed.utils import groups
    from .dist import group_agrees, weights_digest
    engine = getattr(accelerator_or_engine, "deepspeed_engine_wrapped", None)
    engine = engine.engine if engine is not None else accelerator_or_engine
    if engine.dp_world_size == 1:
        return True
    return group_agrees(weights_digest(engine.module.named_parameters()), groups._get_data_parallel_group(),
                        engine.dp_world_size)


try:
    from transformers import TrainerCallback
except ImportError:  # transformers is a dependency; keep the module importable regardless
    TrainerCallback = object


def _world_rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class DPCompressionCallback(TrainerCallback):
    """Trainer callback: attach the backend when training starts, put :func:`dp_metrics` into every
    log (ahead of the ``report_to`` reporters, and into ``state.log_history``), finalize the DP
    sync when training ends (before the model is saved).

    ``csv_path``: the same metrics, one row per log, as CSV (default ``<output_dir>/dp_metrics.csv``;
    None: no CSV), written by world rank 0 (not by Accelerate's main process: on a CPU-only host
    Accelerate with DeepSpeed calls every rank the main one)."""

    def __init__(self, trainer, dp: dict | None = None, csv_path: str | None = "auto"):
        self.trainer, self.dp = trainer, dp
        if csv_path == "auto":
            csv_path = os.path.join(trainer.args.output_dir, "dp_metrics.csv")
        self.csv_path = csv_path
        self._csv_started = False

    def _write_csv(self, step: int, metrics: dict) -> None:
        if self.csv_path is None or _world_rank() != 0:   # asked when writing: the group exists by then
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.csv_path)), exist_ok=True)
        with open(self.csv_path, "w" if not self._csv_started else "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
            if not self._csv_started:
                w.writeheader()
            w.writerow({"step": step, **metrics})
        self._csv_started = True

    def on_train_begin(self, args, state, control, **kwargs):
        attach_dp_backend(self.trainer.model_wrapped, self.dp)
        handler = self.trainer.callback_handler      # run first, so reporters see the metrics
        handler.callbacks.remove(self)
        handler.callbacks.insert(0, self)

    def on_log(self, args, state, control, logs=None, **kwargs):
        metrics = dp_metrics(self.trainer.model_wrapped)
        if logs is not None:
            logs.update(metrics)
        if state.log_history:                        # Trainer appended this log before the callbacks
            state.log_history[-1].update(metrics)
        self._write_csv(state.global_step, metrics)

    def on_train_end(self, args, state, control, **kwargs):
        engine = self.trainer.model_wrapped
        if getattr(engine, "dp_backend", None) is not None:
            _finalize(engine)
            final = {**dp_metrics(engine), "dp/final": 1.0}
            state.log_history.append({**final, "step": state.global_step})
            self._write_csv(state.global_step, final)
