"""Stateful boundary codecs (meanfill, lowrank): quantisation, state protocol, exact gradients,
byte counts, config errors, checkpoint state. Pure torch, single process."""
import copy
import re

import pytest
import torch

from ds_twocircuit.codecs import Message, build_codec
from ds_twocircuit.codecs.lowrank import LowRankCodec, LowRankConfig, principal_basis
from ds_twocircuit.codecs.meanfill import MeanFillCodec
from ds_twocircuit.codecs.quant import dequantize_groups, group_bytes, quantize_groups
from ds_twocircuit.codecs.stateful import RefreshSchedule, RunningMoments
from ds_twocircuit.config import ConfigError, TwoCircuitConfig
from ds_twocircuit.reference import _CodecLink


def _lowrank(groups=((16, 8), (184, 4)), refresh=(0,), coef_norm="none"):
    return build_codec("lowrank", cfg={"groups": [list(g) for g in groups], "refresh_steps": list(refresh),
                                       "coef_norm": coef_norm})


def _meanfill(refresh=(0,)):
    return build_codec("meanfill", cfg={"refresh_steps": list(refresh)})


def _msg(shape, key=1, keep=None, refresh=False, train=True):
    return Message(key=key, shape=tuple(shape), keep=keep or shape[-1], refresh=refresh, train=train)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_group_quantisation_error_and_bytes(bits):
    torch.manual_seed(0)
    c = torch.randn(33, 48) * torch.logspace(1, -2, 48)
    packed, scales = quantize_groups(c, [(48, bits)])
    assert packed.dtype == torch.uint8 and packed.shape == (33, 48 * bits // 8)
    assert scales.dtype == torch.bfloat16 and scales.shape == (33, 1)
    d = dequantize_groups(packed, scales, [(48, bits)])
    lim = (1 << (bits - 1)) - 1
    # round to nearest with the bf16 scale: at most half a step, plus the clip of the max element
    # when bf16 rounded the scale down (at most 2^-8 relative)
    step = scales.float()
    assert torch.all((d - c).abs() <= step / 2 + c.abs().amax(1, keepdim=True) * 2 ** -8 + 1e-7)
    assert torch.all(d.abs() <= lim * step + 1e-6)


def test_three_bit_packing_is_eight_codes_in_three_bytes():
    """3 bits (the DP sync's quant): codes 0..6 packed little-endian, 8 a 3-byte unit, and back."""
    from ds_twocircuit.codecs.quant import _pack, _unpack
    u = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 7, 0, 0, 0, 0, 0, 0, 1]], dtype=torch.int32)
    p = _pack(u, 3)
    word = sum(int(v) << (3 * i) for i, v in enumerate(u[0, :8]))
    assert p.shape == (1, 6) and p[0, :3].tolist() == [word & 255, (word >> 8) & 255, word >> 16]
    assert p[0, 3:].tolist() == [7, 0, 32]   # 7 in bits 0-2, then 1 in bits 21-23 (byte 2, bit 5)
    assert torch.equal(_unpack(p, 16, 3), u.long())
    g = torch.Generator().manual_seed(0)
    r = torch.randint(0, 8, (5, 64), generator=g, dtype=torch.int32)
    assert torch.equal(_unpack(_pack(r, 3), 64, 3), r.long())


def test_groups_bytes_and_zero_rows():
    g = [(16, 8), (184, 4)]
    assert group_bytes(g) == 16 + 92 + 4
    c = torch.zeros(5, 200)
    c[1] = torch.arange(200.0)
    p, s = quantize_groups(c, g)
    assert p.shape == (5, 108)
    d = dequantize_groups(p, s, g)
    assert torch.equal(d[0], torch.zeros(200)) and torch.isfinite(d).all()
    assert (d[1] - c[1]).abs().max() <= s[1].float().max() / 2 + 1


def test_principal_basis_orthonormal_and_deterministic_sign():
    torch.manual_seed(1)
    a = torch.randn(200, 30, dtype=torch.float64)
    cov = a.T @ a
    u = principal_basis(cov, 5)
    assert torch.allclose(u.T @ u, torch.eye(5, dtype=torch.float64), atol=1e-10)
    assert torch.all(u.abs().argmax(0).eq(u.argmax(0)))  # largest entry of each column is positive
    ev = torch.linalg.eigvalsh(cov).flip(0)[:5]
    assert torch.allclose(torch.diag(u.T @ cov @ u), ev, rtol=1e-9)


def test_refresh_schedule():
    r = RefreshSchedule([0, 1, 3], every=10)
    assert [s for s in range(40) if r.due(s)] == [0, 1, 3, 13, 23, 33]
    assert [s for s in range(40) if RefreshSchedule([2]).due(s)] == [2]
    # next_after: the first due step strictly after, for every step (checked against due), or None
    for sched in (r, RefreshSchedule([2]), RefreshSchedule([5, 7], every=4)):
        for st in range(60):
            later = [s for s in range(st + 1, 200) if sched.due(s)]
            assert sched.next_after(st) == (later[0] if later else None), (sched.steps, st)
    assert r.next_after(3) == 13 and r.next_after(13) == 23 and RefreshSchedule([2]).next_after(2) is None


def _pair(groups=((8, 8), (16, 4)), refresh=(0, 2)):
    return _lowrank(groups, refresh), _lowrank(groups, refresh)


def test_lowrank_state_protocol_and_reconstruction():
    torch.manual_seed(2)
    H, T = 64, 40
    basis = torch.linalg.qr(torch.randn(H, 24))[0]
    send, recv = _pair(groups=((24, 8),))
    x = 5.0 + torch.randn(T, 24) @ basis.T  # a mean plus a rank-24 signal
    msg = _msg((T, H), refresh=True)
    assert send.state_tensor_count(msg) == recv.state_tensor_count(msg) == 2
    bufs = send.pack_activation(x, msg)
    assert [b.shape for b in bufs] == [(H,), (H, 24), (T, 24), (T, 1)]
    assert send.state_bytes_sent == 2 * (H + H * 24)
    y = recv.unpack_activation([b.clone() for b in bufs], msg, torch.float32)
    assert torch.equal(send.basis, recv.basis) and torch.equal(send.mean, recv.mean)
    # int8 coefficients and a bf16 basis: ~1% of the signal
    assert (y - x).norm() / (x - x.mean(0)).norm() < 0.02
    # the next message of the step carries no state, on both ends
    msg2 = _msg((T, H), key=2)
    assert send.state_tensor_count(msg2) == recv.state_tensor_count(msg2) == 0
    bufs2 = send.pack_activation(x, msg2)
    assert len(bufs2) == 2 and sum(b.numel() * b.element_size() for b in bufs2) == T * group_bytes([(24, 8)])


def test_lowrank_three_bit_coefficients_cross_in_three_eighths_of_a_byte_each():
    """groups [[24, 3]]: 8 coefficients in 3 bytes plus the bf16 scale, decoded by the receiver
    with an error between the 2-bit and the 4-bit layouts' on the same signal."""
    torch.manual_seed(2)
    H, T = 64, 40
    basis = torch.linalg.qr(torch.randn(H, 24))[0]
    x = 5.0 + torch.randn(T, 24) @ basis.T
    err = {}
    for bits in (2, 3, 4):
        send, recv = _pair(groups=((24, bits),))
        bufs = send.pack_activation(x, _msg((T, H), refresh=True))
        assert [tuple(b.shape) for b in bufs[-2:]] == [(T, 24 * bits // 8), (T, 1)]
        y = recv.unpack_activation([b.clone() for b in bufs], _msg((T, H), refresh=True), torch.float32)
        err[bits] = float((y - x).norm() / (x - x.mean(0)).norm())
        bufs2 = send.pack_activation(x, _msg((T, H), key=2))
        assert sum(b.numel() * b.element_size() for b in bufs2) == T * group_bytes([(24, bits)])
    assert group_bytes([(24, 3)]) == 9 + 2
    # round to nearest at step max|c| / 3: about step / sqrt(12) of the signal, 0.21-0.25 here
    assert err[4] < err[3] < err[2] and 0.15 < err[3] < 0.3


def test_lowrank_first_state_even_without_refresh_and_eval_does_not_measure():
    send, recv = _pair()
    x = torch.randn(16, 64)
    m = _msg((16, 64), refresh=False, train=False)  # evaluation before any training step
    assert send.carries_state(m)
    recv.unpack_activation(send.pack_activation(x, m), m, torch.float32)
    assert send.moments.n == 0 and recv.has_state and send.has_state
    m2 = _msg((16, 64), key=3, refresh=False, train=True)
    assert not send.carries_state(m2)
    recv.unpack_activation(send.pack_activation(x, m2), m2, torch.float32)
    assert send.moments.n == 16


def test_lowrank_gradient_is_exact_for_the_coded_graph():
    """The sender's input gradient equals the gradient of mean + deq(q(c)) U^T with the
    straight-through coefficients: deq(q(g U)) U^T, as both ends compute it."""
    torch.manual_seed(3)
    H, T = 64, 20
    send, recv = _pair(groups=((24, 8),))
    x = torch.randn(T, H, requires_grad=True)
    msg = _msg((T, H), refresh=True)
    y = _CodecLink.apply(x, (send, recv), msg)
    w = torch.randn(T, H)
    (y * w).sum().backward()
    U = send.basis
    p, s = quantize_groups(w @ U, [(24, 8)])
    expect = dequantize_groups(p, s, [(24, 8)]) @ U.T
    assert torch.equal(x.grad, expect)
    # and it is the projected dense gradient up to the int8 rounding
    proj = (w @ U) @ U.T
    assert torch.nn.functional.cosine_similarity(x.grad.flatten(), proj.flatten(), dim=0) > 0.999


def test_lowrank_coef_norm_ships_scales_and_flattens_the_bit_allocation():
    """coef_norm = sqrt_std: r more bf16 values of state (lambda_i ** 0.25 of each direction, the
    same on both ends); one 4-bit group then keeps the small directions that a plain 4-bit group
    rounds to zero, and the gradient is the same straight-through projection as without it."""
    torch.manual_seed(6)
    H, T, r = 64, 400, 32
    q = torch.linalg.qr(torch.randn(H, H))[0]
    x = (torch.randn(T, H) * torch.logspace(1, -1.5, H)) @ q.T + 3.0  # a decaying spectrum
    errs = {}
    for norm in ("none", "sqrt_std"):
        send, recv = (_lowrank(((r, 4),), (0,), norm) for _ in range(2))
        msg = _msg((T, H), refresh=True)
        n = 3 if norm == "sqrt_std" else 2
        assert send.state_tensor_count(msg) == recv.state_tensor_count(msg) == n
        bufs = send.pack_activation(x, msg)
        assert len(bufs) == n + 2
        assert send.state_bytes_sent == 2 * (H + H * r + (r if norm == "sqrt_std" else 0))
        y = recv.unpack_activation([b.clone() for b in bufs], msg, torch.float32)
        errs[norm] = float((y - x).norm() / (x - x.mean(0)).norm())
        if norm == "sqrt_std":
            assert torch.equal(send.coef_scale, recv.coef_scale) and send.coef_scale.shape == (r,)
            lam = torch.linalg.eigvalsh(torch.cov(x.T.double(), correction=0)).flip(0)[:r]
            assert torch.allclose(send.coef_scale.double(), lam.pow(0.25), rtol=2e-2)
            # exact straight-through gradient, unchanged by the scales
            xx = x.clone().requires_grad_()
            m2 = _msg((T, H), key=7)
            w = torch.randn(T, H)
            (_CodecLink.apply(xx, (send, recv), m2) * w).sum().backward()
            p, s = quantize_groups(w @ send.basis, [(r, 4)])
            assert torch.equal(xx.grad, dequantize_groups(p, s, [(r, 4)]) @ send.basis.T)
            # and the scales survive a checkpoint
            send2 = _lowrank(((r, 4),), (0,), norm)
            send2.load_state_dict(send.state_dict())
            m3 = _msg((T, H), key=8)
            assert all(torch.equal(a, b) for a, b in zip(send.pack_activation(x, m3), send2.pack_activation(x, m3)))
    assert errs["sqrt_std"] < 0.8 * errs["none"], errs


def test_meanfill_fills_dropped_channels_with_the_senders_mean():
    torch.manual_seed(4)
    H, T, keep = 32, 10, 4
    send = _meanfill([0])
    recv = _meanfill([0])
    x = torch.randn(T, H) + torch.arange(H, dtype=torch.float32)
    msg = _msg((T, H), keep=keep, refresh=True)
    bufs = send.pack_activation(x, msg)
    assert len(bufs) == 2 and bufs[0].shape == (H,) and bufs[1].shape == (T, keep)
    assert send.state_bytes_sent == H * 4
    y = recv.unpack_activation([b.clone() for b in bufs], msg, torch.float32)
    idx = send.indices(msg, "cpu")
    kept = torch.zeros(T, H, dtype=torch.bool).scatter_(1, idx, True)
    assert torch.equal(y[kept], x[kept])
    assert torch.allclose(y[~kept], x.mean(0).expand(T, H)[~kept])
    # gradient: the fill is a constant, only kept positions carry gradient
    xx = x.clone().requires_grad_()
    m2 = _msg((T, H), key=9, keep=keep)
    out = _CodecLink.apply(xx, (send, recv), m2)
    g = torch.randn(T, H)
    (out * g).sum().backward()
    kept2 = torch.zeros(T, H, dtype=torch.bool).scatter_(1, send.indices(m2, "cpu"), True)
    assert torch.equal(xx.grad[kept2], g[kept2]) and torch.all(xx.grad[~kept2] == 0)


def test_running_moments_match_torch():
    torch.manual_seed(5)
    m = RunningMoments(True)
    a, b = torch.randn(30, 6), torch.randn(50, 6) + 2
    m.add(a)
    m.add(b)
    both = torch.cat([a, b]).double()
    assert torch.allclose(m.mean(), both.mean(0))
    assert torch.allclose(m.covariance(), torch.cov(both.T, correction=0), atol=1e-10)


def test_codec_state_round_trips_through_state_dict():
    send, recv = _pair()
    x = torch.randn(16, 64)
    m = _msg((16, 64), refresh=True)
    recv.unpack_activation(send.pack_activation(x, m), m, torch.float32)
    send2 = _lowrank(((8, 8), (16, 4)), (0, 2))
    send2.load_state_dict(send.state_dict())
    m2 = _msg((16, 64), key=5)
    assert all(torch.equal(a, b) for a, b in zip(send.pack_activation(x, m2), send2.pack_activation(x, m2)))


def test_make_codec_reads_the_codec_section():
    from ds_twocircuit.codecs import make_codec
    tc = TwoCircuitConfig.from_dict({"mode": "lowrank", "codec": {"groups": [[8, 8], [8, 2]], "refresh_steps": [0],
                                                                "refresh_every": 5}})
    c = make_codec(tc)
    assert isinstance(c, LowRankCodec) and c.rank == 16 and c.bytes_per_token() == 8 + 2 + 4
    assert c.refresh.due(10) and not c.refresh.due(7)
    assert c.coef_norm == "none"
    assert build_codec("lowrank", cfg=LowRankConfig(coef_norm="sqrt_std")).coef_norm == "sqrt_std"
    assert isinstance(build_codec("meanfill", "fp32"), MeanFillCodec)
    # the section belongs to the codec: another codec's key is refused, naming it
    with pytest.raises(ConfigError, match="unknown key twocircuit.codec.groups"):
        TwoCircuitConfig.from_dict({"mode": "meanfill", "codec": {"groups": [[8, 8]]}})
    with pytest.raises(ConfigError, match="twocircuit.codec is not used by twocircuit.mode = 'random'"):
        TwoCircuitConfig.from_dict({"mode": "random", "codec": {"refresh_steps": [0]}})


@pytest.mark.parametrize("section,needle", [
    ({"mode": "lowrank", "codec": {"groups": [[10, 5]]}}, "twocircuit.codec.groups: bits = 5 in [10, 5]; allowed: 2, 3, 4, 8"),
    ({"mode": "lowrank", "codec": {"groups": [[12, 3]]}}, "count 12 in [12, 3] must be a positive multiple of 8"),
    ({"mode": "lowrank", "codec": {"groups": [[3, 4]]}}, "positive multiple of 2"),
    ({"mode": "lowrank", "codec": {"groups": []}}, "twocircuit.codec.groups must be a non-empty list"),
    ({"mode": "lowrank", "codec": {"refresh_steps": []}}, "twocircuit.codec.refresh_steps"),
    ({"mode": "lowrank", "codec": {"refresh_every": -1}}, "twocircuit.codec.refresh_every"),
    ({"mode": "lowrank", "codec": {"basis": 3}}, "unknown key twocircuit.codec.basis"),
    ({"mode": "lowrank", "codec": {"coef_norm": "std"}}, "twocircuit.codec.coef_norm"),
    ({"mode": "lowrank", "ramp_steps": 10}, "do not apply to twocircuit.mode = 'lowrank'"),
    ({"mode": "pca"}, "allowed: random, topk, dense, meanfill, lowrank"),
])
def test_codec_config_errors_name_the_key(section, needle):
    with pytest.raises(ConfigError, match=None) as e:
        TwoCircuitConfig.from_dict(section)
    assert needle in str(e.value)


def _screen_module():
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch", "screen_quality.py")
    spec = importlib.util.spec_from_file_location("screen_quality", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_screen_reads_a_config_file_with_overrides():
    """screen_quality takes the shipped configs (and --set overrides), not codec spec strings."""
    mod = _screen_module()
    label, path, tc = mod.load_twocircuit("lowrank", ["twocircuit.codec.groups=[[112,4]]"])
    assert path.endswith("ds_configs/lowrank.json") and label == "lowrank twocircuit.codec.groups=[[112,4]]"
    assert tc.codec.groups == [[112, 4]] and tc.codec.coef_norm == "sqrt_std"   # the rest from the file
    with pytest.raises(ConfigError, match="twocircuit.codec.coef_norm"):
        mod.load_twocircuit("lowrank", ["twocircuit.codec.coef_norm=std"])


def test_screen_paired_cosines_recover_a_systematic_error_and_not_a_batch_specific_one():
    mod = _screen_module()
    gen = torch.Generator().manual_seed(0)
    bias = {"a": torch.randn(6, 5, generator=gen), "b": torch.randn(4, 3, generator=gen)}

    dense = [{n: torch.randn(t.shape, generator=gen) for n, t in bias.items()} for _ in range(5)]
    # a purely systematic codec error: G = D - bias on every batch; replaying it restores D exactly
    sysg = [{n: d[n] - bias[n] for n in d} for d in dense]
    out = mod.paired_cosines(list(zip(sysg[:2], dense[:2])), list(zip(sysg[2:], dense[2:])), [0.0, 0.5, 1.0])
    for n in bias:
        assert out[1.0][n] == pytest.approx(1.0, abs=1e-6)
        assert out[0.0][n] < out[0.5][n] < out[1.0][n]
    # a purely batch-specific error: the error of other batches is noise on the target
    noisy = [{n: d[n] + torch.randn(d[n].shape, generator=gen) * 3 for n in d} for d in dense]
    out = mod.paired_cosines(list(zip(noisy[:2], dense[:2])), list(zip(noisy[2:], dense[2:])), [0.0, 1.0])
    assert sum(out[1.0].values()) < sum(out[0.0].values())
    # the same by hand for one target and lambda 1
    c = {n: dense[0][n] - noisy[0][n] for n in bias}
    want = float(torch.nn.functional.cosine_similarity((noisy[2]["a"] + c["a"]).flatten(), dense[2]["a"].flatten(),
                                                       dim=0))
    got = mod.paired_cosines([(noisy[0], dense[0])], [(noisy[2], dense[2])], [1.0])[1.0]["a"]
    assert got == pytest.approx(want, rel=1e-6)


def test_screen_clip_global_is_torchs_rule():
    mod = _screen_module()
    g = {"a": torch.full((3, 4), 2.0), "b": torch.full((2,), -1.0)}
    norm = float(torch.sqrt(sum((t ** 2).sum() for t in g.values())))  # sqrt(48 + 2)
    clipped = mod.clip_global(g, 1.0)
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in g.values()]
    for p, t in zip(params, g.values()):
        p.grad = t.clone()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    for p, t in zip(params, clipped.values()):
        assert torch.allclose(p.grad, t, rtol=1e-5)
    assert mod.clip_global(g, 0.0) is g and mod.clip_global(g, norm * 2) is g


def _ref_pair(groups=((8, 4),), grad_groups=((16, 4),), refresh=(0,)):
    cfg = {"groups": [list(g) for g in groups], "grad_groups": [list(g) for g in grad_groups],
           "refresh_steps": list(refresh), "reference": "base"}
    return build_codec("lowrank", cfg=cfg), build_codec("lowrank", cfg=cfg)


def test_lowrank_reference_codes_the_drift_from_the_base_activation_and_ships_a_gradient_basis():
    """reference = base: only x - ref is coded (on the drift's own basis), both ends add ref back; the
    gradient goes back on the activations' principal basis (grad_groups), shipped as counted state."""
    torch.manual_seed(11)
    H, T = 64, 300
    q = torch.linalg.qr(torch.randn(H, H))[0]
    ref = (torch.randn(T, H) * torch.logspace(0.5, -1, H)) @ q.T + 2.0      # full rank, decaying spectrum
    drift = 0.1 * torch.randn(T, 4) @ torch.linalg.qr(torch.randn(H, 4))[0].T
    x = ref + drift
    send, recv = _ref_pair()
    assert send.needs_reference and send.payload_bytes(H, 4) == (4 + 2, 8 + 2)
    msg = _msg((T, H), refresh=True)
    assert send.state_tensor_count(msg) == recv.state_tensor_count(msg) == 3   # mean, basis, grad basis
    bufs = send.pack_activation(x, msg, ref=ref)
    assert [tuple(b.shape) for b in bufs] == [(H,), (H, 8), (H, 16), (T, 4), (T, 1)]
    assert send.state_bytes_sent == 2 * (H + H * 8 + H * 16)
    y = recv.unpack_activation([b.clone() for b in bufs], msg, torch.float32, ref=ref)
    err = float((y - x).norm() / (x - x.mean(0)).norm())
    plain_s, plain_r = _lowrank(((8, 4),)), _lowrank(((8, 4),))
    yp = plain_r.unpack_activation(plain_s.pack_activation(x, msg), msg, torch.float32)
    err_plain = float((yp - x).norm() / (x - x.mean(0)).norm())
    assert err < 0.01 and err_plain > 0.3, (err, err_plain)
    # the gradient's basis: the activations' own leading directions (bf16), the same on both ends
    assert torch.equal(send.grad_basis, recv.grad_basis) and send.grad_basis.shape == (H, 16)
    top = principal_basis(torch.cov(x.T.double(), correction=0), 16).float()
    assert torch.allclose(send.grad_basis, top, atol=2e-2)
    # exact straight-through gradient on that basis, at grad_groups' bytes
    xx = x.clone().requires_grad_()
    m2 = _msg((T, H), key=5)
    w = torch.randn(T, H)
    (_CodecLink.apply(xx, (send, recv), m2, True, ref) * w).sum().backward()
    p, s = quantize_groups(w @ send.grad_basis, [(16, 4)])
    assert torch.equal(xx.grad, dequantize_groups(p, s, [(16, 4)]) @ send.grad_basis.T)
    assert sum(b.numel() * b.element_size() for b in recv.pack_gradient(w, m2)) == T * group_bytes([(16, 4)])
    # both moments survive a checkpoint: the next refresh fits the same two bases
    send2 = _ref_pair()[0]
    send2.load_state_dict(copy.deepcopy(send.state_dict()))   # as a checkpoint does: its own tensors
    m3 = _msg((T, H), key=9, refresh=True)
    assert all(torch.equal(a, b) for a, b in zip(send.pack_activation(x, m3, ref=ref), send2.pack_activation(x, m3, ref=ref)))
    # no reference given: refused, naming it
    with pytest.raises(ValueError, match="reference = 'base' needs the base model's activation"):
        send.pack_activation(x, _msg((T, H), key=10))


def test_lowrank_zero_drift_is_sent_exactly():
    """At step 0 of a fine-tune the model is the base model: the drift is zero and the receiver gets
    the activation bit for bit."""
    send, recv = _ref_pair()
    x = torch.randn(40, 64) * 3
    msg = _msg((40, 64), refresh=True)
    y = recv.unpack_activation(send.pack_activation(x, msg, ref=x.clone()), msg, torch.float32, ref=x.clone())
    assert torch.equal(y, x)


def test_lowrank_reference_forward_grad_basis_is_the_exact_gradient_on_the_drift_basis():
    """grad_basis = forward: the gradient goes back on the forward's own leading directions (no second
    basis in the state); while the drift is zero (step 0 of a fine-tune) that basis is fitted on the
    activations, then on the drift once it has energy."""
    torch.manual_seed(12)
    H, T = 64, 300
    cfg = {"groups": [[8, 4]], "grad_groups": [[6, 4]], "refresh_steps": [0, 1], "reference": "base",
           "grad_basis": "forward"}
    send, recv = build_codec("lowrank", cfg=cfg), build_codec("lowrank", cfg=cfg)
    assert send.payload_bytes(H, 4) == (4 + 2, 3 + 2) and send.describe()["grad_basis"] == "forward"
    q = torch.linalg.qr(torch.randn(H, H))[0]
    ref = (torch.randn(T, H) * torch.logspace(0.5, -1, H)) @ q.T + 2.0
    # step 0: x == ref; the basis is the activations' top 8 (not the zero drift's arbitrary axes)
    m0 = _msg((T, H), refresh=True)
    assert send.state_tensor_count(m0) == recv.state_tensor_count(m0) == 2          # mean, basis
    bufs = send.pack_activation(ref.clone(), m0, ref=ref)
    assert [tuple(b.shape) for b in bufs] == [(H,), (H, 8), (T, 4), (T, 1)]
    assert send.state_bytes_sent == 2 * (H + H * 8)
    batch = RunningMoments(True)
    batch.add(ref)
    top = principal_basis(batch.covariance(), 8).to(torch.bfloat16).float()
    assert torch.equal(send.basis, top) and send.grad_basis is None
    assert "moments_x" not in send.state_dict()          # no activation moments kept for a basis not sent
    y = recv.unpack_activation([b.clone() for b in bufs], m0, torch.float32, ref=ref)
    assert torch.equal(y, ref)
    # the gradient: exactly U6 (the forward basis' leading 6 columns) both ways, at grad_groups' bytes
    xx = ref.clone().requires_grad_()
    w = torch.randn(T, H)
    (_CodecLink.apply(xx, (send, recv), _msg((T, H), key=5), True, ref) * w).sum().backward()
    u6 = send.basis[:, :6]
    p, s = quantize_groups(w @ u6, [(6, 4)])
    assert torch.equal(xx.grad, dequantize_groups(p, s, [(6, 4)]) @ u6.T)
    assert torch.equal(recv.basis, send.basis)
    # step 1: a drift in 4 directions orthogonal to the activations' top 8; the refit follows it
    d4 = torch.linalg.qr(torch.randn(H, 4))[0]
    d4 = torch.linalg.qr(d4 - top @ (top.T @ d4))[0]
    x1 = ref + 0.1 * torch.randn(T, 4) @ d4.T
    m1 = _msg((T, H), key=6, refresh=True)
    y1 = recv.unpack_activation(send.pack_activation(x1, m1, ref=ref), m1, torch.float32, ref=ref)
    lead = send.basis[:, :4]
    assert float((d4 - lead @ (lead.T @ d4)).norm()) < 0.05
    assert float((y1 - x1).norm() / (x1 - ref).norm()) < 0.15


def test_lowrank_state_bits_8_ships_int8_bases_both_ends_alike():
    """state_bits 8: each basis crosses as int8 entries with one bf16 scale per direction (its largest
    entry / 127); both ends decode the same basis, the state costs H r + 2 r bytes a basis instead of
    2 H r, the reconstruction stays within a hair of the bf16 basis', and a resumed sender refits the
    same bytes."""
    torch.manual_seed(13)
    H, T = 64, 300
    q = torch.linalg.qr(torch.randn(H, H))[0]
    ref = (torch.randn(T, H) * torch.logspace(0.5, -1, H)) @ q.T + 2.0
    x = ref + 0.1 * torch.randn(T, 8) @ torch.linalg.qr(torch.randn(H, 8))[0].T + 0.01 * torch.randn(T, H)
    base = {"groups": [[8, 4]], "grad_groups": [[16, 4]], "refresh_steps": [0], "reference": "base"}
    cfg8 = {**base, "state_bits": 8}
    send, recv = build_codec("lowrank", cfg=cfg8), build_codec("lowrank", cfg=cfg8)
    send16, recv16 = build_codec("lowrank", cfg=base), build_codec("lowrank", cfg=base)
    assert send.describe()["state_bits"] == 8 and "state_bits" not in send16.describe()
    msg = _msg((T, H), refresh=True)
    assert send.state_tensor_count(msg) == recv.state_tensor_count(msg) == 5   # mean, basis + scales, grad basis + scales
    bufs = send.pack_activation(x, msg, ref=ref)
    assert [(tuple(b.shape), b.dtype) for b in bufs[:5]] == [
        ((H,), torch.bfloat16), ((H, 8), torch.int8), ((8,), torch.bfloat16), ((H, 16), torch.int8), ((16,), torch.bfloat16)]
    assert [(tuple(b.shape), b.dtype) for b in recv.activation_buffers(msg, torch.float32, "cpu")] == \
        [(tuple(b.shape), b.dtype) for b in bufs]
    assert send.state_bytes_sent == 2 * H + (H * 8 + 2 * 8) + (H * 16 + 2 * 16)
    y = recv.unpack_activation([b.clone() for b in bufs], msg, torch.float32, ref=ref)
    assert torch.equal(send.basis, recv.basis) and torch.equal(send.grad_basis, recv.grad_basis)
    # the decoded basis is the principal basis rounded per direction to 127 levels of its largest entry
    mom = RunningMoments(True)
    mom.add((x - ref).double())
    u = principal_basis(mom.covariance(), 8)
    s = (u.abs().amax(0) / 127).to(torch.bfloat16).float()
    assert torch.equal(send.basis, torch.round(u / s).clamp(-127, 127) * s)
    assert float((send.basis - u).abs().max()) <= float(s.max()) / 2 + 1e-6
    y16 = recv16.unpack_activation(send16.pack_activation(x, msg, ref=ref), msg, torch.float32, ref=ref)
    err8, err16 = (float((v - x).norm() / (x - ref).norm()) for v in (y, y16))
    assert abs(err8 - err16) < 0.02, (err8, err16)
    # a resumed sender refits the same bytes
    send2 = build_codec("lowrank", cfg=cfg8)
    send2.load_state_dict(copy.deepcopy(send.state_dict()))
    m2 = _msg((T, H), key=9, refresh=True)
    assert all(torch.equal(a, b) for a, b in zip(send.pack_activation(x, m2, ref=ref), send2.pack_activation(x, m2, ref=ref)))


@pytest.mark.parametrize("coef_norm", ["none", "sqrt_std"])
@pytest.mark.parametrize("reference, grad_basis", [("none", "activations"), ("base", "activations"), ("base", "forward")])
def test_lowrank_state_bits_8_wire_layout_in_every_combination(coef_norm, reference, grad_basis):
    """The state tensors the sender emits, the buffers the receiver posts and the count both ends
    agree on are the same list in every combination of the state's parts, and both ends decode the
    same state from it."""
    torch.manual_seed(14)
    H, T = 64, 120
    ref = torch.randn(T, H) * 2
    x = ref + 0.2 * torch.randn(T, H)
    cfg = {"groups": [[8, 4]], "grad_groups": [[16 if (reference, grad_basis) == ("base", "activations") else 8, 4]],
           "refresh_steps": [0], "coef_norm": coef_norm, "reference": reference, "grad_basis": grad_basis,
           "state_bits": 8}
    send, recv = build_codec("lowrank", cfg=cfg), build_codec("lowrank", cfg=cfg)
    kw = {"ref": ref} if reference == "base" else {}
    msg = _msg((T, H), refresh=True)
    n = send.state_tensor_count(msg)
    bufs = send.pack_activation(x, msg, **kw)
    posted = recv.activation_buffers(msg, torch.float32, "cpu")
    assert n == recv.state_tensor_count(msg) == len(bufs) - 2
    assert [(tuple(b.shape), b.dtype) for b in posted] == [(tuple(b.shape), b.dtype) for b in bufs]
    own = send.own_grad_basis
    assert n == 3 + (coef_norm != "none") + 2 * own
    assert send.state_bytes_sent == 2 * H + (H * 8 + 2 * 8) + 2 * 8 * (coef_norm != "none") + (H * 16 + 2 * 16) * own
    y = recv.unpack_activation([b.clone() for b in bufs], msg, torch.float32, **kw)
    for k in send._STATE_FIELDS:
        assert torch.equal(getattr(send, k), getattr(recv, k)), k
    assert torch.isfinite(y).all()


def test_lowrank_grad_groups_without_reference_use_the_leading_directions():
    send, recv = _pair(groups=((24, 8),))
    cfg = {"groups": [[24, 8]], "grad_groups": [[8, 4]], "refresh_steps": [0]}
    send, recv = build_codec("lowrank", cfg=cfg), build_codec("lowrank", cfg=cfg)
    x = torch.randn(30, 64)
    msg = _msg((30, 64), refresh=True)
    recv.unpack_activation(send.pack_activation(x, msg), msg, torch.float32)
    assert send.payload_bytes(64, 4) == (24 + 2, 4 + 2) and send.state_tensor_count(msg) == 2
    g = torch.randn(30, 64)
    out = send.unpack_gradient(recv.pack_gradient(g, msg), msg, torch.float32)
    U = send.basis[:, :8]
    p, s = quantize_groups(g @ U, [(8, 4)])
    assert torch.equal(out, dequantize_groups(p, s, [(8, 4)]) @ U.T)


@pytest.mark.parametrize("section, needle", [
    ({"groups": [[8, 4]], "grad_groups": [[16, 4]]}, "twocircuit.codec.grad_groups: 16 gradient coefficients"),
    ({"groups": [[8, 4]], "reference": "prev"}, "twocircuit.codec.reference"),
    ({"groups": [[8, 4]], "grad_groups": [[3, 4]], "reference": "base"}, "twocircuit.codec.grad_groups"),
    ({"groups": [[8, 4]], "grad_groups": [[16, 4]], "reference": "base", "grad_basis": "forward"},
     "twocircuit.codec.grad_groups: 16 gradient coefficients, but with grad_basis"),
    ({"groups": [[8, 4]], "reference": "base", "grad_basis": "drift"}, "twocircuit.codec.grad_basis"),
    ({"groups": [[8, 4]], "state_bits": 4}, "twocircuit.codec.state_bits: 4; allowed: 16"),
    ({"groups": [[8, 4]], "state_bits": True}, "twocircuit.codec.state_bits"),
    ({"groups": [[8, 4]], "metric": "fisher"}, "twocircuit.codec.metric"),
    ({"groups": [[8, 4]], "metric": "gradient", "metric_steps": []}, "twocircuit.codec.metric_steps"),
    ({"groups": [[8, 4]], "metric": "gradient", "metric_window": -1}, "twocircuit.codec.metric_window = -1 is outside the allowed range [0, inf)"),
    ({"groups": [[8, 4]], "metric": "gradient", "metric_every": -5}, "twocircuit.codec.metric_every = -5 is outside"),
    ({"groups": [[8, 4]], "metric": "gradient", "metric_every": True}, "twocircuit.codec.metric_every must be an integer"),
    ({"groups": [[8, 4]], "metric": "gradient", "metric_window": 2.5}, "twocircuit.codec.metric_window must be an integer"),
    ({"groups": [[8, 4]], "metric": "gradient", "metric_rank": -2}, "twocircuit.codec.metric_rank = -2 is outside"),
    ({"groups": [[8, 4]], "metric": "gradient", "reference": "base"},
     "twocircuit.codec.metric: \"gradient\" needs the gradient on the forward's basis"),
])
def test_lowrank_reference_and_grad_groups_errors_name_the_key(section, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        TwoCircuitConfig.from_dict({"mode": "lowrank", "codec": section})


def test_lowrank_reference_merges_both_moments_for_another_dp_width():
    """Resuming on another DP width pools each replica's drift moments and activation moments alike."""
    ends = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        send, recv = _ref_pair()
        ref = torch.randn(50, 64)
        x = ref + 0.1 * torch.randn(50, 64)
        msg = _msg((50, 64), refresh=True)
        recv.unpack_activation(send.pack_activation(x, msg, ref=ref), msg, torch.float32, ref=ref)
        ends.append(send.state_dict())
    merged = LowRankCodec.merge_states(copy.deepcopy(ends))
    for k in ("moments", "moments_x"):
        assert merged[k]["n"] == 50
        assert torch.allclose(merged[k]["s1"], (ends[0][k]["s1"] + ends[1][k]["s1"]) / 2)
        assert torch.allclose(merged[k]["s2"], (ends[0][k]["s2"] + ends[1][k]["s2"]) / 2)
    assert not torch.allclose(merged["moments"]["s2"], merged["moments_x"]["s2"])


def test_moments_halflife_weighs_older_steps_down():
    """moments_halflife = 10: at the first training message of step 10, what the sender saw at step 0
    weighs 0.5, at step 20 0.25 (by the step numbers: a skipped step changes nothing); evaluation
    messages neither age nor add; the step the statistics are weighed at survives a state_dict round
    trip, so a resumed sender ages them alike. 0 (the default) keeps every token alike."""
    torch.manual_seed(7)
    H, T = 32, 12
    xs = {0: torch.randn(T, H), 10: torch.randn(T, H) + 1, 20: torch.randn(T, H) - 2}

    def run(halflife, steps):
        send = build_codec("lowrank", cfg={"groups": [[8, 4]], "refresh_steps": [0], "moments_halflife": halflife})
        for k, step in enumerate(steps):
            m = send.message(k, (T, H), step, first_of_step=True, train=True)
            send.pack_activation(xs[step], m)
            ev = send.message(100 + k, (T, H), step, first_of_step=True, train=False)  # an evaluation
            send.pack_activation(torch.randn(T, H) * 100, ev)
        return send

    s = run(10, [0, 10, 20])
    w = {0: 0.25, 10: 0.5, 20: 1.0}
    assert s.moments.n == pytest.approx(T * sum(w.values()))
    s1 = sum(w[k] * xs[k].double().sum(0) for k in w)
    s2 = sum(w[k] * xs[k].double().T @ xs[k].double() for k in w)
    assert torch.allclose(s.moments.s1, s1) and torch.allclose(s.moments.s2, s2)
    # the weighted covariance it fits on
    n = T * sum(w.values())
    assert torch.allclose(s.moments.covariance(), s2 / n - torch.outer(s1 / n, s1 / n))
    # no forgetting by default
    flat = run(0, [0, 10, 20])
    assert flat.moments.n == 3 * T and torch.allclose(flat.moments.s1, sum(x.double().sum(0) for x in xs.values()))
    # resume: the weighing step is part of the state
    a = run(10, [0, 10])
    b = build_codec("lowrank", cfg={"groups": [[8, 4]], "refresh_steps": [0], "moments_halflife": 10})
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    assert b.moments_step == 10
    for c in (a, b):
        c.pack_activation(xs[20], c.message(9, (T, H), 20, first_of_step=True, train=True))
    assert torch.equal(a.moments.s2, b.moments.s2) and torch.allclose(a.moments.s1, s1)


@pytest.mark.parametrize("value", [-1, "10", True])
def test_moments_halflife_errors_name_the_key(value):
    with pytest.raises(ConfigError, match=r"twocircuit\.codec\.moments_halflife"):
        TwoCircuitConfig.from_dict({"mode": "lowrank", "codec": {"moments_halflife": value}})


def _metric_pair(refresh=(0, 5), state_bits=16, metric_steps=(0,)):
    cfg = {"groups": [[8, 4]], "grad_groups": [[6, 4]], "refresh_steps": list(refresh), "reference": "base",
           "grad_basis": "forward", "coef_norm": "sqrt_std", "metric": "gradient",
           "metric_steps": list(metric_steps), "state_bits": state_bits}
    return build_codec("lowrank", cfg=cfg), build_codec("lowrank", cfg=cfg)


def _metric_roots_by_hand(m):
    m = m.double()
    h = m.shape[0]
    floor = 1e-3 * float(m.diagonal().sum()) / h + 1e-30
    ev, v = torch.linalg.eigh(m + floor * torch.eye(h, dtype=torch.float64))
    ev = ev.clamp_min(floor)
    return (v * ev.sqrt()) @ v.T, (v / ev.sqrt()) @ v.T


def test_lowrank_metric_flags_are_a_function_of_step_direction_and_config():
    """The metric rides on the first gradient message of a metric step, training only; the refresh on
    the first activation message of a refresh step only; any codec object of the run says the same."""
    send, recv = _metric_pair(metric_steps=(0, 3))
    for c in (send, recv):
        g0 = c.message(1, (4, 64), 0, first_of_step=True, train=True, kind="grad")
        assert g0.metric and g0.first and not g0.refresh
        assert c.message(1, (4, 64), 0, first_of_step=True, train=True).refresh
        assert c.message(1, (4, 64), 3, first_of_step=True, train=True, kind="grad").metric
        assert not c.message(1, (4, 64), 1, first_of_step=True, train=True, kind="grad").metric
        assert not c.message(1, (4, 64), 0, first_of_step=False, train=True, kind="grad").metric
        assert not c.message(1, (4, 64), 0, first_of_step=True, train=False, kind="grad").metric
    plain = build_codec("lowrank", cfg={"groups": [[8, 4]], "refresh_steps": [0]})
    assert not plain.message(1, (4, 64), 0, first_of_step=True, train=True, kind="grad").metric
    assert plain.grad_state_tensor_count(g0) == 0 and send.grad_state_tensor_count(g0) == 1


def test_lowrank_metric_crosses_back_counted_and_the_next_step_codes_in_it():
    """metric "gradient": the receiver sends its dense boundary gradients' second moment back (the upper
    triangle in bf16, counted as pp_grad_state) on the first gradient message of step 0; the next step's
    first activation message refits (not a refresh step) in that metric: the sender codes with
    enc = W^1/2 V, the receiver decodes with the shipped dec = W^-1/2 V, V the principal directions of
    W^1/2 cov W^1/2; the gradient is the exact one of the coded forward, enc Q(dec^T g)."""
    from ds_twocircuit import wire
    torch.manual_seed(21)
    H, T = 64, 300
    send, recv = _metric_pair()
    q = torch.linalg.qr(torch.randn(H, H))[0]
    ref = (torch.randn(T, H) * torch.logspace(0.5, -1, H)) @ q.T + 2.0
    m0 = send.message(7, (T, H), 0, first_of_step=True, train=True)
    assert m0.metric and send.state_tensor_count(m0) == recv.state_tensor_count(m0) == 3   # mean, basis, scale
    xx = ref.clone().requires_grad_()
    w = torch.randn(T, H) @ torch.diag(torch.logspace(0, -2, H))
    wire.reset()
    (_CodecLink.apply(xx, (send, recv), m0, True, ref) * w).sum().backward()
    tot = wire.totals()
    assert tot["pp_grad_state"] == H * (H + 1) // 2 * 2 and tot["pp_gradients"] == T * (3 + 2)
    mm = (w.T @ w / T).to(torch.bfloat16).float()
    iu = torch.triu_indices(H, H)
    assert torch.equal(send.metric[iu[0], iu[1]], mm[iu[0], iu[1]]) and torch.equal(send.metric, send.metric.T)
    assert send.metric_pending and recv.metric_pending and recv.state_bytes_sent == H * (H + 1)
    # step 0's own gradient still goes back on the basis it was coded with (no metric then)
    u6 = send.basis[:, :6]
    p, s = quantize_groups(w @ u6, [(6, 4)])
    assert torch.equal(xx.grad, dequantize_groups(p, s, [(6, 4)]) @ u6.T) and send.enc is None
    # step 1, not a refresh step: the first message carries the refit, later ones do not
    m1 = send.message(8, (T, H), 1, first_of_step=True, train=True)
    assert not m1.refresh and send.state_tensor_count(m1) == recv.state_tensor_count(m1) == 3
    x1 = ref + (torch.randn(T, H) * torch.logspace(-1, -3, H)) @ q.T
    d = x1 - ref   # the drift as the codec forms it
    bufs = send.pack_activation(x1.clone(), m1, ref=ref)
    assert not send.metric_pending
    mom = RunningMoments(True)
    mom.add(torch.zeros(T, H))   # step 0's drift
    mom.add(d)
    wh, wi = _metric_roots_by_hand(send.metric)
    cw = wh @ mom.covariance() @ wh
    v = principal_basis(cw, 8)
    assert torch.allclose(send.enc.double(), wh @ v, atol=1e-5, rtol=1e-4)
    assert torch.allclose(send.basis.double(), (wi @ v).to(torch.bfloat16).double(), atol=1e-2, rtol=1e-2)
    y1 = recv.unpack_activation([b.clone() for b in bufs], m1, torch.float32, ref=ref)
    assert not recv.metric_pending and torch.equal(recv.basis, send.basis)
    c = (d - send.mean) @ send.enc
    p, s = quantize_groups(c / send.coef_scale, [(8, 4)])
    want = ref + send.mean + (dequantize_groups(p, s, [(8, 4)]) * send.coef_scale) @ send.basis.T
    assert torch.allclose(y1, want, atol=1e-5)
    m1b = send.message(9, (T, H), 1, first_of_step=False, train=True)
    assert send.state_tensor_count(m1b) == recv.state_tensor_count(m1b) == 0
    # the gradient of the coded forward: enc6 Q(dec6^T g)
    xx = x1.clone().requires_grad_()
    (_CodecLink.apply(xx, (send, recv), m1b, True, ref) * w).sum().backward()
    p, s = quantize_groups(w @ send.basis[:, :6], [(6, 4)])
    assert torch.equal(xx.grad, dequantize_groups(p, s, [(6, 4)]) @ send.enc[:, :6].T)


@pytest.mark.parametrize("k", [8, 64])
def test_lowrank_metric_rank_sends_the_leading_eigenvectors_in_int8(k):
    """metric_rank k: the metric crosses as its k leading eigenvectors (int8, a bf16 scale each), their
    eigenvalues and the mean of the others (bf16), counted as pp_grad_state; the sender's metric has
    those eigenvalues exactly (its int8 eigenvectors made orthonormal again), the others at their mean.
    k >= H sends every eigenvector (the mean of none is 0)."""
    from ds_twocircuit import wire
    torch.manual_seed(26)
    H, T = 64, 400
    cfg = {"groups": [[8, 4]], "grad_groups": [[6, 4]], "refresh_steps": [0], "reference": "base",
           "grad_basis": "forward", "metric": "gradient", "metric_steps": [0], "metric_rank": k}
    send, recv = build_codec("lowrank", cfg=cfg), build_codec("lowrank", cfg=cfg)
    assert send.describe()["metric_rank"] == k
    q = torch.linalg.qr(torch.randn(H, H))[0]
    ref = torch.randn(T, H) + 1.0
    m0 = send.message(7, (T, H), 0, first_of_step=True, train=True)
    w = (torch.randn(T, H) * torch.logspace(0, -2, H)) @ q.T
    xx = ref.clone().requires_grad_()
    wire.reset()
    (_CodecLink.apply(xx, (send, recv), m0, True, ref) * w).sum().backward()
    kk = min(k, H)
    assert recv.grad_state_tensor_count(m0) == 3
    assert wire.totals()["pp_grad_state"] == H * kk + 2 * kk + 2 * (kk + 1) == recv.state_bytes_sent
    true = (w.double().T @ w.double()) / T
    ev, v = torch.linalg.eigh(true)
    got = send.metric.double()
    assert torch.allclose(got, got.T, atol=1e-6)
    gev = torch.linalg.eigvalsh(got)
    lead = ev[-kk:].to(torch.bfloat16).double()
    rest = ev[:-kk].mean().to(torch.bfloat16).double() if kk < H else torch.zeros((), dtype=torch.float64)
    want = torch.sort(torch.cat([lead, rest.repeat(H - kk)])).values
    assert torch.allclose(gev, want, rtol=1e-4, atol=1e-6 * float(ev[-1]))
    # the leading directions are the metric's own, to int8 precision (its errors mix a little of the
    # largest eigenvalue into the smallest)
    proj = v[:, -kk:].T @ got @ v[:, -kk:]
    assert torch.allclose(proj.diagonal(), lead, rtol=0.02, atol=2e-5 * float(ev[-1]))
    # fewer bytes than the whole metric's bf16 triangle (metric_rank 0) where k is below about H / 2
    assert (H * (H + 1) > H * kk + 2 * kk + 2 * (kk + 1)) == (kk < H // 2)


def test_lowrank_metric_keeps_the_drift_the_loss_sees():
    """The point of the metric: a large drift the gradients do not look at and a small one they do. The
    plain fit spends its 8 directions on the large one; in the metric the coded boundary keeps the
    small one, so the first-order loss error sum(g . (y - x)) is far smaller."""
    torch.manual_seed(22)
    H, T = 64, 400
    e = torch.eye(H)
    loud, quiet = e[:, :8], e[:, 8:16]
    g = torch.randn(T, 8) @ quiet.T                        # the loss looks along the quiet axes only
    d = 3.0 * torch.randn(T, 8) @ loud.T + 0.1 * torch.randn(T, 8) @ quiet.T
    ref = torch.randn(T, H)
    errs = {}
    for metric in ("none", "gradient"):
        cfg = {"groups": [[8, 8]], "refresh_steps": [0], "reference": "base", "grad_basis": "forward",
               "metric": metric, "metric_steps": [0]}
        send, recv = build_codec("lowrank", cfg=cfg), build_codec("lowrank", cfg=cfg)
        m0 = send.message(1, (T, H), 0, first_of_step=True, train=True)
        xx = (ref + d).requires_grad_()
        (_CodecLink.apply(xx, (send, recv), m0, False, ref) * g).sum().backward()
        m1 = send.message(2, (T, H), 1, first_of_step=True, train=True)
        y = recv.unpack_activation(send.pack_activation(ref + d, m1, ref=ref), m1, torch.float32, ref=ref)
        errs[metric] = float(((y - ref - d) * g).sum(1).abs().mean())
        # without a metric the step-1 message carried nothing new; with one it refit in the metric
        assert send.state_tensor_count(m1) == 0
    assert errs["gradient"] < 0.05 * errs["none"], errs


def test_lowrank_metric_state_resumes_bit_for_bit():
    """A resumed sender and receiver hold the metric, the analysis basis and the pending refit: the
    step after a checkpoint codes the same bytes as the uninterrupted pair."""
    torch.manual_seed(23)
    H, T = 64, 120
    ref = torch.randn(T, H)
    w = torch.randn(T, H)
    runs = []
    for resume in (False, True):
        send, recv = _metric_pair(state_bits=8)
        m0 = send.message(1, (T, H), 0, first_of_step=True, train=True)
        xx = ref.clone().requires_grad_()
        (_CodecLink.apply(xx, (send, recv), m0, False, ref) * w).sum().backward()
        if resume:   # checkpoint with the refit pending, then new objects
            sd, rd = copy.deepcopy(send.state_dict()), copy.deepcopy(recv.state_dict())
            send, recv = _metric_pair(state_bits=8)
            send.load_state_dict(sd)
            recv.load_state_dict(rd)
        m1 = send.message(2, (T, H), 1, first_of_step=True, train=True)
        x1 = ref + 0.1 * torch.randn(T, H, generator=torch.Generator().manual_seed(5))
        bufs = send.pack_activation(x1, m1, ref=ref)
        y = recv.unpack_activation([b.clone() for b in bufs], m1, torch.float32, ref=ref)
        runs.append((bufs, y, send.enc))
    (b0, y0, e0), (b1, y1, e1) = runs
    assert len(b0) == len(b1) == 6 and all(torch.equal(a, b) for a, b in zip(b0, b1))
    assert torch.equal(y0, y1) and torch.equal(e0, e1)


def test_lowrank_metric_accumulates_the_gradients_since_the_last_one_sent():
    """metric_steps [1] (the default): the metric that crosses on step 1's first gradient message is the
    second moment of all of step 0's gradient messages and that one; after the last metric step the
    receiver keeps no gradient moments, and a resumed receiver sends what the uninterrupted one would."""
    torch.manual_seed(24)
    H, T = 32, 40
    cfg = {"groups": [[4, 4]], "refresh_steps": [0], "reference": "base", "grad_basis": "forward",
           "metric": "gradient"}
    assert LowRankConfig(**cfg).metric_steps == [1]
    gs = [torch.randn(T, H) for _ in range(4)]
    sent = []
    for resume in (False, True):
        send, recv = build_codec("lowrank", cfg=cfg), build_codec("lowrank", cfg=cfg)
        ref = torch.randn(T, H)
        m0 = send.message(1, (T, H), 0, first_of_step=True, train=True)
        recv.unpack_activation(send.pack_activation(ref, m0, ref=ref), m0, torch.float32, ref=ref)
        out = []
        for i, (step, first) in enumerate([(0, True), (0, False), (0, False), (1, True)]):
            if resume and i == 2:
                d = copy.deepcopy(recv.state_dict())
                recv = build_codec("lowrank", cfg=cfg)
                recv.load_state_dict(d)
            msg = recv.message(9, (T, H), step, first_of_step=first, train=True, kind="grad")
            assert recv.grad_state_tensor_count(msg) == (1 if (step, first) == (1, True) else 0)
            out.append(recv.pack_gradient(gs[i], msg))
        sent.append(out[-1][0])
        assert recv.grad_moments.n == 0          # sent: nothing kept
        after = recv.message(9, (T, H), 1, first_of_step=False, train=True, kind="grad")
        recv.pack_gradient(gs[0], after)
        assert recv.grad_moments.n == 0          # the last metric step is past: nothing kept
    g = torch.cat(gs).double()
    m = (g.T @ g / (4 * T)).float()
    iu = torch.triu_indices(H, H)
    assert torch.equal(sent[0], m[iu[0], iu[1]].to(torch.bfloat16))
    assert torch.equal(sent[0], sent[1])   # resumed mid-way, the same metric
    # the metric turned on at a resume past its last metric step (a checkpoint without the metric's
    # state): which gradients are collected is a function of the step, so nothing is kept
    old = {k: v for k, v in copy.deepcopy(recv.state_dict()).items()
           if k not in ("metric", "enc", "metric_pending", "grad_moments")}
    late = build_codec("lowrank", cfg=cfg)
    late.load_state_dict(old)
    for step, first in [(2, True), (2, False), (7, True)]:
        msg = late.message(9, (T, H), step, first_of_step=first, train=True, kind="grad")
        assert not msg.collect and not msg.metric
        late.pack_gradient(gs[0], msg)
    assert late.grad_moments.n == 0
    # and with metric_steps [0, 3]: step 0's first message, then steps 1-2 and step 3's first
    c2 = dict(cfg, metric_steps=[0, 3])
    r2 = build_codec("lowrank", cfg=c2)
    flags = [(r2.message(9, (T, H), st, first_of_step=f, train=tr, kind="grad").collect)
             for st, f, tr in [(0, True, True), (0, False, True), (1, True, True), (3, True, True),
                               (3, False, True), (4, True, True), (1, True, False)]]
    assert flags == [True, True, True, True, False, False, False]
    # with metric_window 2 and metric_steps [1, 6]: step 0 and step 1's first (the window reaches back
    # past the run's start), then steps 4-5 and step 6's first only
    r3 = build_codec("lowrank", cfg=dict(cfg, metric_steps=[1, 6], metric_window=2))
    assert r3.describe()["metric_window"] == 2
    flags = [r3.message(9, (T, H), st, first_of_step=f, train=True, kind="grad").collect
             for st, f in [(0, True), (0, False), (1, True), (1, False), (2, True), (3, False), (4, True),
                           (5, False), (6, True), (6, False), (7, True)]]
    assert flags == [True, True, True, False, False, False, True, True, True, False, False]
    # metric_every 5 after metric_steps [1] with window 2: metrics on steps 1, 6, 11, ... and the same
    # flags as the steps listed out, on every step of a long run
    r4 = build_codec("lowrank", cfg=dict(cfg, metric_steps=[1], metric_every=5, metric_window=2))
    r5 = build_codec("lowrank", cfg=dict(cfg, metric_steps=list(range(1, 400, 5)), metric_window=2))
    assert r4.describe()["metric_every"] == 5 and "metric_every" not in r5.describe()
    for st in range(200):
        for f in (True, False):
            a, b = (r.message(9, (T, H), st, first_of_step=f, train=True, kind="grad") for r in (r4, r5))
            assert (a.collect, a.metric) == (b.collect, b.metric), (st, f)
    assert [st for st in range(30) if r4.metric_due(st)] == [1, 6, 11, 16, 21, 26]
    assert [st for st in range(13) if r4.metric_collects(st, False)] == [0, 4, 5, 9, 10]
    # without a window it collects on every step: each metric holds the gradients since the previous one
    r6 = build_codec("lowrank", cfg=dict(cfg, metric_steps=[0, 3], metric_every=4))
    assert [st for st in range(16) if r6.metric_due(st)] == [0, 3, 7, 11, 15]
    assert all(r6.metric_collects(st, False) for st in range(300))
