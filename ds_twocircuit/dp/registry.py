"""Name -> class registry of data-parallel synchronisation backends (``twocircuit.dp.backend``).

Built-ins: ``allreduce``, ``powersgd``, ``diloco``, ``streaming_diloco``.  A third party registers
its own subclass of :class:`ds_twocircuit.dp.base.DPBackend` with::

    @register_backend("my_sync")
    class MySync(DPBackend):
        config_keys = frozenset({"options"})   # the twocircuit.dp keys it reads
        ...

Invariant: a name maps to exactly one class for the life of the process (re-registering the same
class is a no-op, a different class under a taken name is refused).
"""
from __future__ import annotations

import importlib

BUILTIN_BACKENDS = ("allreduce", "powersgd", "diloco", "streaming_diloco")
_BUILTIN_MODULES = ("ds_twocircuit.dp.allreduce", "ds_twocircuit.dp.powersgd",
                    "ds_twocircuit.dp.diloco")

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
        cls.backend_name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for mod in _BUILTIN_MODULES:
            importlib.import_module(mod)


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


def build_backend(named_params, comm, cfg, **kwargs):
    """Build the backend named by ``cfg["backend"]`` (``cfg``: the ``dp`` dict or a DPConfig);
    ``kwargs`` go to its constructor (e.g. ``fragments=`` for streaming_diloco)."""
    from ds_twocircuit.dp.config import DPConfig

    cfg = DPConfig.coerce(cfg)
    return get_backend(cfg.backend)(named_params, comm, cfg, **kwargs)
