"""Tests of ds_twocircuit.anchor.spectral (SpectralCorrection and its pure functions)."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from ds_twocircuit.anchor import spectral
from ds_twocircuit.anchor.spectral import (SpectralCorrection, filter_strengths, randomized_svd, spectral_filter,
                                           thin_svd)

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

def _orthonormal(n: int, gen: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return q


def _spectrum_matrix(n, m, s, gen):
    """Matrix with orthonormal singular vectors (returned too) and singular values s."""
    U, V = _orthonormal(n, gen), _orthonormal(m, gen)
    r = len(s)
    M = U[:, :r] @ torch.diag(torch.tensor(s, dtype=torch.float64)) @ V[:, :r].T
    return M, U, V


def _one_matrix(n, m, gen, dtype=torch.float32, **kw):
    W = torch.nn.Parameter(torch.randn(n, m, generator=gen).to(dtype))
    inner = torch.optim.SGD([W], lr=0.0)   # lr 0: p.grad after step() is exactly G_use
    return W, SpectralCorrection(inner, {"w": W}, **kw)


def _dense_reference(G, anchors, alpha, tau, tau_mode, beta, ema_init):
    """G_use computed with explicit n x n and m x m projectors in float64."""
    G = G.double().numpy()
    if ema_init == "first":
        M = anchors[0].double().numpy()
        for a in anchors[1:]:
            M = beta * M + (1 - beta) * a.double().numpy()
    else:
        M = np.zeros_like(G)
        for a in anchors:
            M = beta * M + (1 - beta) * a.double().numpy()
        if ema_init == "bias_corrected":
            M = M / (1 - beta ** len(anchors))
    U, s, Vh = np.linalg.svd(M, full_matrices=False)
    tau_eff = tau * s.max() if tau_mode == "relative" else tau
    d = s / (s + tau_eff)
    P_left = U @ np.diag(d) @ U.T            # n x n (fine in a test)
    P_right = Vh.T @ np.diag(d) @ Vh         # m x m
    return alpha * G + (1 - alpha) * (P_left @ G @ P_right), d


# ---------------------------------------------------------------------------------------------
# filter math
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(12, 7), (6, 10)])
@pytest.mark.parametrize("tau_mode,tau", [("absolute", 1e-3), ("relative", 0.05)])
@pytest.mark.parametrize("ema_init", ["bias_corrected", "first", "zero"])
def test_filter_matches_dense_float64(shape, tau_mode, tau, ema_init):
    gen = torch.Generator().manual_seed(1)
    n, m = shape
    r = min(n, m)
    beta, alpha = 0.8, 0.3
    s = np.logspace(0, -5, r)               # spans the threshold, so d takes many values
    anchors = [_spectrum_matrix(n, m, s, gen)[0].float(), _spectrum_matrix(n, m, s * 0.5, gen)[0].float()]
    W, opt = _one_matrix(n, m, gen, alpha=alpha, tau=tau, tau_mode=tau_mode, beta=beta, ema_init=ema_init)
    opt.submit_anchor_gradients({"w": anchors[0]}, source_step=0)
    opt.submit_anchor_gradients({"w": anchors[1]}, source_step=1)
    G = torch.randn(n, m, generator=gen)
    W.grad = G.clone()
    opt.step()
    expected, d = _dense_reference(G, anchors, alpha, tau, tau_mode, beta, ema_init)
    got = W.grad.double().numpy()
    assert np.abs(got - expected).max() <= 2e-5 * np.abs(expected).max()
    # the correction is not trivially small: the test would notice a missing filter
    assert np.abs(expected - G.double().numpy()).max() > 0.05 * np.abs(expected).max()
    assert d.min() < 0.9 and d.max() > 0.5            # d is neither all ~1 nor all ~0


def test_filter_strengths_values():
    s = torch.tensor([1.0, 0.01, 0.001, 0.0])
    assert torch.allclose(filter_strengths(s, 1e-3, "absolute"),
                          torch.tensor([1 / 1.001, 0.01 / 0.011, 0.5, 0.0]))
    assert torch.allclose(filter_strengths(s, 0.01, "relative"), torch.tensor([1 / 1.01, 0.5, 0.001 / 0.011, 0.0]))
    # tau_eff = 0 on a zero matrix: no NaN
    assert torch.equal(filter_strengths(torch.zeros(3), 0.1, "relative"), torch.zeros(3))


def _planted(n=10, m=8, s=(1.0, 0.01, 0.001), seed=2):
    gen = torch.Generator().manual_seed(seed)
    M, U, V = _spectrum_matrix(n, m, list(s), gen)
    return M.float(), U.float(), V.float(), gen


@pytest.mark.parametrize("left_in,right_in", [(False, False), (True, False), (False, True)])
def test_gradient_outside_anchor_subspace_is_suppressed(left_in, right_in):
    M, U, V, gen = _planted()
    alpha = 0.3
    W, opt = _one_matrix(10, 8, gen, alpha=alpha, tau=1e-3)
    opt.submit_anchor_gradients({"w": M}, source_step=0)
    i = 1 if left_in else 5                 # directions 0..2 span the anchor subspace
    j = 2 if right_in else 6
    G = torch.outer(U[:, i], V[:, j])
    W.grad = G.clone()
    opt.step()
    # G_filt = 0 up to the fp32 SVD's noise directions (s ~ 1e-7, so d ~ 1e-4); no filter would leave 0.7 G
    assert torch.allclose(W.grad, alpha * G, atol=5e-4 * G.abs().max().item())
    assert opt.last_stats()["spectral/alignment_topk"] == pytest.approx(0.0, abs=1e-10)


@pytest.mark.parametrize("i,j", [(0, 0), (1, 1), (2, 2), (0, 2), (2, 1)])
def test_gradient_inside_subspace_passes_with_weight_di_dj(i, j):
    M, U, V, gen = _planted()
    alpha, tau = 0.3, 1e-3
    W, opt = _one_matrix(10, 8, gen, alpha=alpha, tau=tau)
    opt.submit_anchor_gradients({"w": M}, source_step=0)
    d = [s / (s + tau) for s in (1.0, 0.01, 0.001)]           # 0.999, 0.909, 0.5
    G = torch.outer(U[:, i], V[:, j])
    W.grad = G.clone()
    opt.step()
    weight = alpha + (1 - alpha) * d[i] * d[j]
    assert torch.allclose(W.grad, weight * G, atol=2e-4 * G.abs().max().item())
    stats = opt.last_stats()
    assert stats["spectral/alignment_topk"] == pytest.approx(1.0, abs=1e-5)
    assert stats["spectral/filter_effect"] == pytest.approx((1 - alpha) * (1 - d[i] * d[j]), abs=2e-5)


# ---------------------------------------------------------------------------------------------
# no-ops, dtype, refresh only on arrival
# ---------------------------------------------------------------------------------------------

def _twin_models(seed=3):
    torch.manual_seed(seed)
    a = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 5))
    b = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 5))
    b.load_state_dict(a.state_dict())
    return a, b


def _targets(model):
    return {"0.weight": model[0].weight, "2.weight": model[2].weight}


def _set_grads(model, step):
    gen = torch.Generator().manual_seed(1000 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def _anchor_grads(step):
    gen = torch.Generator().manual_seed(5000 + step)
    return {"0.weight": torch.randn(9, 6, generator=gen), "2.weight": torch.randn(5, 9, generator=gen)}


@pytest.mark.parametrize("alpha,submit", [(1.0, True), (0.3, False)])
def test_alpha_one_and_no_anchor_are_bitwise_noops(alpha, submit):
    bare, wrapped = _twin_models()
    opt_bare = torch.optim.AdamW(bare.parameters(), lr=1e-2)
    opt = SpectralCorrection(torch.optim.AdamW(wrapped.parameters(), lr=1e-2), _targets(wrapped), alpha=alpha)
    for step in range(4):
        if submit and step in (0, 2):
            opt.submit_anchor_gradients(_anchor_grads(step), source_step=step)
        _set_grads(bare, step)
        _set_grads(wrapped, step)
        opt_bare.step()
        opt.step()
    for p, q in zip(bare.parameters(), wrapped.parameters()):
        assert torch.equal(p, q)
    stats = opt.last_stats()
    assert stats["spectral/filter_effect"] == 0.0
    assert stats["spectral/active_matrices"] == (2.0 if submit else 0.0)
    if submit:   # diagnostics still computed from the read-only gradient
        assert 0.0 < stats["spectral/alignment_topk"] <= 1.0


def test_active_filter_changes_the_step():
    bare, wrapped = _twin_models()
    opt_bare = torch.optim.AdamW(bare.parameters(), lr=1e-2)
    opt = SpectralCorrection(torch.optim.AdamW(wrapped.parameters(), lr=1e-2), _targets(wrapped), alpha=0.3,
                             tau_mode="relative")
    opt.submit_anchor_gradients(_anchor_grads(0), source_step=0)
    _set_grads(bare, 0)
    _set_grads(wrapped, 0)
    opt_bare.step()
    opt.step()
    assert not torch.equal(bare[0].weight, wrapped[0].weight)
    assert torch.equal(bare[0].bias, wrapped[0].bias)          # non-targets untouched


def test_bf16_gradient_keeps_param_dtype_and_svd_is_fp32():
    gen = torch.Generator().manual_seed(4)
    W, opt = _one_matrix(8, 6, gen, dtype=torch.bfloat16, alpha=0.2, tau_mode="relative", tau=0.1)
    anchor = torch.randn(8, 6, generator=gen).bfloat16()
    opt.submit_anchor_gradients({"w": anchor}, source_step=0)
    U, S, V = opt.anchor_subspace("w")
    assert U.dtype == S.dtype == V.dtype == torch.float32
    G = torch.randn(8, 6, generator=gen).bfloat16()
    W.grad = G.clone()
    opt.step()
    assert W.grad.dtype == torch.bfloat16
    expected, _ = _dense_reference(G.float(), [anchor.float()], 0.2, 0.1, "relative", 0.95, "bias_corrected")
    err = (W.grad.double().numpy() - expected)
    assert np.abs(err).max() <= 1e-2 * np.abs(expected).max()          # bf16 rounding of the result only
    assert np.abs(expected - G.double().numpy()).max() > 0.1


def test_svd_refreshed_only_when_an_anchor_arrives(monkeypatch):
    calls = []
    real = spectral.thin_svd
    monkeypatch.setattr(spectral, "thin_svd", lambda *a, **k: calls.append(1) or real(*a, **k))
    model, _ = _twin_models()
    opt = SpectralCorrection(torch.optim.AdamW(model.parameters(), lr=1e-3), _targets(model))
    for step in range(3):
        _set_grads(model, step)
        opt.step()
    assert calls == [] and opt.svd_refreshes == 0
    opt.submit_anchor_gradients(_anchor_grads(3), source_step=3)
    assert len(calls) == 2 and opt.svd_refreshes == 2
    U_before = opt.anchor_subspace("0.weight")[0]
    for step in range(3, 8):
        _set_grads(model, step)
        opt.step()
    assert len(calls) == 2 and opt.svd_refreshes == 2
    assert opt.anchor_subspace("0.weight")[0] is U_before
    opt.submit_anchor_gradients({"2.weight": _anchor_grads(8)["2.weight"]}, source_step=8)   # a subset
    assert len(calls) == 3 and opt.anchor_updates == 2
    assert opt.last_stats()["spectral/anchor_updates"] == 1.0     # stats are those of the last step


# ---------------------------------------------------------------------------------------------
# checkpoint / resume
# ---------------------------------------------------------------------------------------------

def _run(model, opt, steps, anchors_at=(2, 5)):
    stats = []
    for step in steps:
        if step in anchors_at:
            opt.submit_anchor_gradients(_anchor_grads(step), source_step=step - 1)
        _set_grads(model, step)
        opt.step()
        stats.append(opt.last_stats())
    return stats


def _make(model, svd):
    kw = dict(svd="randomized", svd_rank=4, svd_oversample=1, svd_niter=1) if svd == "randomized" else {}
    return SpectralCorrection(torch.optim.AdamW(model.parameters(), lr=1e-2), _targets(model), alpha=0.2,
                              tau=0.05, tau_mode="relative", **kw)


@pytest.mark.parametrize("svd", ["full", "randomized"])
def test_save_restore_continues_bitwise(svd):
    ref, resumed = _twin_models()
    opt_ref = _make(ref, svd)
    ref_stats = _run(ref, opt_ref, range(8))

    opt = _make(resumed, svd)
    _run(resumed, opt, range(4))
    buf = io.BytesIO()
    torch.save({"model": resumed.state_dict(), "opt": opt.state_dict()}, buf)
    _run(resumed, opt, range(4, 6))                  # diverge after the save: must not leak into it
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)       # plain tensors, ints, strings: weights_only loads it
    fresh, _ = _twin_models(seed=99)
    fresh.load_state_dict(saved["model"])
    opt2 = _make(fresh, svd)
    opt2.load_state_dict(saved["opt"])
    assert opt2.current_step == 4 and opt2.anchor_updates == 1 and opt2.last_anchor_source_step == 1
    stats = _run(fresh, opt2, range(4, 8))
    for p, q in zip(ref.parameters(), fresh.parameters()):
        assert torch.equal(p, q)
    assert stats[-1] == ref_stats[-1]
    assert ref_stats[-1]["spectral/staleness"] == 7 - 4


def test_in_place_round_trip_like_deepspeed():
    ref, model = _twin_models()
    opt_ref = _make(ref, "full")
    _run(ref, opt_ref, range(7))
    opt = _make(model, "full")
    _run(model, opt, range(3))
    opt.load_state_dict(opt.state_dict())
    assert opt.param_groups is opt.inner.param_groups
    _run(model, opt, range(3, 7))
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p, q)


def test_state_dict_is_inner_layout_plus_spectral_and_plain_inner_loads_with_warning():
    model, _ = _twin_models()
    opt = _make(model, "full")
    _run(model, opt, range(3))
    sd = opt.state_dict()
    assert set(sd) == {"state", "param_groups", "spectral"}
    assert set(sd["spectral"]["matrices"]) == {"0.weight", "2.weight"}
    plain = {k: v for k, v in sd.items() if k != "spectral"}
    with pytest.warns(RuntimeWarning, match="no 'spectral'"):
        opt.load_state_dict(plain)
    assert not opt.has_anchor and opt.anchor_updates == 0


# ---------------------------------------------------------------------------------------------
# randomized SVD
# ---------------------------------------------------------------------------------------------

def test_randomized_full_rank_matches_full_svd_on_filtered_gradient():
    gen = torch.Generator().manual_seed(6)
    n, m = 20, 12
    anchor = torch.randn(n, m, generator=gen)
    G = torch.randn(n, m, generator=gen)
    outs = []
    for kw in (dict(svd="full"), dict(svd="randomized", svd_rank=m, svd_oversample=0, svd_niter=1)):
        W = torch.nn.Parameter(torch.zeros(n, m))
        opt = SpectralCorrection(torch.optim.SGD([W], lr=0.0), {"w": W}, alpha=0.0, tau=0.3, tau_mode="relative", **kw)
        opt.submit_anchor_gradients({"w": anchor}, source_step=0)
        W.grad = G.clone()
        opt.step()
        outs.append(W.grad.clone())
    assert torch.allclose(outs[0], outs[1], atol=1e-4 * outs[0].abs().max().item())
    assert not torch.allclose(outs[0], G, atol=1e-2)          # the filter did something


def test_randomized_svd_recovers_low_rank_and_leaves_global_rng_alone():
    gen = torch.Generator().manual_seed(7)
    M, _, _ = _spectrum_matrix(30, 16, [3.0, 2.0, 1.0], gen)
    M = M.float()
    rng = torch.random.get_rng_state()
    U, S, V = randomized_svd(M, rank=3, oversample=2, niter=1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(rng, torch.random.get_rng_state())
    assert torch.allclose(S, torch.tensor([3.0, 2.0, 1.0]), atol=1e-5)
    assert torch.allclose((U * S) @ V.T, M, atol=1e-5)
    Uf, Sf, Vf = thin_svd(M, rank=3)
    G = torch.randn(30, 16, generator=gen)
    d = filter_strengths(S, 0.5)
    assert torch.allclose(spectral_filter(G, U, d, V), spectral_filter(G, Uf, filter_strengths(Sf, 0.5), Vf), atol=1e-5)


# ---------------------------------------------------------------------------------------------
# diagnostics, staleness, validation, scheduler
# ---------------------------------------------------------------------------------------------

def test_diagnostics_on_constructed_example():
    M, U, V, gen = _planted(s=(1.0, 0.01, 0.002))
    W, opt = _one_matrix(10, 8, gen, alpha=0.5, tau=1e-3, topk_diag=2)
    opt.submit_anchor_gradients({"w": M}, source_step=3)
    G = torch.outer(U[:, 0], V[:, 1]) + torch.outer(U[:, 1], V[:, 0])      # inside the top-2 block
    W.grad = G.clone()
    opt.step(step=10)
    stats = opt.last_stats()
    assert stats["spectral/alignment_topk"] == pytest.approx(1.0, abs=1e-5)
    assert stats["spectral/directions_passed"] == 3.0             # d = 0.999, 0.909, 0.667, then ~0
    assert stats["spectral/staleness"] == 7.0 and stats["spectral/step"] == 10.0
    assert stats["spectral/anchor_updates"] == 1.0 and stats["spectral/svd_refreshes"] == 1.0
    d0, d1 = 1 / 1.001, 0.01 / 0.011
    assert stats["spectral/filter_effect"] == pytest.approx(0.5 * (1 - d0 * d1), rel=1e-4)
    # the third direction is in the anchor subspace but outside the top-2 block: alignment 0
    W.grad = torch.outer(U[:, 2], V[:, 2])
    opt.step()
    stats = opt.last_stats()
    assert stats["spectral/alignment_topk"] == pytest.approx(0.0, abs=1e-8)
    assert stats["spectral/staleness"] == 8.0
    # half and half: alignment 1/2
    W.grad = torch.outer(U[:, 0], V[:, 0]) + torch.outer(U[:, 2], V[:, 2])
    opt.step()
    assert opt.last_stats()["spectral/alignment_topk"] == pytest.approx(0.5, abs=1e-5)


def test_stats_before_any_anchor():
    W, opt = _one_matrix(4, 3, torch.Generator().manual_seed(0))
    assert opt.last_stats() == {}
    W.grad = torch.ones(4, 3)
    opt.step()
    stats = opt.last_stats()
    assert stats["spectral/staleness"] == -1.0 and stats["spectral/active_matrices"] == 0.0
    assert all(isinstance(v, float) for v in stats.values())


def test_invalid_input_is_rejected():
    gen = torch.Generator().manual_seed(0)
    W, opt = _one_matrix(4, 3, gen)
    with pytest.raises(ValueError, match="unknown target"):
        opt.submit_anchor_gradients({"nope": torch.zeros(4, 3)}, 0)
    with pytest.raises(ValueError, match="shape"):
        opt.submit_anchor_gradients({"w": torch.zeros(3, 4)}, 0)
    with pytest.raises(ValueError, match="not finite"):
        opt.submit_anchor_gradients({"w": torch.full((4, 3), float("nan"))}, 0)
    opt.submit_anchor_gradients({"w": torch.randn(4, 3, generator=gen)}, 5)
    with pytest.raises(ValueError, match="not newer"):
        opt.submit_anchor_gradients({"w": torch.randn(4, 3, generator=gen)}, 5)
    assert opt.anchor_updates == 1
    other = torch.nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(RuntimeError, match="not parameters of the inner optimizer"):
        SpectralCorrection(torch.optim.SGD([W], lr=0.1), {"w": W, "x": other})
    with pytest.raises(ValueError, match="2-D"):
        SpectralCorrection(torch.optim.SGD([W], lr=0.1), {"b": torch.nn.Parameter(torch.zeros(3))})
    with pytest.raises(ValueError, match="svd_rank"):
        SpectralCorrection(torch.optim.SGD([W], lr=0.1), {"w": W}, svd="randomized")


def test_lr_scheduler_drives_inner_param_groups():
    model, _ = _twin_models()
    inner = torch.optim.AdamW(model.parameters(), lr=1.0)
    opt = SpectralCorrection(inner, _targets(model))
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    sched = torch.optim.lr_scheduler.LambdaLR(inner, lambda s: 0.5 ** s)  # the scheduler sees inner
    for step in range(3):
        _set_grads(model, step)
        opt.step()
        sched.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.125)


_DS_SCRIPT = textwrap.dedent("""
    import os, sys, tempfile, torch
    import deepspeed
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None   # skip a 60 s JIT build on CPU
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False,
                               init_method="file://" + os.path.join(sys.argv[1], "filestore"), rank=0, world_size=1)
    from ds_twocircuit.anchor.spectral import SpectralCorrection
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = SpectralCorrection(inner, {"0.weight": model[0].weight, "2.weight": model[2].weight},
                             tau_mode="relative")
    cfg = {"train_batch_size": 4, "scheduler": {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 5}}}
    eng, _, _, _ = deepspeed.initialize(model=model, optimizer=inner, config=cfg)
    assert eng.optimizer is inner and inner.twocircuit_correction is opt, type(eng.optimizer)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    def train_step():
        loss = torch.nn.functional.mse_loss(eng(x), y); eng.backward(loss); eng.step()
    for s in range(3):
        if s == 1:
            opt.submit_anchor_gradients({"0.weight": torch.randn(16, 8), "2.weight": torch.randn(4, 16)}, 0)
        train_step()
    assert opt.last_stats()["spectral/active_matrices"] == 2.0
    lr_before = opt.param_groups[0]["lr"]
    eng.save_checkpoint(sys.argv[1], "t1")
    train_step()
    expected = [p.detach().clone() for p in model.parameters()]
    assert opt.param_groups[0]["lr"] > lr_before            # the scheduler drives the inner optimizer
    eng.load_checkpoint(sys.argv[1], "t1")
    assert opt.anchor_updates == 1 and opt.current_step == 3
    train_step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), expected))
    torch.distributed.destroy_process_group()
    print("DS_OK")
""")


def test_deepspeed_steps_and_saves_it_through_the_inner_optimizers_hooks(tmp_path):
    pytest.importorskip("deepspeed")
    env = dict(os.environ, PYTHONPATH=str(REPO), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), DS_ACCELERATOR="cpu",
               OMP_NUM_THREADS="1", LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
    proc = subprocess.run([sys.executable, "-c", _DS_SCRIPT, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "DS_OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_anchor_mix_adds_the_scaled_anchor_prior():
    import torch
    from ds_twocircuit.anchor.spectral import SpectralCorrection
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 4))
    inner = torch.optim.SGD([w], lr=1.0)
    opt = SpectralCorrection(inner, {"w": w}, alpha=1.0, anchor_mix=0.5, ema_init="first")
    anchor = torch.randn(6, 4)
    opt.submit_anchor_gradients({"w": anchor}, 0)
    g = torch.randn(6, 4)
    w.grad = g.clone()
    before = w.detach().clone()
    opt.step(step=1)
    expected = g + 0.5 * g.norm() / anchor.norm() * anchor     # alpha = 1: G_mask + mix * scaled prior
    assert torch.allclose(before - w.detach(), expected, atol=1e-6)
    import pytest
    with pytest.raises(ValueError, match="anchor_mix"):
        SpectralCorrection(torch.optim.SGD([w], lr=1.0), {"w": w}, anchor_mix=-1.0)


def test_it_acts_only_through_the_inner_optimizers_public_hooks():
    """Stepping ``inner`` directly (as DeepSpeed does) is the same as stepping the correction;
    after ``detach()`` inner steps and saves as a plain optimizer."""
    ref, model = _twin_models()
    opt_ref = _make(ref, "full")
    opt = _make(model, "full")
    for o in (opt_ref, opt):
        o.submit_anchor_gradients(_anchor_grads(0), 0)
    for step in range(3):
        _set_grads(ref, step)
        opt_ref.step()
        _set_grads(model, step)
        opt.inner.step()                       # no call into the correction: only its hooks run
    assert opt.current_step == opt_ref.current_step == 3
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), model.parameters()))
    assert opt.last_stats()["spectral/active_matrices"] == 2.0   # the filter did act
    assert "spectral" in opt.inner.state_dict()
    with pytest.raises(ValueError, match="already has a correction"):
        SpectralCorrection(opt.inner, _targets(model))
    opt.detach()
    assert "spectral" not in opt.inner.state_dict() and not hasattr(opt.inner, "twocircuit_correction")
    before = [p.detach().clone() for p in model.parameters()]
    _set_grads(model, 5)
    g = [p.grad.clone() for p in model.parameters()]
    opt.inner.step()
    assert opt.current_step == 3                     # detached: no longer counts
    assert all(torch.equal(p.grad, q) for p, q in zip(model.parameters(), g))  # not filtered
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
