"""``dense``: the whole tensor, optionally cast to the wire dtype (stock DeepSpeed behaviour)."""
from __future__ import annotations

import torch

from .base import DENSE, Codec, Message, register_codec


@register_codec(DENSE)
class DenseCodec(Codec):

    @property
    def identity(self) -> bool:
        return True

    def payload_bytes(self, hidden, element_bytes, step=None):
        n = hidden * self._element_bytes(element_bytes)
        return n, n

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
