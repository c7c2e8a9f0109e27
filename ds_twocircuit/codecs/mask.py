"""Channel-selection codecs: each token keeps ``K = round((1 - p) H)`` of its H channels.

* ``random`` (:class:`RandomMaskCodec`, the paper's method) -- only the K PRF-selected values per
  token; the receiver scatters them into zeros. Activations and gradients of one micro-batch use the
  same key, so the gradient crossing back has exactly the sparsity pattern of the forward mask (the
  product ``h * mask`` is in the graph). No indices cross the wire.
* ``topk`` (:class:`TopKCodec`, an ablation baseline) -- the K largest-magnitude channels per token,
  values plus indices. The gradient goes back on the indices the forward pass chose, so only values
  travel backwards.
"""
from __future__ import annotations

import torch

from .. import masks
from ..configkit import ConfigError
from .base import Codec, Message, register_codec
from .dense import DenseCodec


@register_codec("random")
class RandomMaskCodec(Codec):
    """Keeps the PRF-selected channels; indices are regenerated on both sides, never sent."""

    uses_mask = True

    def __init__(self, wire_dtype=None, schedule=None, rescale=False, cfg=None, cache_size: int = 64):
        super().__init__(wire_dtype, schedule, rescale, cfg)
        self._cache: dict = {}
        self._cache_size = cache_size

    def payload_bytes(self, hidden, element_bytes, step=None):
        n = self._keep_after(hidden, step) * self._element_bytes(element_bytes)
        return n, n

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


@register_codec("topk")
class TopKCodec(Codec):
    """K largest-|x| channels per token: values and indices forward, values backward.

    The sender keeps the indices it chose for each micro-batch until the gradient of that
    micro-batch returns (messages on a link are FIFO); the receiver keeps the ones it got."""

    uses_mask = True

    def __init__(self, wire_dtype=None, schedule=None, rescale=False, cfg=None):
        super().__init__(wire_dtype, schedule, rescale, cfg)
        self._indices: dict[int, torch.Tensor] = {}

    # NCCL has no int16: indices travel as their int16 (or int32) bytes, bit-cast to uint8 (the same
    # bytes on the wire; every NCCL build has uint8).
    NCCL_DTYPES = (torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
                   torch.float32, torch.float64)

    @classmethod
    def check_config(cls, tc, prefix):
        super().check_config(tc, prefix)
        if tc.mask_rate == 0.0:
            raise ConfigError(f"{prefix}.mask_rate must be > 0 with {prefix}.mode = 'topk'")

    def payload_bytes(self, hidden, element_bytes, step=None):
        keep = self._keep_after(hidden, step)
        vals = keep * self._element_bytes(element_bytes)
        return vals + keep * self._index_width(hidden), vals

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
