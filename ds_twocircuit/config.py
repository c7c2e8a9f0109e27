"""The ``"twocircuit"`` section of a DeepSpeed JSON config, as one typed object.

Validated once, at start, before any process group exists: every error names the dotted key and
what is allowed, so a bad config fails identically on every rank instead of hanging one.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A bad setting; the message names the key (or file) and what is allowed."""


def _check_keys(d: dict, allowed: set[str], prefix: str) -> None:
    if not isinstance(d, dict):
        raise ConfigError(f"{prefix} must be a JSON object, got {type(d).__name__}")
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise ConfigError(f"unknown key {prefix}.{unknown[0]}; allowed keys under {prefix}: "
                          f"{', '.join(sorted(allowed))}")


def _typed(value, typ, key):
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is bool and not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if typ is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if typ in (float, str) and not isinstance(value, typ):
        raise ConfigError(f"{key} must be a {typ.__name__}, got {value!r}")
    return value


def _from_dict(cls, d: dict | None, prefix: str):
    d = {} if d is None else d
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    _check_keys(d, set(fields), prefix)
    kwargs = {}
    for name, value in d.items():
        f = fields[name]
        typ = f.type if isinstance(f.type, type) else {"float": float, "int": int, "bool": bool,
                                                        "str": str}.get(str(f.type))
        kwargs[name] = _typed(value, typ, f"{prefix}.{name}") if typ else value
    obj = cls(**kwargs)
    obj.validate(prefix)
    return obj


def _range(value, lo, hi, key, lo_open=False, hi_open=False):
    ok_lo = value > lo if lo_open else value >= lo
    ok_hi = value < hi if hi_open else value <= hi
    if not (ok_lo and ok_hi):
        lb = "(" if lo_open else "["
        rb = ")" if hi_open else "]"
        raise ConfigError(f"{key} = {value!r} is outside the allowed range {lb}{lo}, {hi}{rb}")


def _choice(value, allowed, key):
    if value not in allowed:
        raise ConfigError(f"{key} = {value!r}; allowed: {', '.join(map(str, allowed))}")


@dataclass
class SpectralConfig:
    """Spectral correction of masked gradients with the SVD of an EMA of anchor gradients."""
    alpha: float = 0.3
    tau: float = 1e-3
    beta: float = 0.95
    tau_mode: str = "absolute"      # absolute (the paper) | relative (tau * s_max)
    svd: str = "full"               # full | randomized
    svd_rank: int = 0               # randomized SVD rank (0: min(n, m))
    topk_diag: int = 16             # k of the alignment diagnostic
    anchor_mix: float = 0.0         # add the anchor EMA itself, scaled to ||G_mask||, with this
                                    # weight (0: the paper's filter only)
    ema_init: str = "bias_corrected"  # bias_corrected (Adam-style) | first (M = first G) |
                                      # zero (the formula taken literally: M starts at 0)

    def validate(self, p):
        _range(self.alpha, 0.0, 1.0, f"{p}.alpha")
        _range(self.tau, 0.0, float("inf"), f"{p}.tau", lo_open=True)
        _range(self.beta, 0.0, 1.0, f"{p}.beta", hi_open=True)
        _choice(self.tau_mode, ("absolute", "relative"), f"{p}.tau_mode")
        _choice(self.svd, ("full", "randomized"), f"{p}.svd")
        _range(self.svd_rank, 0, 1 << 20, f"{p}.svd_rank")
        _range(self.topk_diag, 1, 1 << 20, f"{p}.topk_diag")
        _choice(self.ema_init, ("bias_corrected", "first", "zero"), f"{p}.ema_init")
        _range(self.anchor_mix, 0.0, 100.0, f"{p}.anchor_mix")


@dataclass
class AnchorConfig:
    """The anchor circuit: Z unmasked pipeline replicas on stale snapshots."""
    enabled: bool = False
    every: int = 20                 # K: fast steps between snapshots
    store: str = ""                 # snapshot store folder ("" -> <output_dir>/anchor_store)
    keep: int = 3                   # committed snapshots kept
    replicas: int = 1               # Z (the --anchor-replicas flag overrides)
    startup_wait_s: float = -1.0    # before step 0, wait up to this long for the anchor to be up
                                    # (-1: 120 s when the launch holds anchor ranks, else 0)
    correction: str = "spectral"    # spectral (the paper's filter) | delayed_ef (paired control variate:
                                    # G + ef_lambda x EMA(G_dense - G_comp) of the snapshot steps)
    ef_lambda: float = 1.0          # delayed_ef: weight of the measured error
    ef_beta: float = 0.5            # delayed_ef: EMA decay of the errors
    consume: str = "scheduled"      # scheduled: use the gradient of snapshot s at step s+every (or
                                    # later if it is late) -- staleness K, reproducible; arrival: as
                                    # soon as it is published (staleness = the anchor's latency)
    spectral: SpectralConfig = field(default_factory=SpectralConfig)

    def validate(self, p):
        _range(self.every, 1, 1 << 30, f"{p}.every")
        _range(self.keep, 1, 1000, f"{p}.keep")
        _range(self.replicas, 0, 1024, f"{p}.replicas")
        _choice(self.consume, ("scheduled", "arrival"), f"{p}.consume")
        _choice(self.correction, ("spectral", "delayed_ef"), f"{p}.correction")
        _range(self.ef_lambda, 0.0, 100.0, f"{p}.ef_lambda")
        _range(self.ef_beta, 0.0, 1.0, f"{p}.ef_beta", hi_open=True)


@dataclass
class CodecConfig:
    """State of the ``meanfill`` and ``lowrank`` codecs (``statecodecs.py``)."""
    groups: list = field(default_factory=lambda: [[16, 8], [184, 4]])  # lowrank: [count, bits] of
                                    # the coefficients, leading principal directions first
    refresh_steps: list = field(default_factory=lambda: [0, 1, 3])  # steps whose first message ships
                                    # new state (mean / basis) fitted on everything the sender saw
    refresh_every: int = 0          # and every N steps after the last listed one (0: never)
    coef_norm: str = "none"         # lowrank: none | sqrt_std (divide each coefficient by
                                    # lambda_i ** 0.25 before quantising; r more bf16 values of state)

    def validate(self, p):
        from .statecodecs import LowRankCodec, check_groups
        try:
            check_groups(self.groups, key=f"{p}.groups")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if (not isinstance(self.refresh_steps, list) or not self.refresh_steps
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in self.refresh_steps)):
            raise ConfigError(f"{p}.refresh_steps must be a non-empty list of step numbers >= 0 "
                              f"(the first is the step that ships the first state), got {self.refresh_steps!r}")
        _range(self.refresh_every, 0, 1 << 30, f"{p}.refresh_every")
        _choice(self.coef_norm, LowRankCodec.COEF_NORMS, f"{p}.coef_norm")


CODEC_MODES = ("random", "topk", "dense", "meanfill", "lowrank")


@dataclass
class TwoCircuitConfig:
    mode: str = "random"            # random (the method) | topk (ablation) | dense (stock) |
                                    # meanfill | lowrank (codecs with state, see statecodecs.py)
    mask_rate: float = 0.95         # p: fraction of channels dropped at each boundary
    rescale: bool = False           # multiply kept values by 1/(1-p) (off: the paper)
    warmup_steps: int = 0           # dense steps before masking starts
    ramp_steps: int = 0             # linear ramp of p from 0 over this many steps
    wire_dtype: str = "auto"        # auto (activation dtype) | fp32 | bf16 | fp16
    mask_seed: int | None = None    # run seed of the PRF (None: the --seed flag)
    partition: str = "balanced"     # balanced (by layer cost) | type (even decoders) | uniform
    tied_embeddings: str = "untie"  # untie | sync | freeze  (see README)
    dp: dict = field(default_factory=dict)
    codec: CodecConfig = field(default_factory=CodecConfig)
    anchor: AnchorConfig = field(default_factory=AnchorConfig)

    def validate(self, p="twocircuit"):
        _choice(self.mode, CODEC_MODES, f"{p}.mode")
        if self.mode == "lowrank" and (self.warmup_steps or self.ramp_steps or self.rescale):
            raise ConfigError(f"{p}.warmup_steps / ramp_steps / rescale act on the PRF mask; they do not "
                              f"apply to {p}.mode = 'lowrank' (set them to 0 / false)")
        _range(self.mask_rate, 0.0, 1.0, f"{p}.mask_rate", hi_open=True)
        _range(self.warmup_steps, 0, 1 << 30, f"{p}.warmup_steps")
        _range(self.ramp_steps, 0, 1 << 30, f"{p}.ramp_steps")
        _choice(self.wire_dtype, ("auto", "fp32", "bf16", "fp16"), f"{p}.wire_dtype")
        _choice(self.partition, ("balanced", "type", "uniform"), f"{p}.partition")
        _choice(self.tied_embeddings, ("untie", "sync", "freeze"), f"{p}.tied_embeddings")
        if self.mode == "topk" and self.mask_rate == 0.0:
            raise ConfigError(f"{p}.mask_rate must be > 0 with {p}.mode = 'topk'")
        from .dp.config import DPConfig  # validated here so errors come before any process group
        try:
            self.dp_config = DPConfig.from_dict(self.dp, prefix=f"{p}.dp")
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(str(e)) from None

    @property
    def effective_mask_rate(self) -> float:
        return 0.0 if self.mode in ("dense", "lowrank") else self.mask_rate

    @classmethod
    def from_dict(cls, d: dict | None, prefix: str = "twocircuit") -> "TwoCircuitConfig":
        d = dict(d or {})
        anchor = d.pop("anchor", None)
        codec = d.pop("codec", None)
        spectral = (anchor or {}).get("spectral") if isinstance(anchor, dict) else None
        if anchor is not None:
            _check_keys(anchor, {f.name for f in dataclasses.fields(AnchorConfig)}, f"{prefix}.anchor")
            anchor = {k: v for k, v in anchor.items() if k != "spectral"}
        if "mask_seed" in d and d["mask_seed"] is not None:
            _typed(d["mask_seed"], int, f"{prefix}.mask_seed")
        if "dp" in d and not isinstance(d["dp"], dict):
            raise ConfigError(f"{prefix}.dp must be a JSON object")
        obj = _from_dict(cls, d, prefix)
        obj.codec = _from_dict(CodecConfig, codec, f"{prefix}.codec")
        obj.anchor = _from_dict(AnchorConfig, anchor, f"{prefix}.anchor")
        obj.anchor.spectral = _from_dict(SpectralConfig, spectral, f"{prefix}.anchor.spectral")
        return obj

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return d


SHARE_DIR = os.path.join("share", "ds-twocircuit", "ds_configs")  # where a wheel installs ds_configs/


def shipped_config_dirs() -> list[str]:
    """The source tree's ``ds_configs/`` (editable installs, checkouts), then the copy a wheel
    installs under ``<prefix>/share/ds-twocircuit/ds_configs``."""
    import sys
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dirs = [os.path.join(here, "ds_configs"), os.path.join(sys.prefix, SHARE_DIR)]
    return [d for d in dirs if os.path.isdir(d)]


def resolve_config(path: str) -> str:
    """``path`` if it exists; else a shipped config of that name (``lowrank.json``,
    ``ds_configs/lowrank.json`` or ``lowrank`` all work from any folder, after any install)."""
    if os.path.isfile(path):
        return path
    name = path.removeprefix("ds_configs/")
    if not os.path.isabs(path) and "/" not in name:
        name = name if name.endswith(".json") else name + ".json"
        for d in shipped_config_dirs():
            if os.path.isfile(os.path.join(d, name)):
                return os.path.join(d, name)
    shipped = sorted({f for d in shipped_config_dirs() for f in os.listdir(d) if f.endswith(".json")})
    raise ConfigError(f"DeepSpeed config file {path!r} does not exist"
                      + (f"; shipped configs: {', '.join(shipped)}" if shipped else ""))


def load_ds_config(path: str) -> dict:
    """Read a DeepSpeed JSON config; errors name the file."""
    path = resolve_config(path)
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"DeepSpeed config file {path!r} is not valid JSON: {e}") from None


def check_deepspeed_section(ds: dict, pp: int, path: str = "<config>") -> None:
    """The DeepSpeed settings this project cannot combine with pipeline parallelism."""
    zero = ds.get("zero_optimization", {}) or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if pp > 1 and isinstance(stage, int) and stage >= 2:
        raise ConfigError(f"{path}: zero_optimization.stage = {stage} cannot be used with pipeline "
                          f"parallelism (pp = {pp}); DeepSpeed allows ZeRO stage 0 or 1 with pipelines")
