"""Which config names DeepSpeed reads: ``--set`` warns about a key it adds only when DeepSpeed
would ignore it (a misspelling), not when it turns on a section the shipped configs leave out
(``--set bf16.enabled=true``)."""
from __future__ import annotations

import functools

# sections whose keys DeepSpeed validates itself (or owns wholly); a path under them is not second-guessed
_DS_SECTIONS = {"activation_checkpointing", "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet",
                "comms_logger", "aio", "compression_training", "data_efficiency", "elasticity", "autotuning",
                "checkpoint", "monitor_config", "nebula", "sparse_attention", "curriculum_learning"}


def deepspeed_knows(keys: list[str]) -> bool:
    """Whether every key of a dotted config path is a name DeepSpeed's config reads: its
    ``runtime.constants`` (``bf16``, ``enabled``, ``gradient_clipping``, ...), the ZeRO section's
    fields and aliases, or a section it validates itself. ``bf16.enabled`` is known, ``bf61.enabled`` is
    not."""
    if keys[0] in _DS_SECTIONS:
        return True
    if keys[0] in ("optimizer", "scheduler"):       # the driver checks what goes under params
        return len(keys) < 2 or keys[1] in ("type", "params")
    names, zero_fields = _names()
    if keys[0] == "zero_optimization":
        return len(keys) == 1 or keys[1] in zero_fields
    return all(k in names for k in keys)


@functools.lru_cache(maxsize=1)
def _names() -> tuple[frozenset, frozenset]:
    import deepspeed.runtime.constants as constants
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    names = {v for k, v in vars(constants).items() if k.isupper() and isinstance(v, str)}
    fields = DeepSpeedZeroConfig.model_fields
    return frozenset(names), frozenset(set(fields) | {f.alias for f in fields.values() if f.alias})
