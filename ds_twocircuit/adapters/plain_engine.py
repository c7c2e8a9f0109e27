"""DeepSpeed adapter: a DP backend in place of a plain ``DeepSpeedEngine``'s gradient all-reduce.

For models trained without pipeline parallelism (``deepspeed.initialize`` on an ordinary module,
Accelerate, the Hugging Face Trainer). The engine's own all-reduce is switched off through its
public flag (``enable_backward_allreduce``, the switch 1-bit Adam used) and the backend runs at the
gradient-accumulation boundary: ``reduce_gradients`` right before DeepSpeed's model step (so
gradient clipping sees the synchronised gradient), ``after_optimizer_step`` right after it.

    engine, opt, _, _ = deepspeed.initialize(model=model, config="ds.json", ...)
    attach_dp_backend(engine)            # reads "twocircuit": {"dp": {...}} from the config

Accelerate: ``ds_twocircuit.adapters.accelerate.enable_dp_compression(accelerator)`` after ``prepare``.
"""
from __future__ import annotations

from ..config import ConfigError
from .. import wire
from ..dp.config import RunSettings
from ..dp.registry import config_from_dict, get_backend
from .comm import dp_comm


PIPELINE_ONLY = ("twocircuit.{keys} only apply to pipeline runs (masked boundaries, the anchor circuit, "
                 "LoRA under the pipeline): launch them with `deepspeed launch/train.py --deepspeed <config>`. "
                 "On a plain DeepSpeed engine (Accelerate, the Trainer, deepspeed.initialize on a model) only "
                 "twocircuit.dp is used: remove {them} from the config")


def _dp_section(engine, dp):
    if dp is not None:
        return dp
    raw = getattr(engine, "config", None) or getattr(engine._config, "_param_dict", {})
    section = (raw or {}).get("twocircuit") or {}
    others = sorted(k for k in section if k != "dp")
    if others:  # silently ignoring e.g. an anchor section would train something else than asked
        raise ConfigError(PIPELINE_ONLY.format(keys="{" + ", ".join(others) + "}" if len(others) > 1
                                               else others[0], them="them" if len(others) > 1 else "it"))
    return section.get("dp") or {"backend": "allreduce"}


def attach_dp_backend(engine, dp: dict | None = None):
    """Replace ``engine``'s data-parallel all-reduce by the configured backend; returns it."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.utils import groups

    if isinstance(engine, PipelineEngine):
        raise ConfigError("attach_dp_backend is for plain DeepSpeed engines; pipelines get their backend "
                          "from launch/train.py (MaskedPipelineEngine)")
    cfg = config_from_dict(_dp_section(engine, dp))  # raises ConfigError naming the key
    # what this adapter needs of any backend: the engine's own DP reduction out of the way
    zero = engine.zero_optimization_stage()
    if zero >= 1:
        raise ConfigError(f"twocircuit.dp.backend = {cfg.backend!r} needs zero_optimization.stage = 0: ZeRO "
                          "partitions gradients/optimizer state over the DP group and reduces them itself")
    bf16 = isinstance(engine.optimizer, BF16_Optimizer)
    if bf16:
        raise ConfigError(f"twocircuit.dp.backend = {cfg.backend!r} cannot run under DeepSpeed's BF16 optimizer "
                          "(it keeps its own flat fp32 gradients); use torch_autocast or fp32")
    # what the backend itself cannot run with (its rules, shared with launch/train.py); no pipeline
    cfg.check_run(RunSettings(zero_stage=zero, fp16=engine.fp16_enabled(), bf16=bf16))
    factor = cfg.inner_lr_factor(engine.dp_world_size)
    if factor != 1.0:   # the optimizer and its schedule are the user's, built before this call
        raise ConfigError(f"twocircuit.dp.inner_lr_scale = {cfg.inner_lr_scale!r} is applied by launch/train.py; "
                          "here the optimizer and its schedule are yours: multiply your learning rate by "
                          f"{factor:.6g} (on {engine.dp_world_size} replicas) and remove the key")
    if not engine.managed_gradient_accumulation():
        raise ConfigError("twocircuit.dp needs DeepSpeed's managed gradient accumulation")
    comm = dp_comm(groups._get_data_parallel_group(), engine.dp_world_size)
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    backend = get_backend(cfg.backend)(named, comm, cfg)
    engine.enable_backward_allreduce = False
    # A private DeepSpeed method (listed, with the version it was checked against, in
    # deepspeed_private.py): the DP sync must run before the clipping inside it.
    original = engine._take_model_step

    # what a plain all-reduce of every trainable gradient would send per step (this rank)
    dense = wire.ring_allreduce_bytes(sum(wire.tensor_bytes(p) for _, p in named), comm.world_size)
    totals = DPTotals(dense_bytes_per_step=dense, world_size=comm.world_size)

    def take_model_step(lr_kwargs, *args, **kwargs):
        step = engine.global_steps
        backend.reduce_gradients(step)
        out = original(lr_kwargs, *args, **kwargs)
        backend.after_optimizer_step(step)
        totals.add(backend.pop_step_stats(), backend)
        return out

    engine._take_model_step = take_model_step
    engine.dp_backend = backend
    engine.dp_totals = totals
    return backend


class DPTotals:
    """Running totals of a plain engine's DP sync (this rank), for logs and ``report_to``."""

    # every key metrics() may return (dp/compression_ratio only once bytes were sent)
    KEYS = ("dp/steps", "dp/bytes_sent", "dp/allreduce_bytes", "dp/compression_ratio", "dp/collectives",
            "dp/comm_s", "dp/hidden_comm_s", "dp/replicas_in_sync", "dp/world_size")

    def __init__(self, dense_bytes_per_step: int, world_size: int):
        self.dense_bytes_per_step, self.world_size = dense_bytes_per_step, world_size
        self.steps = self.bytes_sent = self.collectives = 0
        self.comm_s = self.hidden_comm_s = 0.0
        self.in_sync = True

    def add(self, stats: dict, backend, optimizer_step: bool = True) -> None:
        self.steps += int(optimizer_step)
        self.bytes_sent += int(stats.get("bytes_sent", 0))
        self.collectives += int(stats.get("collectives", 0))
        self.comm_s += float(stats.get("comm_s", 0.0))
        self.hidden_comm_s += float(stats.get("hidden_comm_s", 0.0))
        self.in_sync = backend.replicas_in_sync()

    def metrics(self) -> dict:
        """``dp/...`` metrics: bytes this rank sent, the ratio to a plain all-reduce of the same
        steps, time in DP collectives, and whether every replica holds the same weights now."""
        dense = self.dense_bytes_per_step * self.steps
        out = {"dp/steps": self.steps, "dp/bytes_sent": self.bytes_sent, "dp/allreduce_bytes": dense,
               "dp/collectives": self.collectives, "dp/comm_s": round(self.comm_s, 6),
               "dp/hidden_comm_s": round(self.hidden_comm_s, 6),
               "dp/replicas_in_sync": float(self.in_sync), "dp/world_size": self.world_size}
        if self.bytes_sent:  # x fewer bytes than a plain all-reduce of the same steps
            out["dp/compression_ratio"] = round(dense / self.bytes_sent, 4)
        return out
