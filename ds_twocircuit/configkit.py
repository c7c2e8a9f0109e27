"""The one validation kit of every typed config section (``twocircuit``, ``twocircuit.dp``, ...).

Every check names the full dotted key and what is allowed, in one wording:

- ``unknown key twocircuit.dp.inner_step; allowed keys under twocircuit.dp: backend, ...``
- ``twocircuit.mask_rate must be an integer | a number | true or false | a string, got 'x'``
- ``twocircuit.mask_rate = 1.5 is outside the allowed range [0.0, 1.0)``
- ``twocircuit.mode = 'foo'; allowed: random, topk, ...``

All raise :class:`ConfigError` (a ``ValueError``).
"""
from __future__ import annotations

import dataclasses
import math


class ConfigError(ValueError):
    """A bad setting; the message names the key (or file) and what is allowed."""


def key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def check_keys(d, allowed, prefix: str) -> None:
    """``d`` is a JSON object whose keys are all in ``allowed``."""
    if not isinstance(d, dict):
        raise ConfigError(f"{prefix} must be a JSON object, got {type(d).__name__}")
    unknown = sorted(str(k) for k in set(d) - set(allowed))
    if unknown:
        raise ConfigError(f"unknown key {key(prefix, unknown[0])}; allowed keys under {prefix}: "
                          f"{', '.join(sorted(allowed))}")


def check_int(value, name: str) -> int:
    if type(value) is not int:  # bool is an int subclass: refused on purpose
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    return value


def check_float(value, name: str) -> float:
    if type(value) not in (int, float):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be finite, got {value!r}")
    return value


def check_bool(value, name: str) -> bool:
    if type(value) is not bool:
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    return value


def check_str(value, name: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{name} must be a string, got {value!r}")
    return value


CHECKS = {int: check_int, float: check_float, bool: check_bool, str: check_str}


def check_range(value, name: str, lo=None, hi=None, lo_open: bool = False, hi_open: bool = False):
    """``lo <= value <= hi`` (``None``: unbounded; ``*_open``: strict)."""
    ok_lo = lo is None or (value > lo if lo_open else value >= lo)
    ok_hi = hi is None or (value < hi if hi_open else value <= hi)
    if not (ok_lo and ok_hi):
        lb = "(-inf" if lo is None else ("(" if lo_open else "[") + repr(lo)
        rb = "inf)" if hi is None else repr(hi) + (")" if hi_open else "]")
        raise ConfigError(f"{name} = {value!r} is outside the allowed range {lb}, {rb}")
    return value


def check_choice(value, allowed, name: str):
    if value not in allowed:
        raise ConfigError(f"{name} = {value!r}; allowed: {', '.join(map(str, allowed))}")
    return value


def _field_type(f: dataclasses.Field):
    if isinstance(f.type, type):
        return f.type
    return {"float": float, "int": int, "bool": bool, "str": str}.get(str(f.type))


def typed_fields(cls, d: dict | None, prefix: str, skip=()) -> dict:
    """The keyword arguments of dataclass ``cls`` from JSON object ``d``: unknown keys refused,
    scalar fields (int, float, bool, str) type-checked; other fields and ``skip`` passed through."""
    d = {} if d is None else d
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    check_keys(d, set(fields), prefix)
    out = {}
    for name, value in d.items():
        typ = None if name in skip else _field_type(fields[name])
        out[name] = CHECKS[typ](value, key(prefix, name)) if typ in CHECKS else value
    return out
