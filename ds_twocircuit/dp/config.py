"""What every ``twocircuit.dp`` section shares: ``{"backend": name, ...that backend's keys}``.

Each backend owns its settings: a frozen dataclass subclassing :class:`BackendConfig`, declared
next to its algorithm and named by the backend class's ``config_class`` (``AllReduceConfig`` in
allreduce.py, ``PowerSGDBackendConfig`` in powersgd.py, ``DiLoCoConfig`` and
``StreamingDiLoCoConfig`` in diloco.py).  A third-party backend declares its own, or gets
:class:`OptionsConfig` (one free-form ``options`` object).  So no class here holds a field of one
backend, and adding a backend touches no shared code.

Here is only the machinery they share, so that every backend's errors read alike: each names the
full dotted key (``twocircuit.dp.inner_steps``) and what is allowed; a key the backend does not use
is refused (never silently ignored); the hooks a backend overrides are ``check_consistency``
(contradictory keys), ``sync_schedule`` (its traffic, for the cost model) and ``check_run`` (the
DeepSpeed settings it cannot run with, read once by the pipeline launcher and once by the plain
engine adapter).

This module imports nothing else of :mod:`ds_twocircuit.dp`: the registry (which picks the class
from the ``backend`` name, :func:`ds_twocircuit.dp.registry.config_from_dict`) and the backends
import it, never the other way round.
"""
from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass, field

from ds_twocircuit.configkit import (ConfigError, check_bool, check_float, check_int, check_range,
                                     key, typed_fields)

DEFAULT_PREFIX = "twocircuit.dp"


# --- field declarations ------------------------------------------------------------------------

def setting(default=MISSING, *, check=None, default_factory=MISSING):
    """A config field whose JSON value goes through ``check(value, dotted_key) -> value`` (raising
    ConfigError); without ``check`` an int/float/bool/str field gets its type checked only."""
    return field(default=default, default_factory=default_factory,
                 metadata={"check": check} if check is not None else {})


def int_in(lo=None, hi=None):
    """Check: an integer (not a bool) in ``[lo, hi]``."""
    def check(v, name):
        return check_range(check_int(v, name), name, lo, hi)
    return check


def float_in(lo=None, hi=None, lo_open=False, hi_open=False):
    """Check: a finite number in the range (``*_open``: strict bound); ints become floats."""
    def check(v, name):
        return check_range(check_float(v, name), name, lo, hi, lo_open, hi_open)
    return check


def boolean(v, name):
    return check_bool(v, name)


def json_object(v, name):
    if not isinstance(v, dict):
        raise ConfigError(f"{name} must be an object (dict), got {v!r}")
    return dict(v)


def nested(cls):
    """Check: a sub-object parsed by ``cls.from_dict(value, prefix=dotted_key)``."""
    def check(v, name):
        return cls.from_dict(v, prefix=name)
    return check


def parse_fields(cls, d: dict, prefix: str) -> dict:
    """The keyword arguments of dataclass ``cls`` from JSON object ``d`` (keys already checked),
    each value through its field's ``check``."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    checked = {n for n in d if n in fields and "check" in fields[n].metadata}
    kw = typed_fields(cls, d, prefix, skip=checked)
    for n in checked:
        kw[n] = fields[n].metadata["check"](d[n], key(prefix, n))
    return kw


# --- what a backend's compatibility rules read ---------------------------------------------------

@dataclass(frozen=True)
class RunSettings:
    """The settings of the run a backend would join that some backends cannot live with.

    Built from the DeepSpeed JSON before any process starts (:meth:`from_ds_config`, the pipeline
    launcher) or from an already built engine (``adapters/plain_engine.py``), so both paths apply
    the same rules (:meth:`BackendConfig.check_run`)."""
    zero_stage: int = 0
    fp16: bool = False
    bf16: bool = False
    pp: int = 1                      # pipeline stages
    tied_embeddings: str = "untie"   # twocircuit.tied_embeddings
    model_tied: bool = False         # the model ties its input and output embeddings

    @classmethod
    def from_ds_config(cls, ds: dict, pp: int = 1, tied_embeddings: str = "untie",
                       model_tied: bool = False) -> "RunSettings":
        zero = ds.get("zero_optimization") or {}
        stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
        return cls(zero_stage=stage if isinstance(stage, int) else 0,
                   fp16=bool((ds.get("fp16") or {}).get("enabled")),
                   bf16=bool((ds.get("bf16") or {}).get("enabled")),
                   pp=pp, tied_embeddings=tied_embeddings, model_tied=bool(model_tied))


# --- the base of every backend's settings --------------------------------------------------------

@dataclass(frozen=True)
class BackendConfig:
    """One backend's ``twocircuit.dp`` section; a subclass adds that backend's keys as fields
    (declared with :func:`setting`) and sets ``backend``'s default to its registered name."""
    backend: str

    @classmethod
    def keys(cls) -> frozenset:
        """The ``twocircuit.dp`` keys this backend reads (``backend`` aside)."""
        return frozenset(f.name for f in dataclasses.fields(cls) if f.init) - {"backend"}

    @classmethod
    def own_backend(cls) -> str | None:
        """The backend name this class is fixed to (its ``backend`` default); None when it serves
        any backend (:class:`OptionsConfig`)."""
        f = next(f for f in dataclasses.fields(cls) if f.name == "backend")
        return None if f.default is MISSING else f.default

    @classmethod
    def from_dict(cls, d: dict | None, prefix: str = DEFAULT_PREFIX) -> "BackendConfig":
        """Validate JSON object ``d`` (``backend`` included or implied) into this class."""
        d = {} if d is None else d
        if not isinstance(d, dict):
            raise ConfigError(f"{prefix} must be a JSON object, got {type(d).__name__}")
        own = cls.own_backend()
        name = d.get("backend", own)
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{key(prefix, 'backend')} must name the backend (a non-empty "
                              f"string), got {name!r}")
        if own not in (None, name):
            raise ConfigError(f"{key(prefix, 'backend')} is {name!r} but {cls.__name__} holds the "
                              f"settings of backend {own!r}")
        used = cls.keys()
        unused = sorted(str(k) for k in set(d) - used - {"backend"})
        if unused:
            raise ConfigError(f"{key(prefix, unused[0])} is not used by {key(prefix, 'backend')}="
                              f"{name!r} (keys it uses: {', '.join(sorted(used)) or 'none'}); "
                              "remove it")
        cfg = cls(backend=name, **parse_fields(cls, {k: v for k, v in d.items() if k != "backend"},
                                               prefix))
        cfg.check_consistency(frozenset(d), prefix)
        return cfg

    @classmethod
    def coerce(cls, cfg, backend: str, prefix: str = DEFAULT_PREFIX) -> "BackendConfig":
        """A backend built directly (tests, third parties) may be handed its config or a raw dict;
        either must be for ``backend``."""
        if isinstance(cfg, BackendConfig):
            if cfg.backend != backend:
                raise ConfigError(f"{key(prefix, 'backend')} is {cfg.backend!r} but a {backend!r} "
                                  "backend is being built")
            if not isinstance(cfg, cls):
                raise ConfigError(f"{prefix}: backend {backend!r} reads a {cls.__name__}, "
                                  f"got a {type(cfg).__name__}")
            return cfg
        if cfg is not None and not isinstance(cfg, dict):
            raise ConfigError(f"{prefix} must be a JSON object, got {type(cfg).__name__}")
        d = dict(cfg or {})
        if d.setdefault("backend", backend) != backend:
            raise ConfigError(f"{key(prefix, 'backend')} is {d['backend']!r} but a {backend!r} "
                              "backend is being built")
        return cls.from_dict(d, prefix=prefix)

    # --- hooks a backend overrides ---------------------------------------------------------------
    def check_consistency(self, given: frozenset, prefix: str) -> None:
        """Refuse keys that contradict each other; ``given``: the keys the user actually set."""

    def sync_schedule(self) -> tuple[int, int, int]:
        """``(period, sync_every, overlap_steps)`` of this backend's traffic: steps in one full
        cycle (every fragment synced once), steps between two syncs on a link, and steps of work a
        sync runs behind (0: blocking).  Default: every step, blocking (all-reduce, PowerSGD)."""
        return 1, 1, 0

    def check_run(self, run: RunSettings, where: str = "") -> None:
        """Raise ConfigError if this backend cannot run with ``run``'s settings; ``where`` (a
        config file) prefixes the message."""

    def inner_lr_factor(self, replicas: int) -> float:
        """What the optimizer's learning rate (and a scheduler's) is multiplied by on ``replicas``
        DP replicas. Default 1: a backend that syncs gradients every step trains at the whole
        batch's step; DiLoCo's ``inner_lr_scale`` overrides it."""
        return 1.0

    def check_deepspeed(self, ds: dict, pp: int = 1, where: str = "", tied_embeddings: str = "untie",
                        model_tied: bool = False) -> None:
        """:meth:`check_run` on the settings of DeepSpeed JSON ``ds`` (before launch)."""
        self.check_run(RunSettings.from_ds_config(ds, pp, tied_embeddings, model_tied), where)

    def to_dict(self) -> dict:
        """``{"backend": name, ...this backend's keys}``, defaults filled in (JSON-ready)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class OptionsConfig(BackendConfig):
    """Settings of a third-party backend that declares no config class of its own: one free-form
    ``options`` object, read by the backend itself."""
    options: dict = setting(default_factory=dict, check=json_object)
