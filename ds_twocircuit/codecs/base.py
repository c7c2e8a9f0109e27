"""The boundary codec interface and its registry: what of a (..., H) activation or gradient crosses a
pipeline link, and the one place where ``twocircuit.mode`` is resolved to a codec.

A codec turns a dense tensor into a list of wire tensors (``pack_*``) and back (``unpack_*``), given a
:class:`Message` that both ends of a link can build without talking (the key of the PRF mask, the
shape, the kept channels, whether this message carries codec state). The sender of activations and
the receiver of the gradients of a link hold one codec object, the other end another one: a link is a
(sender, receiver) pair of the same class, built by :func:`make_codec` from the same config.

A new codec is one module: a subclass of :class:`Codec` with its ``name``, optionally its own config
dataclass (``config_cls``, the schema of ``twocircuit.codec``), decorated with
:func:`register_codec`. The engines, the single-process reference and the config validation ask the
class, never the name: the conformance tests in ``tests/test_codec_conformance.py`` run over
:func:`available_codecs`.

Pure torch, no DeepSpeed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .. import masks
from ..configkit import ConfigError, check_keys, typed_fields

DENSE = "dense"   # the uncoded boundary (the anchor circuit's, and dense evaluation)
WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def wire_dtype(name: str | None):
    """``twocircuit.wire_dtype`` -> torch dtype (``auto``/None: the activation's own dtype)."""
    return None if name in (None, "auto") else WIRE_DTYPES[name]


@dataclass(frozen=True)
class Message:
    key: int          # PRF key (seed, boundary, step, micro-batch, hidden)
    shape: tuple      # full tensor shape (..., H)
    keep: int         # kept channels per token (== H means dense)
    scale: float = 1.0  # 1/(1-p) when rescaling, else 1
    refresh: bool = False  # stateful codecs: this activation message carries new codec state
    train: bool = True     # a training message (stateful codecs measure only these)
    first: bool = False    # the first training message of its step on this link (either direction)
    metric: bool = False   # as a gradient message: it carries the receiver's gradient metric back
    collect: bool = False  # as a gradient message: the receiver adds it to the metric it still sends back

    @property
    def hidden(self) -> int:
        return int(self.shape[-1])

    @property
    def tokens(self) -> int:
        n = 1
        for s in self.shape[:-1]:
            n *= int(s)
        return n


class Codec:
    """One end of a boundary link. Subclasses implement the six pack/buffers/unpack methods.

    Class attributes a codec declares:

    * ``name`` -- its ``twocircuit.mode`` (set by :func:`register_codec`);
    * ``stateful`` -- it ships state (counted as ``pp_codec_state``) and has ``state_dict``;
    * ``uses_mask`` -- ``twocircuit.mask_rate`` / ``warmup_steps`` / ``ramp_steps`` / ``rescale`` act
      on it (the kept channels per token follow the mask schedule); otherwise every token keeps its H
      channels' worth of information and those keys must stay at their defaults;
    * ``config_cls`` -- the dataclass of its ``twocircuit.codec`` section (``None``: no section);
    * ``needs_reference`` -- ``pack_activation`` / ``unpack_activation`` take ``ref``, the base
      (pretrained, frozen) model's activation at this boundary for the same tokens, which each end
      computes for itself (``lowrank`` with ``reference: "base"``).
    """

    name = "base"
    stateful = False
    uses_mask = False
    config_cls = None
    needs_reference = False

    def __init__(self, wire_dtype=None, schedule: masks.MaskSchedule | None = None, rescale: bool = False,
                 cfg=None):
        self.wire_dtype = wire_dtype
        self.schedule = schedule if schedule is not None else masks.MaskSchedule(0.0)
        self.rescale = bool(rescale)
        self.cfg = cfg

    # ---------------------------------------------------------------- what both ends agree on
    def keep(self, step: int, hidden: int) -> int:
        """Kept channels per token at training step ``step`` (== hidden: the whole token)."""
        return self.schedule.keep(step, hidden) if self.uses_mask else hidden

    def scale(self, step: int, keep: int, hidden: int) -> float:
        if self.uses_mask and self.rescale and keep < hidden:
            return 1.0 / (1.0 - self.schedule.rate(step))
        return 1.0

    def refresh_due(self, step: int) -> bool:
        """Whether the first activation message of training step ``step`` carries new state."""
        return False

    def metric_due(self, step: int) -> bool:
        """Whether the first gradient message of training step ``step`` carries state back."""
        return False

    def metric_collects(self, step: int, first: bool) -> bool:
        """Whether a training gradient message of step ``step`` (``first``: the step's first on this
        link) goes into a gradient metric still to be sent back."""
        return False

    def message(self, key: int, shape, step: int, first_of_step: bool, train: bool, kind: str = "act") -> Message:
        """The message both ends build for one boundary tensor (``step``: the training step whose
        schedule applies; ``first_of_step``: the first message of that step on this link in the
        direction ``kind``, act or grad: a stateful codec's refresh rides on the first activation
        message of a refresh step, state sent back on the first gradient message of a metric step).
        A pure function of its arguments and the run's config: any codec object of the run builds
        the same message."""
        hidden = int(shape[-1])
        keep = self.keep(step, hidden)
        first = bool(train and first_of_step)
        return Message(key=key, shape=tuple(int(s) for s in shape), keep=keep,
                       scale=self.scale(step, keep, hidden),
                       refresh=bool(first and kind == "act" and self.refresh_due(step)), train=train,
                       first=first, metric=bool(first and self.metric_due(step)),
                       collect=bool(train and self.metric_collects(step, first)))

    # ---------------------------------------------------------------- sizes and descriptions
    def payload_bytes(self, hidden: int, element_bytes: int, step: int | None = None) -> tuple[int, int]:
        """(activation, gradient) bytes per token of the payload, state excluded, when activations
        are ``element_bytes`` wide (the run's dtype; a ``wire_dtype`` overrides it). ``step``: the
        mask schedule's step (None: after any warm-up and ramp)."""
        raise NotImplementedError

    def _element_bytes(self, element_bytes: int) -> int:
        return self.wire_dtype.itemsize if self.wire_dtype is not None else int(element_bytes)

    def _keep_after(self, hidden: int, step: int | None) -> int:
        return self.keep(step if step is not None else 1 << 40, hidden)

    def describe(self) -> dict:
        """What ``summary.json`` records under ``codec``."""
        return {"mode": self.name}

    @property
    def identity(self) -> bool:
        """True when nothing is lost on the wire but the dtype cast (dense boundaries)."""
        return False

    def _wire(self, dtype):
        return self.wire_dtype or dtype

    # ---------------------------------------------------------------- per-message state
    def state_tensor_count(self, msg: Message) -> int:
        """How many leading tensors of this activation message are codec state."""
        return 0

    def grad_state_tensor_count(self, msg: Message) -> int:
        """How many leading tensors of this gradient message are codec state sent back (counted as
        ``pp_grad_state``)."""
        return 0

    def forget(self, msg: Message) -> None:
        """The message's gradient has been handled: drop anything kept for it."""

    def reset(self) -> None:
        """Drop per-step state (called at the start of every train/eval batch)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, d: dict) -> None:
        pass

    @classmethod
    def merge_states(cls, states: list[dict]) -> dict:
        """One end's state for a run resumed on another DP width, from the old replicas' states of
        this link end (``ds_twocircuit.replicas``); the new link's two ends merge the same way, so
        they agree."""
        return states[0]

    state_bytes_sent = 0   # bytes of codec state this end has shipped (a stateful sender counts them)

    # ---------------------------------------------------------------- the wire
    def pack_activation(self, x: torch.Tensor, msg: Message) -> list[torch.Tensor]:
        raise NotImplementedError

    def activation_buffers(self, msg: Message, dtype, device) -> list[torch.Tensor]:
        raise NotImplementedError

    def unpack_activation(self, bufs, msg: Message, dtype) -> torch.Tensor:
        raise NotImplementedError

    def pack_gradient(self, g: torch.Tensor, msg: Message) -> list[torch.Tensor]:
        raise NotImplementedError

    def gradient_buffers(self, msg: Message, dtype, device) -> list[torch.Tensor]:
        raise NotImplementedError

    def unpack_gradient(self, bufs, msg: Message, dtype) -> torch.Tensor:
        raise NotImplementedError

    # ---------------------------------------------------------------- config hooks
    @classmethod
    def check_config(cls, tc, prefix: str) -> None:
        """Cross-key checks of the ``twocircuit`` section for this codec (``tc``: the section)."""
        if not cls.uses_mask and (tc.warmup_steps or tc.ramp_steps or tc.rescale):
            raise ConfigError(f"{prefix}.warmup_steps / ramp_steps / rescale act on the PRF mask; they do not "
                              f"apply to {prefix}.mode = {cls.name!r} (set them to 0 / false)")

    @classmethod
    def check_model(cls, cfg, hidden: int, where: str) -> None:
        """Refuse a codec section that cannot work on a boundary ``hidden`` wide (``where``: the
        model, for the message)."""


# ------------------------------------------------------------------------------------------ registry
_REGISTRY: dict[str, type] = {}
BUILTIN_MODULES = ("ds_twocircuit.codecs.dense", "ds_twocircuit.codecs.mask", "ds_twocircuit.codecs.meanfill",
                   "ds_twocircuit.codecs.lowrank")
BUILTIN_NAMES = ("random", "topk", "dense", "meanfill", "lowrank")   # the order errors list them in
_loaded = False


def register_codec(name: str):
    """Class decorator: ``cls`` answers ``twocircuit.mode = name``. A name maps to one class for the
    life of the process (the same class re-imported may register again)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"codec name must be a non-empty string, got {name!r}")

    def deco(cls):
        old = _REGISTRY.get(name)
        if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"twocircuit.mode {name!r} is already registered to "
                             f"{old.__module__}.{old.__qualname__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return deco


def _load_builtins() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        import importlib
        for mod in BUILTIN_MODULES:
            importlib.import_module(mod)


def available_codecs() -> tuple[str, ...]:
    """Registered codec names: the built-ins, then third-party ones in registration order."""
    _load_builtins()
    return BUILTIN_NAMES + tuple(n for n in _REGISTRY if n not in BUILTIN_NAMES)


def get_codec(name: str) -> type:
    _load_builtins()
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown twocircuit.mode {name!r}; allowed: {', '.join(available_codecs())}") from None


def codec_config(name: str, section: dict | None, prefix: str = "twocircuit.codec"):
    """The ``twocircuit.codec`` section validated by codec ``name``'s own schema (``None`` when the
    codec has none: then the section must be absent or empty)."""
    cls = get_codec(name)
    if cls.config_cls is None:
        if section:
            check_keys(section, set(section), prefix)   # a JSON object at least
            raise ConfigError(f"{prefix} is not used by twocircuit.mode = {name!r} (that codec has no "
                              f"settings); remove it (it has: {', '.join(sorted(map(str, section)))})")
        return None
    if isinstance(section, cls.config_cls):
        return section
    obj = cls.config_cls(**typed_fields(cls.config_cls, section, prefix))
    obj.validate(prefix)
    return obj


def config_dict(cfg) -> dict:
    return {} if cfg is None else dataclasses.asdict(cfg)


def build_codec(name: str, wire: str | None = "auto", cfg=None, mask_rate: float = 0.0, warmup_steps: int = 0,
                ramp_steps: int = 0, rescale: bool = False) -> Codec:
    """One end of a link of codec ``name`` (``cfg``: its config object or section dict)."""
    cls = get_codec(name)
    if cfg is None or isinstance(cfg, dict):
        cfg = codec_config(name, cfg)
    schedule = masks.MaskSchedule(mask_rate if cls.uses_mask else 0.0, warmup_steps, ramp_steps)
    return cls(wire_dtype=wire_dtype(wire), schedule=schedule, rescale=rescale, cfg=cfg)


def make_codec(tc) -> Codec:
    """One end of a boundary link as the ``twocircuit`` section ``tc`` (a ``TwoCircuitConfig``)
    configures it: the one place ``tc.mode`` is resolved."""
    return build_codec(tc.mode, tc.wire_dtype, tc.codec, tc.mask_rate, tc.warmup_steps, tc.ramp_steps, tc.rescale)
