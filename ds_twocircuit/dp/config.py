"""Typed config for the ``"dp"`` subsection of the ``"twocircuit"`` DeepSpeed JSON section.

One plain dataclass, validated once by :meth:`DPConfig.from_dict`.  Every error names the full
dotted key (``twocircuit.dp.inner_steps``) and the allowed values.  Keys that the chosen backend
does not use, and keys that contradict each other (``overlap_steps`` with ``overlap: false``), are
refused rather than silently ignored.

Schema, defaults in brackets (``options`` is free-form, for third-party backends)::

    "dp": {
      "backend": "allreduce"|"powersgd"|"diloco"|"streaming_diloco"|<registered>  ["allreduce"]
      "powersgd": {                        # backend "powersgd", or compression "powersgd"
        "matrix_approximation_rank": int >= 1      [64]  the paper's "PowerSGD-64"
        "start_powerSGD_iter": int >= 0            [10]  dense all-reduce while step < this
        "min_compression_rate": float >= 0         [2.0] compress iff n*m / (r*(n+m)) >= this
        "use_error_feedback": bool                 [true]
        "warm_start": bool                         [true]
        "orthogonalization_epsilon": float >= 0    [0.0] 0: Householder QR; > 0: Gram-Schmidt
        "random_seed": int >= 0                    [0]   seeds the first Q (same on all ranks)
      },
      "inner_steps": int >= 1 (H)          [10]   diloco, streaming_diloco
      "outer_lr": float > 0                [0.7]  diloco, streaming_diloco
      "outer_momentum": float in [0, 1)    [0.9]  diloco, streaming_diloco
      "nesterov": bool                     [true] diloco, streaming_diloco
      "compression": null | "powersgd"     [null] diloco, streaming_diloco (pseudo-gradients)
      "num_fragments": int, 1 <= F <= H    [4]    streaming_diloco
      "overlap": bool                      [true] streaming_diloco
      "overlap_steps": int, 1 <= tau < H   [1]    streaming_diloco with overlap
      "merge_alpha": float in [0, 1]       [0.5]  streaming_diloco with overlap
      "options": dict                      [{}]   third-party backends
    }
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ds_twocircuit.configkit import (ConfigError, check_bool, check_float, check_int, check_keys,
                                     check_range, key)

DEFAULT_PREFIX = "twocircuit.dp"


def _check_int(prefix, name, v, lo=None, hi=None):
    return check_range(check_int(v, key(prefix, name)), key(prefix, name), lo, hi)


def _check_float(prefix, name, v, lo=None, hi=None, lo_open=False, hi_open=False):
    return check_range(check_float(v, key(prefix, name)), key(prefix, name), lo, hi, lo_open, hi_open)


def _check_bool(prefix, name, v):
    return check_bool(v, key(prefix, name))


@dataclass(frozen=True)
class PowerSGDConfig:
    """PowerSGD knobs, named as in PyTorch's ``PowerSGDState``."""
    matrix_approximation_rank: int = 64  # the paper's "PowerSGD-64"
    start_powerSGD_iter: int = 10
    min_compression_rate: float = 2.0
    use_error_feedback: bool = True
    warm_start: bool = True
    orthogonalization_epsilon: float = 0.0
    random_seed: int = 0

    @classmethod
    def from_dict(cls, d: dict | None,
                  prefix: str = DEFAULT_PREFIX + ".powersgd") -> "PowerSGDConfig":
        d = {} if d is None else d
        check_keys(d, {f.name for f in dataclasses.fields(cls)}, prefix)
        kw: dict[str, Any] = {}
        for name, v in d.items():
            if name in ("matrix_approximation_rank",):
                kw[name] = _check_int(prefix, name, v, lo=1)
            elif name in ("start_powerSGD_iter", "random_seed"):
                kw[name] = _check_int(prefix, name, v, lo=0)
            elif name in ("min_compression_rate", "orthogonalization_epsilon"):
                kw[name] = _check_float(prefix, name, v, lo=0.0)
            else:
                kw[name] = _check_bool(prefix, name, v)
        return cls(**kw)


@dataclass(frozen=True)
class DPConfig:
    """The ``twocircuit.dp`` section.  ``explicit`` holds the keys the user actually set."""
    backend: str = "allreduce"
    powersgd: PowerSGDConfig = field(default_factory=PowerSGDConfig)
    inner_steps: int = 10
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    compression: str | None = None
    num_fragments: int = 4
    overlap: bool = True
    overlap_steps: int = 1
    merge_alpha: float = 0.5
    options: dict = field(default_factory=dict)
    explicit: frozenset = field(default=frozenset(), compare=False, repr=False)

    def sync_schedule(self) -> tuple[int, int, int]:
        """``(period, sync_every, overlap_steps)`` of this backend's traffic: steps in one full cycle
        (every fragment synced once), steps between two syncs on a link, and steps of work a sync
        runs behind (0: blocking). All-reduce and PowerSGD sync every step, blocking; DiLoCo the
        whole model every H steps, blocking; Streaming DiLoCo one of F fragments every H / F steps,
        behind ``overlap_steps`` steps when ``overlap`` is on."""
        if self.backend == "streaming_diloco":
            return (self.inner_steps, max(1, self.inner_steps // self.num_fragments),
                    self.overlap_steps if self.overlap else 0)
        if self.backend == "diloco":
            return self.inner_steps, self.inner_steps, 0
        return 1, 1, 0

    @classmethod
    def keys(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)} - {"explicit"}

    @classmethod
    def coerce(cls, cfg: "DPConfig | dict | None", backend: str | None = None,
               prefix: str = DEFAULT_PREFIX) -> "DPConfig":
        """Accept a DPConfig or a raw dict; ``backend`` fills in / checks the backend name."""
        if isinstance(cfg, DPConfig):
            if backend is not None and cfg.backend != backend:
                raise ConfigError(f"{prefix}.backend is {cfg.backend!r} but a {backend!r} "
                                  "backend is being built")
            return cfg
        d = dict(cfg or {})
        if backend is not None:
            if d.setdefault("backend", backend) != backend:
                raise ConfigError(f"{prefix}.backend is {d['backend']!r} but a {backend!r} "
                                  "backend is being built")
        return cls.from_dict(d, prefix=prefix)

    @classmethod
    def from_dict(cls, d: dict | None, prefix: str = DEFAULT_PREFIX) -> "DPConfig":
        from ds_twocircuit.dp.registry import available_backends, get_backend

        d = {} if d is None else d
        check_keys(d, cls.keys(), prefix)
        kw: dict[str, Any] = {}
        backend = d.get("backend", cls.backend)
        names = available_backends()
        if not isinstance(backend, str) or backend not in names:
            raise ConfigError(f"{key(prefix, 'backend')} must be one of {', '.join(names)}; "
                              f"got {backend!r}")
        kw["backend"] = backend
        for name, v in d.items():
            if name == "backend":
                continue
            if name == "powersgd":
                kw[name] = PowerSGDConfig.from_dict(v, prefix=key(prefix, name))
            elif name in ("inner_steps", "num_fragments", "overlap_steps"):
                kw[name] = _check_int(prefix, name, v, lo=1)
            elif name == "outer_lr":
                kw[name] = _check_float(prefix, name, v, lo=0.0, lo_open=True)
            elif name == "outer_momentum":
                kw[name] = _check_float(prefix, name, v, lo=0.0, hi=1.0, hi_open=True)
            elif name == "merge_alpha":
                kw[name] = _check_float(prefix, name, v, lo=0.0, hi=1.0)
            elif name in ("nesterov", "overlap"):
                kw[name] = _check_bool(prefix, name, v)
            elif name == "compression":
                if v not in (None, "powersgd"):
                    raise ConfigError(f"{key(prefix, name)} must be null or \"powersgd\", "
                                      f"got {v!r}")
                kw[name] = v
            elif name == "options":
                if not isinstance(v, dict):
                    raise ConfigError(f"{key(prefix, name)} must be an object (dict), got {v!r}")
                kw[name] = dict(v)
        cfg = cls(explicit=frozenset(d), **kw)
        cfg._check_consistency(get_backend(backend), prefix)
        return cfg

    def _check_consistency(self, backend_cls, prefix: str) -> None:
        used = set(getattr(backend_cls, "config_keys", frozenset({"options"})))
        for k in sorted(self.explicit - {"backend"}):
            if k not in used:
                raise ConfigError(
                    f"{key(prefix, k)} is not used by {key(prefix, 'backend')}={self.backend!r} "
                    f"(keys it uses: {', '.join(sorted(used)) or 'none'}); remove it")
        if "num_fragments" in used and self.num_fragments > self.inner_steps:
            raise ConfigError(f"{key(prefix, 'num_fragments')} must be <= "
                              f"{key(prefix, 'inner_steps')} ({self.inner_steps}) so that no two "
                              f"fragments sync on the same step; got {self.num_fragments}")
        if ("compression" in used and "powersgd" in self.explicit
                and self.compression != "powersgd"):
            raise ConfigError(f"{key(prefix, 'powersgd')} is set but "
                              f"{key(prefix, 'compression')} is null; set compression: "
                              "\"powersgd\" or remove the powersgd block")
        if "overlap" in used:
            if not self.overlap:
                for k in ("overlap_steps", "merge_alpha"):
                    if k in self.explicit:
                        raise ConfigError(f"{key(prefix, k)} only applies with "
                                          f"{key(prefix, 'overlap')}=true")
            elif self.overlap_steps >= self.inner_steps:
                raise ConfigError(f"{key(prefix, 'overlap_steps')} must be < "
                                  f"{key(prefix, 'inner_steps')} ({self.inner_steps}) so a "
                                  "fragment's sync finishes before its next one starts; "
                                  f"got {self.overlap_steps}")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("explicit")
        return d
