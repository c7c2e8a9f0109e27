"""Name -> class registry of data-parallel synchronisation backends (``twocircuit.dp.backend``),
and the one entry point that reads a ``twocircuit.dp`` section (:func:`config_from_dict`).

Built-ins (``allreduce``, ``powersgd``, ``diloco``, ``streaming_diloco``) are listed here by
module and class and imported on first use, so they never import this module: the package's
imports run one way (config <- base <- backends <- registry).  A third party registers its own
subclass of :class:`ds_twocircuit.dp.base.DPBackend`, with its settings as a config class::

    @dataclass(frozen=True)
    class MySyncConfig(BackendConfig):          # ds_twocircuit.dp.config
        backend: str = "my_sync"
        period: int = setting(4, check=int_in(1))

    @register_backend("my_sync")
    class MySync(DPBackend):
        config_class = MySyncConfig   # default: OptionsConfig, one free-form "options" object
        ...

Invariant: a name maps to exactly one class for the life of the process (re-registering the same
class is a no-op, a different class under a taken name is refused).
"""
from __future__ import annotations

import importlib

from ds_twocircuit.configkit import ConfigError, check_keys, key
from ds_twocircuit.dp.config import DEFAULT_PREFIX, BackendConfig, OptionsConfig

BUILTIN_BACKENDS = ("allreduce", "powersgd", "diloco", "streaming_diloco")
_BUILTIN_CLASSES = {"allreduce": ("ds_twocircuit.dp.allreduce", "AllReduce"),
                    "powersgd": ("ds_twocircuit.dp.powersgd", "PowerSGD"),
                    "diloco": ("ds_twocircuit.dp.diloco", "DiLoCo"),
                    "streaming_diloco": ("ds_twocircuit.dp.diloco", "StreamingDiLoCo")}
DEFAULT_BACKEND = "allreduce"

_REGISTRY: dict[str, type] = {}
_builtins_loaded = False


def register_backend(name: str):
    """Class decorator: register ``cls`` under ``name`` and set ``cls.backend_name``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"backend name must be a non-empty string, got {name!r}")

    def deco(cls):
        old = _REGISTRY.get(name)
        # the same class re-imported (a module reload) may register again
        same = old is not None and (old.__module__, old.__qualname__) == (cls.__module__,
                                                                          cls.__qualname__)
        if old is not None and not same:
            raise ValueError(f"twocircuit.dp.backend {name!r} is already registered "
                             f"to {old.__module__}.{old.__qualname__}")
        conf = getattr(cls, "config_class", None)
        if not (isinstance(conf, type) and issubclass(conf, BackendConfig)):
            raise ValueError(f"backend {name!r}: config_class must be a subclass of "
                             f"ds_twocircuit.dp.config.BackendConfig, got {conf!r}")
        if conf.own_backend() not in (None, name):
            raise ValueError(f"backend {name!r}: its config_class {conf.__name__} is for backend "
                             f"{conf.own_backend()!r}")
        cls.backend_name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for name, (mod, cls) in _BUILTIN_CLASSES.items():
            register_backend(name)(getattr(importlib.import_module(mod), cls))


def available_backends() -> tuple[str, ...]:
    """Built-in names first, then third-party ones in registration order."""
    _load_builtins()
    return BUILTIN_BACKENDS + tuple(n for n in _REGISTRY if n not in BUILTIN_BACKENDS)


def get_backend(name: str) -> type:
    _load_builtins()
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown twocircuit.dp.backend {name!r}; allowed: "
                         + ", ".join(available_backends())) from None


def known_keys() -> frozenset:
    """Every key some registered backend reads, ``options`` (third parties' default) and
    ``backend``: anything else is a typo."""
    _load_builtins()
    return frozenset({"backend"}).union(OptionsConfig.keys(),
                                        *(cls.config_class.keys() for cls in _REGISTRY.values()))


def config_from_dict(d: dict | None = None, prefix: str = DEFAULT_PREFIX) -> BackendConfig:
    """The ``twocircuit.dp`` section ``d`` as the config of the backend it names (default
    ``allreduce``), validated by that backend's config class.  A key no backend reads is refused
    listing every known key; one of another backend, by the named backend's class."""
    d = {} if d is None else d
    check_keys(d, known_keys(), prefix)
    name = d.get("backend", DEFAULT_BACKEND)
    names = available_backends()
    if not isinstance(name, str) or name not in names:
        raise ConfigError(f"{key(prefix, 'backend')} must be one of {', '.join(names)}; "
                          f"got {name!r}")
    return get_backend(name).config_class.from_dict({**d, "backend": name}, prefix=prefix)


def build_backend(named_params, comm, cfg, **kwargs):
    """Build the backend named by ``cfg`` (the ``dp`` dict or a backend config); ``kwargs`` go to
    its constructor (e.g. ``fragments=`` for streaming_diloco)."""
    if not isinstance(cfg, BackendConfig):
        cfg = config_from_dict(cfg)
    return get_backend(cfg.backend)(named_params, comm, cfg, **kwargs)
