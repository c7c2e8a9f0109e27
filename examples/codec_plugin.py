"""A new boundary codec in one file: ``int8``, each token's activation (and gradient) as int8 values
with one bf16 scale per token (H + 2 bytes instead of 4 H in fp32).

Use it from any config by naming this module as a plugin (imported on every rank before the config
is validated) and the codec as the mode::

    "twocircuit": {"plugins": ["examples.codec_plugin"], "mode": "int8", ...}

(``examples.codec_plugin`` is importable when the checkout is on ``PYTHONPATH``; a package of your
own works the same). Nothing else changes: both engines, the byte meter, checkpoints and the
conformance tests (``tests/test_codec_conformance.py``) take it from the registry.
"""
from __future__ import annotations

import torch

from ds_twocircuit.codecs import Codec, register_codec

SCALE = torch.bfloat16


@register_codec("int8")
class Int8Codec(Codec):
    """Symmetric per-token int8: ``q = round(x / s)``, ``s = max|x| / 127`` rounded to bf16 (both ends
    use the same scale); the gradient goes back the same way (straight through)."""

    def payload_bytes(self, hidden, element_bytes, step=None):
        return hidden + 2, hidden + 2

    def _pack(self, x: torch.Tensor, msg) -> list[torch.Tensor]:
        flat = x.detach().reshape(msg.tokens, msg.hidden).float()
        s = (flat.abs().amax(1, keepdim=True) / 127.0).to(SCALE)
        sf = s.float()
        q = torch.round(flat / torch.where(sf > 0, sf, torch.ones_like(sf))).clamp_(-127, 127).to(torch.int8)
        return [q.contiguous(), s.contiguous()]

    def _buffers(self, msg, dtype, device) -> list[torch.Tensor]:
        return [torch.empty(msg.tokens, msg.hidden, dtype=torch.int8, device=device),
                torch.empty(msg.tokens, 1, dtype=SCALE, device=device)]

    def _unpack(self, bufs, msg, dtype) -> torch.Tensor:
        return (bufs[0].float() * bufs[1].float()).to(dtype).view(msg.shape)

    pack_activation = pack_gradient = _pack
    activation_buffers = gradient_buffers = _buffers
    unpack_activation = unpack_gradient = _unpack
