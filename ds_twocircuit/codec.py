"""Boundary codecs: what of a (..., H) activation or gradient crosses a pipeline link.

A codec turns a dense tensor into a list of wire tensors (``pack``) and back (``unpack``), given
a :class:`Message` that both ends can build without talking: the key of the PRF mask, the shape,
and the number of kept channels. Three codecs:

* :class:`DenseCodec`   -- the whole tensor (stock DeepSpeed behaviour), optionally cast.
* :class:`RandomMaskCodec` -- only the K PRF-selected values per token; the receiver scatters
  them into zeros. Activations and gradients of one micro-batch use the same key, so the
  gradient crossing back has exactly the sparsity pattern of the forward mask (the product
  ``h * mask`` is in the graph).
* :class:`TopKCodec` -- the K largest-magnitude channels per token, values plus indices
  (ablation baseline). The gradient goes back on the indices the forward pass chose, so only
  values travel backwards.

Pure torch, no DeepSpeed: the engine adapter and the single-process reference share it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import masks

WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Message:
    key: int          # PRF key (seed, boundary, step, micro-batch, hidden)
    shape: tuple      # full tensor shape (..., H)
    keep: int         # kept channels per token (== H means dense)
    scale: float = 1.0  # 1/(1-p) when rescaling, else 1
    refresh: bool = False  # stateful codecs: this activation message carries new codec state
    train: bool = True     # a training message (stateful codecs measure only these)

    @property
    def hidden(self) -> int:
        return int(self.shape[-1])

    @property
    def tokens(self) -> int:
        n = 1
        for s in self.shape[:-1]:
            n *= int(s)
        return n


class DenseCodec:
    name = "dense"
    stateful = False

    def __init__(self, wire_dtype=None):
        self.wire_dtype = wire_dtype

    def _wire(self, dtype):
        return self.wire_dtype or dtype

    def pack_activation(self, x: torch.Tensor, msg: Message) -> list[torch.Tensor]:
        return [x.detach().to(self._wire(x.dtype)).contiguous()]

    def activation_buffers(self, msg: Message, dtype, device) -> list[torch.Tensor]:
        return [torch.empty(msg.shape, dtype=self._wire(dtype), device=device)]

    def unpack_activation(self, bufs, msg: Message, dtype) -> torch.Tensor:
        return bufs[0].to(dtype).view(msg.shape)

    def pack_gradient(self, g: torch.Tensor, msg: Message) -> list[torch.Tensor]:
        return self.pack_activation(g, msg)

    def gradient_buffers(self, msg: Message, dtype, device) -> list[torch.Tensor]:
        return self.activation_buffers(msg, dtype, device)

    def unpack_gradient(self, bufs, msg: Message, dtype) -> torch.Tensor:
        return self.unpack_activation(bufs, msg, dtype)

    def forget(self, msg: Message) -> None:
        pass

    def reset(self) -> None:
        """Drop per-step state (called at the start of every train/eval batch)."""


class RandomMaskCodec(DenseCodec):
    """Keeps the PRF-selected channels; indices are regenerated on both sides, never sent."""

    name = "random"

    def __init__(self, wire_dtype=None, cache_size: int = 64):
        super().__init__(wire_dtype)
        self._cache: dict = {}
        self._cache_size = cache_size

    def indices(self, msg: Message, device) -> torch.Tensor:
        ck = (msg.key, msg.tokens, msg.hidden, msg.keep, str(device))
        idx = self._cache.get(ck)
        if idx is None:
            idx = masks.kept_indices(msg.key, msg.tokens, msg.hidden, msg.keep, device=device)
            if len(self._cache) >= self._cache_size:
                self._cache.pop(next(iter(self._cache)))
            self._cache[ck] = idx
        return idx

    def forget(self, msg: Message) -> None:
        for ck in [c for c in self._cache if c[0] == msg.key]:
            del self._cache[ck]

    def reset(self) -> None:
        self._cache.clear()

    def _pack(self, x: torch.Tensor, msg: Message) -> list[torch.Tensor]:
        if msg.keep >= msg.hidden:
            return DenseCodec.pack_activation(self, x * msg.scale if msg.scale != 1.0 else x, msg)
        flat = x.detach().reshape(msg.tokens, msg.hidden)
        vals = flat.gather(1, self.indices(msg, x.device))
        if msg.scale != 1.0:
            vals = vals * msg.scale
        return [vals.to(self._wire(x.dtype)).contiguous()]

    def _buffers(self, msg: Message, dtype, device) -> list[torch.Tensor]:
        if msg.keep >= msg.hidden:
            return DenseCodec.activation_buffers(self, msg, dtype, device)
        return [torch.empty(msg.tokens, msg.keep, dtype=self._wire(dtype), device=device)]

    def _unpack(self, bufs, msg: Message, dtype) -> torch.Tensor:
        if msg.keep >= msg.hidden:
            return DenseCodec.unpack_activation(self, bufs, msg, dtype)
        out = torch.zeros(msg.tokens, msg.hidden, dtype=dtype, device=bufs[0].device)
        out.scatter_(1, self.indices(msg, bufs[0].device), bufs[0].to(dtype))
        return out.view(msg.shape)

    pack_activation = pack_gradient = _pack
    activation_buffers = gradient_buffers = _buffers
    unpack_activation = unpack_gradient = _unpack


class TopKCodec(DenseCodec):
    """K largest-|x| channels per token: values and indices forward, values backward.

    The sender keeps the indices it chose for each micro-batch until the gradient of that
    micro-batch returns (messages on a link are FIFO); the receiver keeps the ones it got."""

    name = "topk"

    def __init__(self, wire_dtype=None):
        super().__init__(wire_dtype)
        self._indices: dict[int, torch.Tensor] = {}

    # NCCL has no int16: indices travel as their int16 (or int32) bytes, bit-cast to uint8 (the same
    # bytes on the wire; every NCCL build has uint8).
    NCCL_DTYPES = (torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
                   torch.float32, torch.float64)

    @staticmethod
    def index_dtype(hidden: int):
        return torch.int16 if hidden <= 32767 else torch.int32

    @staticmethod
    def _index_width(hidden: int) -> int:
        return 2 if hidden <= 32767 else 4

    def pack_activation(self, x, msg):
        flat = x.detach().reshape(msg.tokens, msg.hidden)
        idx = torch.sort(flat.abs().topk(msg.keep, dim=1, sorted=False).indices, dim=1).values
        self._indices[msg.key] = idx
        vals = flat.gather(1, idx)
        if msg.scale != 1.0:
            vals = vals * msg.scale
        wire_idx = idx.to(self.index_dtype(msg.hidden)).contiguous().view(torch.uint8)
        return [vals.to(self._wire(x.dtype)).contiguous(), wire_idx]

    def activation_buffers(self, msg, dtype, device):
        return [torch.empty(msg.tokens, msg.keep, dtype=self._wire(dtype), device=device),
                torch.empty(msg.tokens, msg.keep * self._index_width(msg.hidden), dtype=torch.uint8, device=device)]

    def unpack_activation(self, bufs, msg, dtype):
        idx = bufs[1].view(self.index_dtype(msg.hidden)).long()
        self._indices[msg.key] = idx
        out = torch.zeros(msg.tokens, msg.hidden, dtype=dtype, device=bufs[0].device)
        out.scatter_(1, idx, bufs[0].to(dtype))
        return out.view(msg.shape)

    def pack_gradient(self, g, msg):
        idx = self._indices.pop(msg.key)
        vals = g.detach().reshape(msg.tokens, msg.hidden).gather(1, idx)
        if msg.scale != 1.0:
            vals = vals * msg.scale
        return [vals.to(self._wire(g.dtype)).contiguous()]

    def gradient_buffers(self, msg, dtype, device):
        return [torch.empty(msg.tokens, msg.keep, dtype=self._wire(dtype), device=device)]

    def unpack_gradient(self, bufs, msg, dtype):
        idx = self._indices.pop(msg.key)
        out = torch.zeros(msg.tokens, msg.hidden, dtype=dtype, device=bufs[0].device)
        out.scatter_(1, idx, bufs[0].to(dtype))
        return out.view(msg.shape)

    def forget(self, msg):
        self._indices.pop(msg.key, None)

    def reset(self):
        self._indices.clear()


CODECS = {"dense": DenseCodec, "random": RandomMaskCodec, "topk": TopKCodec}
STATEFUL = ("meanfill", "lowrank")


def make_codec(mode: str, wire_dtype: str | None, codec_cfg=None):
    """``codec_cfg``: the ``twocircuit.codec`` section (groups, refresh schedule) for the stateful
    codecs ``meanfill`` and ``lowrank`` (``statecodecs.py``)."""
    dt = None if wire_dtype in (None, "auto") else WIRE_DTYPES[wire_dtype]
    if mode in STATEFUL:
        from .statecodecs import LowRankCodec, MeanFillCodec, RefreshSchedule
        refresh = RefreshSchedule(getattr(codec_cfg, "refresh_steps", (0,)), getattr(codec_cfg, "refresh_every", 0))
        if mode == "meanfill":
            return MeanFillCodec(wire_dtype=dt, refresh=refresh)
        return LowRankCodec(wire_dtype=dt, groups=getattr(codec_cfg, "groups", ((16, 8), (184, 4))), refresh=refresh,
                            coef_norm=getattr(codec_cfg, "coef_norm", "none"))
    return CODECS[mode](wire_dtype=dt)
