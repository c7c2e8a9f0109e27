"""Codec round trips and wire sizes for dense, random-mask and Top-K boundaries."""
import pytest
import torch

from ds_twocircuit import masks
from ds_twocircuit.codecs import Message, build_codec
from ds_twocircuit.codecs.dense import DenseCodec
from ds_twocircuit.codecs.mask import RandomMaskCodec, TopKCodec


def _msg(shape, keep, key=99, scale=1.0):
    return Message(key=key, shape=tuple(shape), keep=keep, scale=scale)


def test_random_roundtrip_equals_product_with_prf_mask():
    x = torch.randn(2, 5, 64)
    msg = _msg(x.shape, 6, key=masks.mask_key(1, 0, 4, 2, 64))
    tx, rx = RandomMaskCodec(), RandomMaskCodec()
    wire = tx.pack_activation(x, msg)
    assert [tuple(t.shape) for t in wire] == [(10, 6)]      # values only, no indices
    bufs = rx.activation_buffers(msg, x.dtype, "cpu")
    for b, t in zip(bufs, wire):
        b.copy_(t)
    y = rx.unpack_activation(bufs, msg, x.dtype)
    m = masks.boundary_mask(msg.key, x.shape, 6)
    assert torch.equal(y, x * m)
    # the gradient goes back on the same pattern
    g = torch.randn_like(x)
    gw = rx.pack_gradient(g, msg)
    gb = tx.gradient_buffers(msg, x.dtype, "cpu")
    gb[0].copy_(gw[0])
    assert torch.equal(tx.unpack_gradient(gb, msg, x.dtype), g * m)


def test_random_wire_bytes_fp32_and_bf16():
    x = torch.randn(4, 128, 576)
    keep = masks.kept_count(576, 0.95)
    msg = _msg(x.shape, keep)
    for dt, size in (("fp32", 4), ("bf16", 2), ("auto", 4)):
        wire = build_codec("random", dt).pack_activation(x, msg)
        assert sum(t.numel() * t.element_size() for t in wire) == 4 * 128 * keep * size
    dense = build_codec("dense", "fp32").pack_activation(x, _msg(x.shape, 576))
    assert sum(t.numel() * t.element_size() for t in dense) == x.numel() * 4


def test_bf16_wire_rounds_values():
    x = torch.randn(3, 16) * 1.001
    msg = _msg(x.shape, 16)
    c = build_codec("dense", "bf16")
    w = c.pack_activation(x, msg)
    assert w[0].dtype == torch.bfloat16
    y = c.unpack_activation(w, msg, torch.float32)
    assert y.dtype == torch.float32 and torch.equal(y, x.to(torch.bfloat16).float())


def test_rescale_multiplies_kept_values():
    x = torch.randn(2, 3, 20)
    msg = _msg(x.shape, 5, scale=4.0)
    c = RandomMaskCodec()
    y = c.unpack_activation(c.pack_activation(x, msg), msg, x.dtype)
    m = masks.boundary_mask(msg.key, x.shape, 5)
    assert torch.allclose(y, 4.0 * x * m)


def test_topk_sends_largest_values_and_indices_and_grads_follow():
    x = torch.randn(3, 4, 32)
    msg = _msg(x.shape, 3, key=7)
    tx, rx = TopKCodec(), TopKCodec()
    wire = tx.pack_activation(x, msg)
    # int16 indices as their bytes in uint8 (NCCL has no int16); every wire dtype is an NCCL one
    assert wire[1].dtype == torch.uint8 and wire[1].shape == (12, 6) and wire[0].shape == (12, 3)
    assert all(t.dtype in TopKCodec.NCCL_DTYPES for t in wire)
    assert torch.equal(wire[1].view(torch.int16).long().sort(1).values, wire[1].view(torch.int16).long())
    y = rx.unpack_activation([t.clone() for t in wire], msg, x.dtype)
    flat = x.reshape(12, 32)
    top = flat.abs().topk(3, dim=1).indices
    expect = torch.zeros_like(flat).scatter_(1, top, flat.gather(1, top))
    assert torch.equal(y.reshape(12, 32), expect)
    g = torch.randn_like(x)
    gw = rx.pack_gradient(g, msg)
    assert len(gw) == 1 and gw[0].shape == (12, 3)          # values only backwards
    back = tx.unpack_gradient([gw[0].clone()], msg, x.dtype)
    mask = (expect != 0).float()
    assert torch.equal(back.reshape(12, 32), g.reshape(12, 32) * mask)


def test_dense_is_identity():
    x = torch.randn(2, 3, 8)
    msg = _msg(x.shape, 8)
    c = DenseCodec()
    assert torch.equal(c.unpack_activation(c.pack_activation(x, msg), msg, x.dtype), x)


def test_unknown_codec_name():
    with pytest.raises(ValueError, match="unknown twocircuit.mode 'bogus'; allowed: random, topk, dense"):
        build_codec("bogus", "fp32")
