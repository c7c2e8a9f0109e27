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
from ..dp.config import DPConfig
from ..dp.registry import get_backend
from .comm import dp_comm


# after_optimizer_step rewrites the live (fp16) weights; DeepSpeed's fp16 optimizer would overwrite
# them from its fp32 masters on the next step, silently undoing every outer update
FP16_DILOCO = ("twocircuit.dp.backend = {backend!r} cannot run with fp16.enabled: DeepSpeed's fp16 "
               "optimizer keeps fp32 master weights that would overwrite each outer (DiLoCo) update on "
               "the next step; train in fp32 (or bf16 with torch_autocast), or use backend 'powersgd' / "
               "'allreduce' with fp16")


def _dp_section(engine, dp):
    if dp is not None:
        return dp
    raw = getattr(engine, "config", None) or getattr(engine._config, "_param_dict", {})
    return ((raw or {}).get("twocircuit") or {}).get("dp") or {"backend": "allreduce"}


def attach_dp_backend(engine, dp: dict | None = None):
    """Replace ``engine``'s data-parallel all-reduce by the configured backend; returns it."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.utils import groups

    if isinstance(engine, PipelineEngine):
        raise ConfigError("attach_dp_backend is for plain DeepSpeed engines; pipelines get their backend "
                          "from launch/train.py (MaskedPipelineEngine)")
    cfg = DPConfig.from_dict(_dp_section(engine, dp))  # raises ConfigError naming the key
    if engine.zero_optimization_stage() >= 1:
        raise ConfigError(f"twocircuit.dp.backend = {cfg.backend!r} needs zero_optimization.stage = 0: ZeRO "
                          "partitions gradients/optimizer state over the DP group and reduces them itself")
    if isinstance(engine.optimizer, BF16_Optimizer):
        raise ConfigError(f"twocircuit.dp.backend = {cfg.backend!r} cannot run under DeepSpeed's BF16 optimizer "
                          "(it keeps its own flat fp32 gradients); use torch_autocast or fp32")
    if cfg.backend in ("diloco", "streaming_diloco") and engine.fp16_enabled():
        raise ConfigError(FP16_DILOCO.format(backend=cfg.backend))
    if not engine.managed_gradient_accumulation():
        raise ConfigError("twocircuit.dp needs DeepSpeed's managed gradient accumulation")
    comm = dp_comm(groups._get_data_parallel_group(), engine.dp_world_size)
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    backend = get_backend(cfg.backend)(named, comm, cfg)
    engine.enable_backward_allreduce = False
    # A private DeepSpeed method (listed, with the version it was checked against, in
    # deepspeed_private.py): the DP sync must run before the clipping inside it.
    original = engine._take_model_step

    def take_model_step(lr_kwargs, *args, **kwargs):
        step = engine.global_steps
        backend.reduce_gradients(step)
        out = original(lr_kwargs, *args, **kwargs)
        backend.after_optimizer_step(step)
        return out

    engine._take_model_step = take_model_step
    engine.dp_backend = backend
    return backend
