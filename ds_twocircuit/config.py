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

from .configkit import (ConfigError, check_choice, check_int, check_keys, check_range,  # noqa: F401
                        typed_fields)
from .dp.config import BackendConfig
from .dp.registry import config_from_dict


def _build(cls, d: dict | None, prefix: str, **given):
    """``cls`` from JSON object ``d`` (keys and scalar types checked), then validated."""
    obj = cls(**typed_fields(cls, d, prefix), **given)
    obj.validate(prefix)
    return obj


@dataclass(frozen=True)
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
        check_range(self.alpha, f"{p}.alpha", 0.0, 1.0)
        check_range(self.tau, f"{p}.tau", 0.0, float("inf"), lo_open=True)
        check_range(self.beta, f"{p}.beta", 0.0, 1.0, hi_open=True)
        check_choice(self.tau_mode, ("absolute", "relative"), f"{p}.tau_mode")
        check_choice(self.svd, ("full", "randomized"), f"{p}.svd")
        check_range(self.svd_rank, f"{p}.svd_rank", 0, 1 << 20)
        check_range(self.topk_diag, f"{p}.topk_diag", 1, 1 << 20)
        check_choice(self.ema_init, ("bias_corrected", "first", "zero"), f"{p}.ema_init")
        check_range(self.anchor_mix, f"{p}.anchor_mix", 0.0, 100.0)


@dataclass(frozen=True)
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
    max_wait_s: float = 0.0         # scheduled: at step s+every, wait up to this long for snapshot s's
                                    # gradients when the anchor is late (0: never wait, the paper's
                                    # design; > 0: reproducible runs while the anchor keeps up)
    spectral: SpectralConfig = field(default_factory=SpectralConfig)

    def validate(self, p):
        check_range(self.every, f"{p}.every", 1, 1 << 30)
        check_range(self.max_wait_s, f"{p}.max_wait_s", 0.0, 86400.0)
        check_range(self.keep, f"{p}.keep", 1, 1000)
        check_range(self.replicas, f"{p}.replicas", 0, 1024)
        check_choice(self.consume, ("scheduled", "arrival"), f"{p}.consume")
        check_choice(self.correction, ("spectral", "delayed_ef"), f"{p}.correction")
        check_range(self.ef_lambda, f"{p}.ef_lambda", 0.0, 100.0)
        check_range(self.ef_beta, f"{p}.ef_beta", 0.0, 1.0, hi_open=True)


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters on the decoder projections (PEFT); ``r = 0``: off (full fine-tuning)."""
    r: int = 0                      # adapter rank (the --lora-r flag overrides)
    alpha: float = 32.0             # scale alpha / r
    dropout: float = 0.0            # on the adapter input (0 keeps runs bit-reproducible)
    target_modules: list = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                          "gate_proj", "up_proj", "down_proj"])

    def validate(self, p):
        check_range(self.r, f"{p}.r", 0, 1 << 16)
        check_range(self.alpha, f"{p}.alpha", 0.0, None, lo_open=True)
        check_range(self.dropout, f"{p}.dropout", 0.0, 1.0, hi_open=True)
        if (not isinstance(self.target_modules, list) or not self.target_modules
                or not all(isinstance(m, str) and m for m in self.target_modules)):
            raise ConfigError(f"{p}.target_modules must be a non-empty list of module names "
                              f"(e.g. [\"q_proj\", \"v_proj\"]), got {self.target_modules!r}")

    @property
    def enabled(self) -> bool:
        return self.r > 0


@dataclass(frozen=True)
class TwoCircuitConfig:
    """The ``twocircuit`` section, read once (``from_dict``) and never written; a changed copy is
    made with ``dataclasses.replace``."""
    mode: str = "random"            # the boundary codec: a name registered in ds_twocircuit.codecs
                                    # (random: the paper's PRF mask, lowrank, dense, ...)
    mask_rate: float = 0.95         # p: fraction of channels dropped at each boundary
    rescale: bool = False           # multiply kept values by 1/(1-p) (off: the paper)
    warmup_steps: int = 0           # dense steps before masking starts
    ramp_steps: int = 0             # linear ramp of p from 0 over this many steps
    wire_dtype: str = "auto"        # auto (activation dtype) | fp32 | bf16 | fp16
    mask_seed: int | None = None    # run seed of the PRF (None: the --seed flag)
    partition: str = "balanced"     # balanced (by layer cost) | type (even decoders) | uniform
    tied_embeddings: str = "untie"  # untie | sync | freeze  (see README)
    clean_every: int = 0            # K > 0: every K-th step trains through dense boundaries (the
                                    # "clean" control; its bytes counted), 0: never
    plugins: list = field(default_factory=list)  # modules imported before anything is validated:
                                    # where a third-party codec or DP backend registers itself
    dp: BackendConfig = field(default_factory=config_from_dict)  # the backend's own config class
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    codec: Any = None               # the codec's own twocircuit.codec section (its config_cls), or None
    anchor: AnchorConfig = field(default_factory=AnchorConfig)

    def validate(self, p="twocircuit"):
        from .codecs import available_codecs, get_codec
        check_choice(self.mode, available_codecs(), f"{p}.mode")
        get_codec(self.mode).check_config(self, p)
        check_range(self.mask_rate, f"{p}.mask_rate", 0.0, 1.0, hi_open=True)
        check_range(self.warmup_steps, f"{p}.warmup_steps", 0, 1 << 30)
        check_range(self.ramp_steps, f"{p}.ramp_steps", 0, 1 << 30)
        check_range(self.clean_every, f"{p}.clean_every", 0, 1 << 30)
        check_choice(self.wire_dtype, ("auto", "fp32", "bf16", "fp16"), f"{p}.wire_dtype")
        check_choice(self.partition, ("balanced", "type", "uniform"), f"{p}.partition")
        check_choice(self.tied_embeddings, ("untie", "sync", "freeze"), f"{p}.tied_embeddings")
        if self.lora.enabled and self.tied_embeddings == "sync":
            raise ConfigError(f"{p}.lora with {p}.tied_embeddings = 'sync': under LoRA the tied embedding is "
                              "frozen, so there is no gradient to sync between the first and last stage; "
                              "use 'freeze' (one shared frozen copy) or 'untie'")

    def uncoded(self) -> "TwoCircuitConfig":
        """This section with dense boundaries (the anchor circuit's)."""
        from .codecs import DENSE
        return dataclasses.replace(self, mode=DENSE, codec=None, mask_rate=0.0, warmup_steps=0, ramp_steps=0,
                                   rescale=False)

    @property
    def effective_mask_rate(self) -> float:
        from .codecs import get_codec
        return self.mask_rate if get_codec(self.mode).uses_mask else 0.0

    @classmethod
    def from_dict(cls, d: dict | None, prefix: str = "twocircuit") -> "TwoCircuitConfig":
        check_keys({} if d is None else d, {f.name for f in dataclasses.fields(cls)}, prefix)
        d = dict(d or {})
        import_plugins(d.get("plugins", []), f"{prefix}.plugins")
        anchor, codec, dp = d.pop("anchor", None), d.pop("codec", None), d.pop("dp", None)
        lora = d.pop("lora", None)
        anchor = dict(anchor) if isinstance(anchor, dict) else anchor
        spectral = anchor.pop("spectral", None) if isinstance(anchor, dict) else None
        if d.get("mask_seed") is not None:
            check_int(d["mask_seed"], f"{prefix}.mask_seed")
        anchor_cfg = _build(AnchorConfig, anchor, f"{prefix}.anchor",
                            spectral=_build(SpectralConfig, spectral, f"{prefix}.anchor.spectral"))
        from .codecs import available_codecs, codec_config
        mode = d.get("mode", cls.mode)
        check_choice(mode, available_codecs(), f"{prefix}.mode")
        # the DP section is validated here too: errors come before any process group
        return _build(cls, d, prefix, codec=codec_config(mode, codec, f"{prefix}.codec"),
                      anchor=anchor_cfg, dp=config_from_dict(dp, prefix=f"{prefix}.dp"),
                      lora=_build(LoRAConfig, lora, f"{prefix}.lora"))

    def to_dict(self) -> dict[str, Any]:
        from .codecs import config_dict
        d = dataclasses.asdict(self)
        d["dp"] = self.dp.to_dict()
        d["codec"] = config_dict(self.codec)
        return d


def import_plugins(modules, key: str = "twocircuit.plugins") -> None:
    """Import each module of ``twocircuit.plugins`` (a list of importable module names): a third-party
    codec (``@register_codec``) or DP backend (``@register_backend``) registers itself on import, on
    every rank, before the config naming it is validated."""
    import importlib
    if not isinstance(modules, list) or not all(isinstance(m, str) and m for m in modules):
        raise ConfigError(f"{key} must be a list of module names (e.g. [\"my_package.my_codec\"]), got {modules!r}")
    for m in modules:
        try:
            importlib.import_module(m)
        except ImportError as e:
            raise ConfigError(f"{key}: cannot import {m!r} ({e}); it must be importable on every node "
                              "(installed, or on PYTHONPATH)") from None


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


def apply_overrides(ds: dict, overrides: list[str], where: str = "--set", known=None) -> dict:
    """``ds`` (a DeepSpeed config dict) with each ``KEY=VALUE`` of ``overrides`` applied: ``KEY`` a
    dotted path (``twocircuit.codec.groups``, ``optimizer.params.lr``), ``VALUE`` JSON (``[[112,4]]``,
    ``0.5``, ``true``, ``"bf16"``) or, if it is not JSON, a plain string. Missing objects on the path
    are created; the result is validated as any config file is. Returns a new dict; a key it adds
    outside ``twocircuit`` (whose keys are all checked) gets a warning, since DeepSpeed ignores keys
    it does not know (``gradient_cliping`` would change nothing), unless ``known(keys)`` says
    DeepSpeed reads that path (``adapters.dsconfig.deepspeed_knows``: ``bf16.enabled``)."""
    import warnings
    out = json.loads(json.dumps(ds))
    for item in overrides:
        path, sep, raw = item.partition("=")
        if not sep or not path or any(not k for k in path.split(".")):
            raise ConfigError(f"{where} {item!r}: expected KEY=VALUE with KEY a dotted path, e.g. "
                              "twocircuit.codec.groups=[[112,4]]")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        node = out
        keys = path.split(".")
        created = False
        for k in keys[:-1]:
            nxt = node.get(k)
            if nxt is None:
                nxt = node[k] = {}
                created = True
            if not isinstance(nxt, dict):
                raise ConfigError(f"{where} {item!r}: {k} is not an object in the config")
            node = nxt
        created = created or keys[-1] not in node
        node[keys[-1]] = value
        if created and keys[0] != "twocircuit" and not (known and known(keys)):
            warnings.warn(f"{where} {item!r} adds {path}, which the config did not have and DeepSpeed does not "
                          "name: check its spelling (DeepSpeed ignores keys it does not know)", stacklevel=2)
    return out
