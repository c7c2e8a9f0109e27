"""Tests of the pure DP synchronisation algorithms (ds_twocircuit.dp).

Single-process tests run in-process.  Two-replica behaviour runs on real gloo ranks: one spawned
2-process suite (``dist_suite`` fixture, module scope) executes every scenario once and the tests
(marked ``multiproc``) assert on its results, so the process start-up cost is paid once.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dist_helpers import run_distributed
from ds_twocircuit import wire
from ds_twocircuit.dp import registry
from ds_twocircuit.adapters.comm import dp_comm
from ds_twocircuit.dp.base import Collective, Communicator, DPBackend, NonFiniteGradientError
from ds_twocircuit.config import TwoCircuitConfig
from ds_twocircuit.configkit import ConfigError
from ds_twocircuit.dp.allreduce import AllReduceConfig
from ds_twocircuit.dp.config import BackendConfig, OptionsConfig, RunSettings, int_in, setting
from ds_twocircuit.dp.diloco import (DiLoCoConfig, StreamingDiLoCo, StreamingDiLoCoConfig,
                                     split_fragments)
from ds_twocircuit.dp.powersgd import (PowerSGDBackendConfig, PowerSGDCompressor, PowerSGDConfig,
                                       orthogonalize_)
from ds_twocircuit.dp.registry import build_backend, config_from_dict, get_backend


# --------------------------------------------------------------------------------------------
# shared toy problem (also used inside the spawned ranks)

def _toy_model() -> nn.Module:
    torch.manual_seed(0)  # identical initial weights on every replica
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def _train(model, opt, backend, rank, steps, record=None):
    for s in steps:
        x, y = _batch(rank, s)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        backend.reduce_gradients(s)
        opt.step()
        backend.after_optimizer_step(s)
        stats = backend.pop_step_stats()
        if record is not None:
            record.append((s, torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                           stats))


def _make(cfg, rank, world, lr=0.05, momentum=0.9):
    m = _toy_model()
    opt = torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum)
    return m, opt, build_backend(list(m.named_parameters()), dp_comm(None, world), cfg)


def _low_rank(n, m, k, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) @ torch.randn(k, m, generator=g)


# --------------------------------------------------------------------------------------------
# the 2-rank suite

PSGD2 = {"matrix_approximation_rank": 2, "start_powerSGD_iter": 0}
RESUME_CASES = {
    "allreduce": ({"backend": "allreduce"}, 6, 3),
    "powersgd": ({"backend": "powersgd",
                  "powersgd": {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2}}, 8, 5),
    "diloco": ({"backend": "diloco", "inner_steps": 3}, 10, 4),
    "diloco_powersgd": ({"backend": "diloco", "inner_steps": 3, "compression": "powersgd",
                         "powersgd": PSGD2}, 10, 4),
    "streaming_overlap": ({"backend": "streaming_diloco", "inner_steps": 4, "num_fragments": 2,
                           "overlap_steps": 1}, 12, 4),
    "diloco_quant": ({"backend": "diloco", "inner_steps": 3, "compression": "quant"}, 10, 4),
    # saved after step 4: fragment 0's quantised all-gather (launched after step 3) is in flight,
    # and each replica's quantisation residual must survive the checkpoint
    "streaming_quant_overlap": ({"backend": "streaming_diloco", "inner_steps": 4, "num_fragments": 2,
                                 "overlap_steps": 1, "compression": "quant",
                                 "quant": {"bits": 2, "block": 8}}, 12, 4),
    # the reduce-scatter, saved after step 5: fragment 0's sync (launched after step 3) has its
    # all-gather of the owners' means in flight (launched after step 5), fragment 1's (launched
    # after step 5) its all-to-all; the owners' residuals must survive the checkpoint
    "streaming_quant_rs_overlap": ({"backend": "streaming_diloco", "inner_steps": 4, "num_fragments": 2,
                                    "overlap_steps": 3, "compression": "quant",
                                    "quant": {"bits": 2, "block": 8, "collective": "reduce_scatter"}}, 12, 6),
    "streaming_powersgd_overlap": ({"backend": "streaming_diloco", "inner_steps": 4,
                                    "num_fragments": 2, "overlap_steps": 2,
                                    "compression": "powersgd", "powersgd": PSGD2}, 12, 6),
    # saved after step 7: fragment 0's sync (launched after step 5) has its Q all-reduce in flight
    # (launched after step 7, finished after step 8), and the delayed merge rule's own
    # pseudo-gradient must survive the checkpoint
    "streaming_powersgd_delayed_q_in_flight": ({"backend": "streaming_diloco", "inner_steps": 6,
                                                "num_fragments": 2, "overlap_steps": 3,
                                                "merge_rule": "delayed", "compression": "powersgd",
                                                "powersgd": PSGD2}, 16, 8),
}


def _sc_psgd_exact(rank, world):
    comp = PowerSGDCompressor({"matrix_approximation_rank": 4, "warm_start": False})
    comm = Collective(dp_comm(None, world))
    g = torch.Generator().manual_seed(7)
    b = torch.randn(3, 20, generator=g)  # shared row space: the DP mean has rank 3 <= 4
    mats = [torch.randn(24, 3, generator=torch.Generator().manual_seed(10 + r)) @ b
            for r in range(world)]
    t = mats[rank].clone()
    comp.reduce_mean_([t], ["w"], comm)
    expected = sum(mats) / world
    return {"err": float((t - expected).abs().max()), "scale": float(expected.abs().max()),
            "bytes": comm.pop_stats()["bytes_sent"]}


def _sc_psgd_bytes(rank, world):
    comp = PowerSGDCompressor({"matrix_approximation_rank": 4})
    comm = Collective(dp_comm(None, world))
    out = {}
    before = wire.totals()["dp"]
    comp.reduce_mean_([torch.randn(64, 48)], ["mat"], comm)
    out["matrix"] = comm.pop_stats()["bytes_sent"]
    out["matrix_wire"] = wire.totals()["dp"] - before
    comp.reduce_mean_([torch.randn(48), torch.randn(4, 4), torch.randn(3, 5, dtype=torch.float64)],
                      ["vec", "small", "small64"], comm)
    out["small"] = comm.pop_stats()
    comp.reduce_mean_([torch.randn(64, 48)], ["mat"], comm, dense=True)
    out["dense"] = comm.pop_stats()["bytes_sent"]
    m, opt, b = _make({"backend": "powersgd", "powersgd": PSGD2}, rank, world)
    before = wire.totals()["dp"]
    rec = []
    _train(m, opt, b, rank, range(1), rec)
    out["backend_stats"], out["backend_wire"] = rec[0][2], wire.totals()["dp"] - before
    out["grads"] = [p.grad.clone() for p in m.parameters()]
    return out


def _sc_diloco_h1(rank, world):
    cfg = {"backend": "diloco", "inner_steps": 1, "outer_lr": 1.0, "outer_momentum": 0.0,
           "nesterov": False}
    ref, opt, b = _make({"backend": "allreduce"}, rank, world, lr=0.1, momentum=0.0)
    _train(ref, opt, b, rank, range(6))
    dil, opt, b = _make(cfg, rank, world, lr=0.1, momentum=0.0)
    _train(dil, opt, b, rank, range(6))
    return {"diff": max(float((p - q).abs().max())
                        for p, q in zip(ref.parameters(), dil.parameters())),
            "moved": max(float((p - q).abs().max())
                         for p, q in zip(ref.parameters(), _toy_model().parameters()))}


def _sc_diloco_drift(rank, world):
    m, opt, b = _make({"backend": "diloco", "inner_steps": 3}, rank, world)
    rec = []
    _train(m, opt, b, rank, range(9), rec)
    return {"params": [r[1] for r in rec], "stats": [r[2] for r in rec],
            "backup": [t.clone() for t in b.backup], "momentum": [t.clone() for t in b.momentum]}


def _sc_streaming(rank, world):
    out = {}
    m, opt, b = _make({"backend": "streaming_diloco", "inner_steps": 6, "num_fragments": 3,
                       "overlap": False}, rank, world)
    stats, snaps = [], []
    for s in range(20):
        rec = []
        _train(m, opt, b, rank, range(s, s + 1), rec)
        stats.append(rec[0][2])
        snaps.append([p.detach().clone() for p in m.parameters()])
    out["plain"] = {"stats": stats, "fragments": b.fragments, "params": snaps}
    # end of training: only the fragments that drifted since their last sync are synced again
    out["plain"]["finalize_changed"] = b.finalize()
    out["plain"]["final_stats"] = b.pop_step_stats()
    out["plain"]["final"] = [p.detach().clone() for p in m.parameters()]
    out["plain"]["final_backup"] = [t.clone() for t in b.backup]
    m, opt, b = _make({"backend": "streaming_diloco", "inner_steps": 4, "num_fragments": 2,
                       "overlap_steps": 1}, rank, world)
    rec = []
    _train(m, opt, b, rank, range(12), rec)
    out["overlap"] = {"stats": [r[2] for r in rec], "backup": [t.clone() for t in b.backup],
                      "params": [p.detach().clone() for p in m.parameters()]}
    out["overlap"]["finalize_changed"] = b.finalize()
    out["overlap"]["final_stats"] = b.pop_step_stats()
    out["overlap"]["final"] = [p.detach().clone() for p in m.parameters()]
    return out


def _sc_resume(rank, world):
    out = {}
    for name, (cfg, n, k) in RESUME_CASES.items():
        m, opt, b = _make(cfg, rank, world)
        _train(m, opt, b, rank, range(n))
        full = [p.detach().clone() for p in m.parameters()]
        m, opt, b = _make(cfg, rank, world)
        _train(m, opt, b, rank, range(k))
        buf = io.BytesIO()
        torch.save({"model": m.state_dict(), "opt": opt.state_dict(), "dp": b.state_dict()}, buf)
        pending = len(getattr(b, "pending", {}))
        del m, opt, b
        buf.seek(0)
        st = torch.load(buf, weights_only=False)
        m, opt, b = _make(cfg, rank, world)
        m.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        b.load_state_dict(st["dp"])
        _train(m, opt, b, rank, range(k, n))
        out[name] = {"equal": all(torch.equal(a, p) for a, p in zip(full, m.parameters())),
                     "pending_at_save": pending}
    return out


def _sc_own_group(rank, world):
    """The DP sync's communicator runs on a process group of its own over the same ranks."""
    import torch.distributed as dist
    from ds_twocircuit.adapters.comm import TorchComm
    comm = dp_comm(None, world)
    assert isinstance(comm, TorchComm)
    t = torch.full((3,), float(rank + 1))
    comm.all_reduce_sum(t)
    big = torch.zeros(world * 4, dtype=torch.uint8)
    work = comm.all_gather_into(big, torch.full((4,), rank, dtype=torch.uint8), async_op=True)
    small = torch.ones(1)
    dist.all_reduce(small)                     # the engine's own collective, with the sync in flight
    work.wait()
    return {"distinct": comm.group is not None and comm.group != dist.group.WORLD,
            "ranks": dist.get_process_group_ranks(comm.group), "sum": t.tolist(), "small": small.item(),
            "gathered": big.tolist()}


def _sc_chunked(rank, world):
    """All-gathers and all-to-alls bigger than a piece go out in pieces and land as one would."""
    from ds_twocircuit.adapters import comm as comm_mod
    comm = dp_comm(None, world)
    old, comm_mod.CHUNK_BYTES = comm_mod.CHUNK_BYTES, 8
    try:
        t = (torch.arange(37, dtype=torch.int32) + 100 * rank).to(torch.uint8)
        gathered, gathered_async = torch.empty(world * 37, dtype=torch.uint8), torch.empty(world * 37, dtype=torch.uint8)
        assert comm.all_gather_into(gathered, t) is None
        work = comm.all_gather_into(gathered_async, t, async_op=True)
        work.get_future().wait()
        work.wait()
        rows = torch.stack([(torch.arange(37, dtype=torch.int32) + 100 * r).to(torch.uint8)
                            for r in range(world)])            # row j: for replica j
        src = rows + rank                                       # what this replica sends each
        got, got_async = torch.empty_like(src), torch.empty_like(src)
        assert comm.all_to_all_into(got, src) is None
        work = comm.all_to_all_into(got_async, src, async_op=True)
        work.wait()
    finally:
        comm_mod.CHUNK_BYTES = old
    return {"gathered": gathered.tolist(), "gathered_async": gathered_async.tolist(), "got": got.tolist(),
            "got_async": got_async.tolist()}


SCENARIOS = {"chunked": _sc_chunked, "own_group": _sc_own_group, "psgd_exact": _sc_psgd_exact, "psgd_bytes": _sc_psgd_bytes,
             "diloco_h1": _sc_diloco_h1, "diloco_drift": _sc_diloco_drift,
             "streaming": _sc_streaming, "resume": _sc_resume}


def _suite_worker(rank, world):
    import traceback
    results = {}
    for name, fn in SCENARIOS.items():
        try:
            results[name] = fn(rank, world)
        except Exception:  # stop: later collectives could mismatch across ranks
            results["_error"] = (name, traceback.format_exc())
            break
    return results


@pytest.fixture(scope="module")
def dist_suite(tmp_path_factory):
    return run_distributed(_suite_worker, 2, tmp_path_factory.mktemp("dp_suite"), timeout=150)


def _get(suite, name):
    for r, res in enumerate(suite):
        if name not in res:
            err = res.get("_error", ("?", "no error recorded"))
            pytest.fail(f"scenario {name} did not run on rank {r}; {err[0]} failed:\n{err[1]}")
    return [res[name] for res in suite]


# --------------------------------------------------------------------------------------------
# PowerSGD

@pytest.mark.parametrize("k", [1, 3, 4])
def test_powersgd_reconstructs_low_rank_world1(k):
    comp = PowerSGDCompressor({"matrix_approximation_rank": 4})
    mats = [_low_rank(32, 20, k, seed=k), _low_rank(12, 5 * 6, k, seed=k + 1).reshape(12, 5, 6)]
    outs = [t.clone() for t in mats]
    comp.reduce_mean_(outs, ["a", "conv"], Collective())
    for t, o in zip(mats, outs):
        assert o.shape == t.shape
        assert torch.allclose(o, t, atol=1e-4 * float(t.abs().max()), rtol=0)


def test_powersgd_full_rank_is_lossy_world1():
    comp = PowerSGDCompressor({"matrix_approximation_rank": 2})
    t = torch.randn(32, 20)
    out = t.clone()
    comp.reduce_mean_([out], ["a"], Collective())
    assert float((out - t).norm()) > 0.1 * float(t.norm())  # it really compressed
    assert torch.allclose(comp.error["a"], t - out, atol=1e-5)  # and remembered the rest


@pytest.mark.multiproc
def test_powersgd_reconstructs_low_rank_world2(dist_suite):
    r0, r1 = _get(dist_suite, "psgd_exact")
    for r in (r0, r1):
        assert r["err"] <= 1e-4 * r["scale"]
        assert r["bytes"] == wire.ring_allreduce_bytes(4 * 4 * (24 + 20), 2)


def _ef_run(use_ef, steps=100):
    comp = PowerSGDCompressor({"matrix_approximation_rank": 2, "use_error_feedback": use_ef})
    g = torch.Generator().manual_seed(3)
    mean = torch.randn(24, 16, generator=g)  # full rank: rank-2 drops a fixed part every step
    sum_true, sum_dec, gaps = torch.zeros(24, 16), torch.zeros(24, 16), []
    for _ in range(steps):
        grad = mean + 0.1 * torch.randn(24, 16, generator=g)
        out = grad.clone()
        comp.reduce_mean_([out], ["w"], Collective())
        sum_true += grad
        sum_dec += out
        gaps.append(float((sum_true - sum_dec).norm()))
    return comp, sum_true - sum_dec, gaps, float(mean.norm())


def test_error_feedback_tracks_running_sum():
    comp, gap, gaps, scale = _ef_run(True)
    assert torch.allclose(gap, comp.error["w"], atol=1e-3)  # gap == error buffer
    # bounded: plateaus (at ~5x the per-step gradient norm here) instead of growing
    assert max(gaps) < 8 * scale
    assert max(gaps[50:]) < 1.3 * max(gaps[:50])
    _, _, gaps_no_ef, _ = _ef_run(False)
    assert gaps_no_ef[-1] > 3.5 * gaps_no_ef[24]            # grows linearly (100 vs 25 steps)
    assert gaps_no_ef[-1] > 10 * max(gaps)


def test_min_compression_rate_selection():
    comp = PowerSGDCompressor({"matrix_approximation_rank": 4, "min_compression_rate": 2.0})
    assert comp.rank_for((100,)) == 0             # 1-D
    assert comp.rank_for(()) == 0                 # scalar
    assert comp.rank_for((4, 4)) == 0             # 16 / (4*8) < 2
    assert comp.rank_for((16, 16)) == 4           # 256 / 128 = 2
    assert comp.rank_for((15, 16)) == 0           # 240 / 124 < 2
    assert comp.rank_for((8, 3, 3, 3)) == 0       # 8x27: 216 / 140 < 2
    assert comp.rank_for((64, 3, 3, 3)) == 4      # 64x27: 1728 / 364
    assert PowerSGDCompressor({"matrix_approximation_rank": 2,
                               "min_compression_rate": 0.0}).rank_for((1, 1)) == 1


@pytest.mark.multiproc
def test_powersgd_byte_counts(dist_suite):
    for r in _get(dist_suite, "psgd_bytes"):
        n, m, rank = 64, 48, 4
        assert r["matrix"] == wire.ring_allreduce_bytes(4 * rank * (n + m), 2)
        assert r["matrix_wire"] == r["matrix"]
        # 1-D and too-small tensors go dense, coalesced per dtype (fp32 bucket + fp64 bucket)
        assert r["small"]["bytes_sent"] == (wire.ring_allreduce_bytes(4 * (48 + 16), 2)
                                            + wire.ring_allreduce_bytes(8 * 15, 2))
        assert r["small"]["collectives"] == 2
        assert r["dense"] == wire.ring_allreduce_bytes(4 * n * m, 2)
        st = r["backend_stats"]
        # toy model: 16x8 weight compressed at rank 2; 4x16 weight and biases dense
        assert st["bytes_sent"] == r["backend_wire"] == (
            wire.ring_allreduce_bytes(4 * (16 + 64 + 4), 2)
            + wire.ring_allreduce_bytes(4 * 2 * (16 + 8), 2))
        assert st["numel_sent"] == 16 + 64 + 4 + 2 * 24 and st["numel_dense"] == 212
    g0, g1 = (r["grads"] for r in _get(dist_suite, "psgd_bytes"))
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))  # identical update on both ranks


def test_world1_counts_zero_bytes():
    before = wire.totals()["dp"]
    m, opt, b = _make({"backend": "powersgd", "powersgd": PSGD2}, 0, 1)
    _train(m, opt, b, 0, range(2))
    assert wire.totals()["dp"] == before
    assert b.pop_step_stats()["bytes_sent"] == 0


def test_orthogonalize_qr_and_gram_schmidt():
    for eps in (0.0, 1e-8):
        m = torch.randn(20, 5)
        orthogonalize_(m, eps)
        assert torch.allclose(m.T @ m, torch.eye(5), atol=1e-4)
    z = torch.zeros(10, 3)  # rank-deficient input: must not produce NaN
    assert torch.isfinite(orthogonalize_(z.clone(), 0.0)).all()
    assert torch.isfinite(orthogonalize_(z.clone(), 1e-8)).all()


def test_powersgd_warmup_is_exact_dense():
    m, opt, b = _make({"backend": "powersgd", "powersgd": {"start_powerSGD_iter": 1}}, 0, 1)
    x, y = _batch(0, 0)
    F.mse_loss(m(x), y).backward()
    before = [p.grad.clone() for p in m.parameters()]
    b.reduce_gradients(0)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, m.parameters()))
    assert b.pop_step_stats()["dense"] is True


# --------------------------------------------------------------------------------------------
# DiLoCo / Streaming DiLoCo

@pytest.mark.multiproc
def test_diloco_h1_equals_synchronous_dp(dist_suite):
    for r in _get(dist_suite, "diloco_h1"):
        assert r["moved"] > 1e-3   # training did something
        assert r["diff"] <= 1e-6


@pytest.mark.multiproc
def test_diloco_replicas_identical_after_sync_and_drift_between(dist_suite):
    r0, r1 = _get(dist_suite, "diloco_drift")
    for s, (a, b) in enumerate(zip(r0["params"], r1["params"])):
        if s % 3 == 2:
            assert torch.equal(a, b), f"replicas differ right after the sync at step {s}"
            assert r0["stats"][s]["synced_fragments"] == [0]
            assert r0["stats"][s]["bytes_sent"] == wire.ring_allreduce_bytes(4 * a.numel(), 2)
        else:
            assert not torch.equal(a, b), f"replicas did not drift at step {s}"
            assert r0["stats"][s]["bytes_sent"] == 0
    assert all(torch.equal(a, b) for a, b in zip(r0["backup"], r1["backup"]))
    assert all(torch.equal(a, b) for a, b in zip(r0["momentum"], r1["momentum"]))


@pytest.mark.parametrize("H,F_", [(10, 4), (6, 3), (4, 4), (5, 1), (7, 2)])
def test_streaming_schedule_every_h_steps(H, F_):
    named = [(f"p{i}", nn.Parameter(torch.zeros(i + 1))) for i in range(6)]
    b = StreamingDiLoCo(named, None, {"inner_steps": H, "num_fragments": F_,
                                            "overlap": False})
    steps = 6 * H
    syncs = {f: [s for s in range(steps) if f in b.sync_schedule(s)] for f in range(F_)}
    for f, ss in syncs.items():
        assert ss[0] >= H - 1                      # at least H local steps before the first
        assert all(b2 - a == H for a, b2 in zip(ss, ss[1:]))
        assert len(ss) >= 5
    assert min(ss[0] for ss in syncs.values()) == H - 1
    if F_ > 1:
        assert all(len(b.sync_schedule(s)) <= 1 for s in range(steps))


@pytest.mark.multiproc
def test_streaming_fragment_syncs_two_ranks(dist_suite):
    r0, r1 = _get(dist_suite, "streaming")
    plain0, plain1 = r0["plain"], r1["plain"]
    frags = plain0["fragments"]
    assert len(frags) == 3 and sorted(i for f in frags for i in f) == list(range(4))
    launched = {f: [s for s, st in enumerate(plain0["stats"]) if f in st["synced_fragments"]]
                for f in range(3)}
    assert launched == {0: [5, 11, 17], 1: [7, 13, 19], 2: [9, 15]}
    for s, (a, b) in enumerate(zip(plain0["params"], plain1["params"])):
        synced = plain0["stats"][s]["synced_fragments"]
        for f in synced:  # the synced fragment is identical on both ranks ...
            assert all(torch.equal(a[i], b[i]) for i in frags[f])
        if s >= 1:  # ... but never the whole model
            assert not all(torch.equal(x, y) for x, y in zip(a, b))
    ov0, ov1 = r0["overlap"], r1["overlap"]
    launched = [st["synced_fragments"] for st in ov0["stats"]]
    completed = [st["completed_fragments"] for st in ov0["stats"]]
    assert [s for s, x in enumerate(launched) if x] == [3, 5, 7, 9, 11]
    assert [s for s, x in enumerate(completed) if x] == [4, 6, 8, 10]  # tau = 1 step later
    assert all(torch.equal(a, b) for a, b in zip(ov0["backup"], ov1["backup"]))
    assert not all(torch.equal(a, b) for a, b in zip(ov0["params"], ov1["params"]))  # merged
    comm = sum(st["comm_s"] for st in ov0["stats"])
    hidden = sum(st["hidden_comm_s"] for st in ov0["stats"])
    assert 0 < hidden <= comm + 1e-9


@pytest.mark.multiproc
def test_streaming_finalize_syncs_only_drifted_fragments(dist_suite):
    r0, r1 = _get(dist_suite, "streaming")
    p0, p1 = r0["plain"], r1["plain"]
    frags = p0["fragments"]
    # 20 steps, H=6, F=3: fragment 1 synced after the last step (19), fragments 0 (17) and 2 (15)
    # took local steps since: only those two are averaged again (uncompressed, as in this run)
    assert p0["finalize_changed"] is True
    assert p0["final_stats"]["final_synced_fragments"] == [0, 2]
    frag_bytes = {f: p0["stats"][s]["bytes_sent"] for f, s in ((0, 17), (2, 15))}
    assert p0["final_stats"]["bytes_sent"] == frag_bytes[0] + frag_bytes[2]
    assert p0["final_stats"]["bytes_sent"] < sum(st["bytes_sent"] for st in p0["stats"][12:18])
    for i in frags[1]:   # untouched by finalize
        assert torch.equal(p0["final"][i], p0["params"][-1][i])
    assert all(torch.equal(a, b) for a, b in zip(p0["final"], p1["final"]))   # replicas agree
    # the last sync is an exact average (no compression, no outer step)
    for f in (0, 2):
        for i in frags[f]:
            mean = (p0["params"][-1][i] + p1["params"][-1][i]) / 2
            assert torch.allclose(p0["final"][i], mean, atol=1e-6), (f, i)
            assert not torch.allclose(p0["final"][i], p0["params"][-1][i], atol=1e-6)
    assert all(torch.equal(a, b.to(a.dtype)) for a, b in zip(p0["final"], p0["final_backup"]))
    # overlap: the in-flight sync is finished (merged), then every fragment is synced once more
    o0, o1 = r0["overlap"], r1["overlap"]
    assert o0["final_stats"]["completed_fragments"] == [0]
    assert o0["final_stats"]["final_synced_fragments"] == [0, 1]
    assert all(torch.equal(a, b) for a, b in zip(o0["final"], o1["final"]))


def test_split_fragments_balanced_contiguous():
    assert split_fragments([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert split_fragments([100, 1, 1, 1, 100], 2) in ([[0, 1, 2], [3, 4]], [[0, 1], [2, 3, 4]])
    assert split_fragments([1, 1, 1], 3) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="twocircuit.dp.num_fragments"):
        split_fragments([1, 1], 3)


def test_stage_without_trainable_params():
    frozen = nn.Parameter(torch.ones(3), requires_grad=False)
    for cfg in ({"backend": "streaming_diloco", "inner_steps": 2, "num_fragments": 2,
                 "overlap": False}, {"backend": "diloco", "inner_steps": 2},
                {"backend": "powersgd"}, {"backend": "allreduce"}):
        b = build_backend([("frozen", frozen)], None, cfg)
        for s in range(4):
            b.reduce_gradients(s)
            b.after_optimizer_step(s)
        b.load_state_dict(b.state_dict())
        assert torch.equal(frozen, torch.ones(3)) and b.names == []


def test_diloco_reset_backup():
    p = nn.Parameter(torch.zeros(4))
    b = get_backend("diloco")([("p", p)], None, {"inner_steps": 2})
    with torch.no_grad():
        p.add_(1.0)
    b.after_optimizer_step(0)
    b.after_optimizer_step(1)  # outer step: p moves 0.7 + nesterov 0.63 of the way
    assert torch.allclose(p, torch.full((4,), 0.7 * 1.9)) and b.momentum[0].abs().sum() > 0
    with torch.no_grad():
        p.fill_(5.0)
    b.reset_backup()
    assert torch.equal(b.backup[0], p.detach()) and b.momentum[0].abs().sum() == 0


def test_streaming_explicit_fragments():
    named = [(f"p{i}", nn.Parameter(torch.zeros(2))) for i in range(4)]
    cfg = {"inner_steps": 4, "num_fragments": 2, "overlap": False}
    b = StreamingDiLoCo(named, None, cfg, fragments=[["p0", "p3"], ["p1", "p2"]])
    assert b.fragments == [[0, 3], [1, 2]]
    with pytest.raises(ValueError, match="num_fragments"):
        StreamingDiLoCo(named, None, cfg, fragments=[["p0", "p3"], ["p1"]])


def test_diloco_outer_nesterov_matches_torch_sgd():
    p = nn.Parameter(torch.zeros(5))
    b = get_backend("diloco")([("p", p)], None, {"inner_steps": 2})
    ref = nn.Parameter(torch.zeros(5))
    outer = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    g = torch.Generator().manual_seed(0)
    for s in range(8):
        with torch.no_grad():
            p.add_(torch.randn(5, generator=g))  # a local inner step
        if s % 2 == 1:
            ref.grad = (ref - p).detach().clone()
            outer.step()
        b.after_optimizer_step(s)
        if s % 2 == 1:
            assert torch.allclose(p, ref, atol=1e-6)


@pytest.mark.multiproc
def test_big_collectives_go_out_in_pieces_and_land_whole(dist_suite):
    """37 bytes in pieces of 8: every replica gets every replica's bytes in rank order (all-gather),
    and row i of what it receives is what replica i sent it (all-to-all), blocking or not."""
    res = _get(dist_suite, "chunked")
    payload = [[(k + 100 * r) % 256 for k in range(37)] for r in range(2)]
    for rank, r in enumerate(res):
        assert r["gathered"] == r["gathered_async"] == payload[0] + payload[1]
        expect = [[(k + 100 * rank + i) % 256 for k in range(37)] for i in range(2)]
        assert r["got"] == r["got_async"] == expect


@pytest.mark.multiproc
def test_the_dp_sync_has_a_process_group_of_its_own(dist_suite):
    """Its own connections: the engine's per-step collectives on the DP group (DeepSpeed's loss
    all-reduce) do not queue behind a sync in flight, as they did on a capped link (a 40 s stall
    after each launch at 7.17 Mbit/s, docs/benchmarks/table1.md)."""
    for r in _get(dist_suite, "own_group"):
        assert r["distinct"] and r["ranks"] == [0, 1]
        assert r["sum"] == [3.0, 3.0, 3.0] and r["small"] == 2.0
        assert r["gathered"] == [0] * 4 + [1] * 4


@pytest.mark.multiproc
def test_resume_is_bitwise_identical(dist_suite):
    res = _get(dist_suite, "resume")
    for name in RESUME_CASES:
        for r in res:
            assert r[name]["equal"], f"{name}: resumed run diverged from the uninterrupted one"
    assert res[0]["streaming_overlap"]["pending_at_save"] == 1
    assert res[0]["streaming_quant_overlap"]["pending_at_save"] == 1
    assert res[0]["streaming_quant_rs_overlap"]["pending_at_save"] == 2
    assert res[0]["streaming_powersgd_overlap"]["pending_at_save"] == 1
    assert res[0]["streaming_powersgd_delayed_q_in_flight"]["pending_at_save"] == 1


def test_state_dict_contains_everything():
    m, opt, b = _make({"backend": "streaming_diloco", "inner_steps": 4, "num_fragments": 2,
                       "compression": "powersgd", "powersgd": PSGD2}, 0, 1)
    _train(m, opt, b, 0, range(6))  # fragment 0 synced (3 -> 4), fragment 1 in flight (5 -> 6)
    sd = b.state_dict()
    assert {"backup", "momentum", "compressor", "fragments", "last_step", "pending"} <= set(sd)
    assert sd["last_step"] == 5 and [p["fragment"] for p in sd["pending"]] == [1]
    assert set(sd["compressor"]["error"]) and set(sd["compressor"]["q"])
    with pytest.raises(ValueError, match="backend"):
        get_backend("diloco")(list(m.named_parameters()), None, {}).load_state_dict(sd)


# --------------------------------------------------------------------------------------------
# NaN/inf guard

class _RecordingComm(Communicator):
    """Two replicas without a real group: any collective is recorded (and not performed)."""

    world_size, rank = 2, 0

    def __init__(self):
        self.calls = []

    def all_reduce_sum(self, t, async_op=False):
        self.calls.append(t)


@pytest.fixture
def fake_dp_world():
    return _RecordingComm()


@pytest.mark.parametrize("cfg", [{"backend": "allreduce"},
                                 {"backend": "powersgd", "powersgd": {"start_powerSGD_iter": 0}},
                                 {"backend": "powersgd"}])
def test_nan_guard_gradients(fake_dp_world, cfg):
    m = _toy_model()
    b = build_backend(list(m.named_parameters()), fake_dp_world, cfg)
    x, y = _batch(0, 0)
    F.mse_loss(m(x), y).backward()
    m[2].weight.grad[1, 3] = float("nan")
    before = wire.totals()["dp"]
    with pytest.raises(NonFiniteGradientError, match=r"step 7 .*'2\.weight'") as ei:
        b.reduce_gradients(7)
    assert ei.value.step == 7 and ei.value.param_name == "2.weight"
    assert fake_dp_world.calls == [] and wire.totals()["dp"] == before


@pytest.mark.parametrize("backend", ["diloco", "streaming_diloco"])
def test_nan_guard_pseudo_gradients(fake_dp_world, backend):
    m = _toy_model()
    cfg = {"backend": backend, "inner_steps": 2}
    if backend == "streaming_diloco":
        cfg.update(num_fragments=1, overlap=False)
    b = build_backend(list(m.named_parameters()), fake_dp_world, cfg)
    with torch.no_grad():
        m[0].bias[2] = float("inf")
    b.after_optimizer_step(0)  # not due
    with pytest.raises(NonFiniteGradientError, match=r"pseudo-gradient at step 1 .*'0\.bias'"):
        b.after_optimizer_step(1)
    assert fake_dp_world.calls == []


# --------------------------------------------------------------------------------------------
# config and registry

def test_config_defaults():
    assert config_from_dict({}) == config_from_dict(None) == AllReduceConfig()
    assert config_from_dict({}).to_dict() == {"backend": "allreduce"}
    assert config_from_dict({"backend": "powersgd"}).powersgd == PowerSGDConfig(
        64, 10, 2.0, True, True, 0.0, 0)
    c = config_from_dict({"backend": "streaming_diloco"})
    assert type(c) is StreamingDiLoCoConfig and c.backend == "streaming_diloco"
    assert c.inner_steps == 10 and c.outer_lr == 0.7
    assert c.outer_momentum == 0.9 and c.nesterov and c.num_fragments == 4 and c.overlap
    assert c.overlap_steps == 1 and c.merge_alpha == 0.5 and c.compression is None
    assert c.merge_rule == "mix"
    assert c.powersgd == PowerSGDConfig(64, 10, 2.0, True, True, 0.0, 0)
    d = config_from_dict({"backend": "diloco"})
    assert type(d) is DiLoCoConfig and d == DiLoCoConfig() and not hasattr(d, "num_fragments")


@pytest.mark.parametrize("d,key", [
    ({"bogus": 1}, "twocircuit.dp.bogus"),
    ({"backend": "powersgd", "powersgd": {"rank": 4}}, "twocircuit.dp.powersgd.rank"),
    ({"backend": "diloco", "inner_steps": 0}, "twocircuit.dp.inner_steps"),
    ({"backend": "diloco", "inner_steps": True}, "twocircuit.dp.inner_steps"),
    ({"backend": "diloco", "outer_momentum": 1.0}, "twocircuit.dp.outer_momentum"),
    ({"backend": "diloco", "outer_lr": "0.7"}, "twocircuit.dp.outer_lr"),
    ({"backend": "powersgd", "powersgd": {"matrix_approximation_rank": 0}},
     "twocircuit.dp.powersgd.matrix_approximation_rank"),
    ({"backend": "allreduce", "inner_steps": 5}, "twocircuit.dp.inner_steps"),
    ({"backend": "diloco", "num_fragments": 2}, "twocircuit.dp.num_fragments"),
    ({"backend": "diloco", "powersgd": {}}, "twocircuit.dp.powersgd"),
    ({"backend": "diloco", "compression": "topk"}, "twocircuit.dp.compression"),
    ({"backend": "diloco", "quant": {"bits": 4}}, "twocircuit.dp.quant"),
    ({"backend": "diloco", "compression": "quant", "quant": {"bits": 5}}, "twocircuit.dp.quant.bits"),
    ({"backend": "diloco", "compression": "quant", "quant": {"block": 12}}, "twocircuit.dp.quant.block"),
    ({"backend": "diloco", "compression": "quant", "quant": {"scale": 1}}, "twocircuit.dp.quant.scale"),
    ({"backend": "diloco", "compression": "quant", "quant": {"collective": "ring"}},
     "twocircuit.dp.quant.collective"),
    ({"backend": "streaming_diloco", "inner_steps": 2, "num_fragments": 3},
     "twocircuit.dp.num_fragments"),
    ({"backend": "streaming_diloco", "overlap": False, "merge_alpha": 0.3},
     "twocircuit.dp.merge_alpha"),
    ({"backend": "streaming_diloco", "inner_steps": 4, "overlap_steps": 4},
     "twocircuit.dp.overlap_steps"),
    ({"backend": "streaming_diloco", "merge_alpha": 1.5}, "twocircuit.dp.merge_alpha"),
    ({"backend": "streaming_diloco", "merge_rule": "average"}, "twocircuit.dp.merge_rule"),
    ({"backend": "streaming_diloco", "overlap": False, "merge_rule": "delayed"},
     "twocircuit.dp.merge_rule"),
    ({"backend": "streaming_diloco", "merge_rule": "delayed", "merge_alpha": 0.5},
     "twocircuit.dp.merge_alpha"),
    ({"backend": "diloco", "final_outer_lr": 0}, "twocircuit.dp.final_outer_lr"),
    ({"backend": "streaming_diloco", "final_outer_lr": "1.5"}, "twocircuit.dp.final_outer_lr"),
    ({"backend": "diloco", "inner_lr_scale": 0}, "twocircuit.dp.inner_lr_scale"),
    ({"backend": "diloco", "inner_lr_scale": "sqrt"}, "twocircuit.dp.inner_lr_scale"),
    ({"backend": "streaming_diloco", "inner_lr_scale": True}, "twocircuit.dp.inner_lr_scale"),
    ({"backend": "powersgd", "inner_lr_scale": "sqrt_replicas"}, "twocircuit.dp.inner_lr_scale"),
    ({"backend": "nope"}, "twocircuit.dp.backend"),
])
def test_config_refuses_bad_keys(d, key):
    with pytest.raises(ValueError) as ei:
        config_from_dict(d)
    assert key in str(ei.value)


def test_config_unknown_key_lists_allowed_and_custom_prefix():
    with pytest.raises(ValueError, match="allowed keys under x.y: .*inner_steps"):
        config_from_dict({"sync_every": 3}, prefix="x.y")


def test_backend_refuses_other_backend_config():
    m = _toy_model()
    with pytest.raises(ValueError, match="twocircuit.dp.backend"):
        get_backend("diloco")(list(m.named_parameters()), None, {"backend": "powersgd"})


def test_registry_builtins_unknown_and_third_party():
    assert registry.available_backends()[:4] == ("allreduce", "powersgd", "diloco",
                                                 "streaming_diloco")
    assert [get_backend(n).replicas_may_differ for n in registry.BUILTIN_BACKENDS] == [
        False, False, True, True]
    with pytest.raises(ValueError, match="twocircuit.dp.backend.*allreduce, powersgd"):
        get_backend("nope")

    @registry.register_backend("test_halving")
    class Halving(DPBackend):  # no config class: the default holds one free-form "options" object
        def reduce_gradients(self, step):
            for g in self._grads():
                g.mul_(self.cfg.options.get("factor", 0.5))

    try:
        assert "test_halving" in registry.available_backends()
        p = nn.Parameter(torch.ones(3))
        p.grad = torch.ones(3)
        b = build_backend([("p", p)], None, {"backend": "test_halving",
                                                   "options": {"factor": 0.25}})
        b.reduce_gradients(0)
        assert torch.equal(p.grad, torch.full((3,), 0.25))
        assert type(b.cfg) is OptionsConfig and b.cfg.backend == "test_halving"
        with pytest.raises(ConfigError, match=r"twocircuit\.dp\.inner_steps is not used by twocircuit"
                                              r"\.dp\.backend='test_halving' \(keys it uses: options\)"):
            config_from_dict({"backend": "test_halving", "inner_steps": 2})
        with pytest.raises(ValueError, match="already registered"):
            registry.register_backend("test_halving")(type("Other", (DPBackend,), {}))
    finally:
        registry._REGISTRY.pop("test_halving", None)


# a key of each other built-in backend: its own class refuses it, named, with the backend
FOREIGN = {"allreduce": ("powersgd", "inner_steps", "num_fragments"),
           "powersgd": ("inner_steps", "compression", "overlap"),
           "diloco": ("num_fragments", "overlap_steps", "merge_alpha", "merge_rule", "options"),
           "streaming_diloco": ("options",)}


@pytest.mark.parametrize("backend,foreign", [(b, k) for b, ks in FOREIGN.items() for k in ks])
def test_each_backend_config_refuses_another_backends_key(backend, foreign):
    cls = get_backend(backend).config_class
    assert foreign not in cls.keys()
    value = {"powersgd": {}, "options": {}, "compression": "powersgd", "overlap": True}.get(foreign, 2)
    d = {"backend": backend, foreign: value}
    for parse in (cls.from_dict, config_from_dict,
                  lambda d: TwoCircuitConfig.from_dict({"dp": d}).dp):
        with pytest.raises(ConfigError) as ei:
            parse(d)
        msg = str(ei.value)
        assert msg.startswith(f"twocircuit.dp.{foreign} is not used by twocircuit.dp.backend={backend!r}")
        assert "remove it" in msg
    with pytest.raises(ConfigError, match=foreign):    # a backend built directly from a dict too
        get_backend(backend)([("p", nn.Parameter(torch.zeros(2)))], None, {foreign: value})


def test_backend_configs_own_their_keys():
    """No class holds another backend's fields; the DP section lists the backend and its keys."""
    assert AllReduceConfig.keys() == frozenset()
    assert PowerSGDBackendConfig.keys() == {"powersgd"}
    assert DiLoCoConfig.keys() == {"inner_steps", "outer_lr", "outer_momentum", "nesterov",
                                   "compression", "powersgd", "quant", "final_outer_lr",
                                   "inner_lr_scale"}
    assert StreamingDiLoCoConfig.keys() == DiLoCoConfig.keys() | {"num_fragments", "overlap",
                                                                  "overlap_steps", "merge_alpha",
                                                                  "merge_rule"}
    assert OptionsConfig.keys() == {"options"}
    for name in registry.BUILTIN_BACKENDS:
        cls = get_backend(name).config_class
        assert cls.own_backend() == name and cls().backend == name
        assert set(cls().to_dict()) == {"backend"} | cls.keys()
    with pytest.raises(ConfigError, match=r"twocircuit\.dp\.backend is 'powersgd' but DiLoCoConfig"):
        DiLoCoConfig.from_dict({"backend": "powersgd"})
    with pytest.raises(ConfigError, match="reads a StreamingDiLoCoConfig, got a DiLoCoConfig"):
        StreamingDiLoCo([("p", nn.Parameter(torch.zeros(2)))], None,
                        DiLoCoConfig(backend="streaming_diloco"))


def test_sync_schedule_lives_with_each_backend_config():
    assert AllReduceConfig().sync_schedule() == (1, 1, 0)
    assert PowerSGDBackendConfig().sync_schedule() == (1, 1, 0)
    assert DiLoCoConfig(inner_steps=6).sync_schedule() == (6, 6, 0)
    assert StreamingDiLoCoConfig(inner_steps=8).sync_schedule() == (8, 2, 1)
    assert StreamingDiLoCoConfig(inner_steps=8, overlap=False).sync_schedule() == (8, 2, 0)


@dataclass(frozen=True)
class _EveryKConfig(BackendConfig):
    """A third party's own settings: one ranged key, one contradiction rule."""
    backend: str = "test_every_k"
    every: int = setting(2, check=int_in(1, 100))
    scale: float = 1.0   # no check given: its type is still checked

    def check_consistency(self, given, prefix):
        if self.every > 50 and "scale" not in given:
            raise ConfigError(f"{prefix}.every > 50 needs {prefix}.scale")


def test_third_party_config_class_validates_through_the_entry_point():
    @registry.register_backend("test_every_k")
    class EveryK(DPBackend):
        config_class = _EveryKConfig

        def reduce_gradients(self, step):
            if step % self.cfg.every == 0:
                for g in self._grads():
                    g.mul_(self.cfg.scale)

    try:
        assert "every" in registry.known_keys()
        c = TwoCircuitConfig.from_dict({"dp": {"backend": "test_every_k", "every": 3}}).dp
        assert c == _EveryKConfig(every=3) and c.to_dict() == {"backend": "test_every_k", "every": 3,
                                                               "scale": 1.0}
        for d, msg in [({"every": 0}, r"twocircuit\.dp\.every = 0 is outside the allowed range \[1, 100\]"),
                       ({"scale": "x"}, r"twocircuit\.dp\.scale must be a number, got 'x'"),
                       ({"every": 60}, r"twocircuit\.dp\.every > 50 needs twocircuit\.dp\.scale"),
                       ({"inner_steps": 3}, r"twocircuit\.dp\.inner_steps is not used by twocircuit\.dp"
                                            r"\.backend='test_every_k' \(keys it uses: every, scale\)"),
                       ({"evry": 3},
                        r"unknown key twocircuit\.dp\.evry; allowed keys under twocircuit\.dp:")]:
            with pytest.raises(ConfigError, match=msg):
                TwoCircuitConfig.from_dict({"dp": {"backend": "test_every_k", **d}})
        p = nn.Parameter(torch.ones(3))
        p.grad = torch.ones(3)
        b = build_backend([("p", p)], None, {"backend": "test_every_k", "every": 1, "scale": 0.5})
        b.reduce_gradients(0)
        assert torch.equal(p.grad, torch.full((3,), 0.5)) and b.cfg.scale == 0.5
        with pytest.raises(ValueError, match="config_class must be a subclass"):
            registry.register_backend("test_bad_config")(type("Bad", (DPBackend,), {"config_class": dict}))
        with pytest.raises(ValueError, match="is for backend 'test_every_k'"):
            registry.register_backend("test_other")(type("Other", (DPBackend,),
                                                         {"config_class": _EveryKConfig}))
    finally:
        for n in ("test_every_k", "test_bad_config", "test_other"):
            registry._REGISTRY.pop(n, None)


@pytest.mark.parametrize("backend,run,message", [
    ("diloco", RunSettings(zero_stage=1), r"^c\.json: twocircuit\.dp\.backend = 'diloco' keeps replicas "
                                          r"apart between syncs; zero_optimization\.stage = 1 re-syncs"),
    ("streaming_diloco", RunSettings(fp16=True), r"^c\.json: twocircuit\.dp\.backend = 'streaming_diloco' "
                                                 r"cannot run with fp16\.enabled"),
    ("diloco", RunSettings(bf16=True, pp=2), r"bf16\.enabled under pipeline parallelism"),
    ("streaming_diloco", RunSettings(pp=2, tied_embeddings="sync", model_tied=True),
     r"tied_embeddings = 'sync' would sync the two copies"),
])
def test_backend_refuses_deepspeed_settings_it_cannot_run_with(backend, run, message):
    cfg = config_from_dict({"backend": backend})
    with pytest.raises(ConfigError, match=message):
        cfg.check_run(run, where="c.json")


@pytest.mark.parametrize("backend,run", [
    ("diloco", RunSettings(bf16=True, pp=1)),                    # bf16 without a pipeline
    ("diloco", RunSettings(pp=2, tied_embeddings="sync", model_tied=True)),  # one fragment: one sync
    ("streaming_diloco", RunSettings(pp=1, tied_embeddings="sync", model_tied=True)),
    ("streaming_diloco", RunSettings(pp=2, tied_embeddings="untie", model_tied=True)),
    ("powersgd", RunSettings(1, True, True, 2, "sync", True)),   # nothing they cannot run with
    ("allreduce", RunSettings(1, True, True, 2, "sync", True)),
])
def test_backend_accepts_settings_it_can_run_with(backend, run):
    config_from_dict({"backend": backend}).check_run(run)


def test_run_settings_from_a_deepspeed_json():
    ds = {"zero_optimization": {"stage": 1}, "fp16": {"enabled": True}, "bf16": {"enabled": False}}
    assert RunSettings.from_ds_config(ds, pp=2, tied_embeddings="sync", model_tied=True) == RunSettings(
        zero_stage=1, fp16=True, bf16=False, pp=2, tied_embeddings="sync", model_tied=True)
    assert RunSettings.from_ds_config({}) == RunSettings()
    with pytest.raises(ConfigError, match="zero_optimization.stage = 1"):
        config_from_dict({"backend": "diloco"}).check_deepspeed(ds, pp=1)


def test_powersgd_config_is_checked_in_compressor():
    with pytest.raises(ValueError, match="matrix_approximation_rank"):
        PowerSGDCompressor({"matrix_approximation_rank": -1})
    assert math.isclose(PowerSGDCompressor().cfg.min_compression_rate, 2.0)


def test_replicas_in_sync_follows_the_diloco_schedule(fake_dp_world):
    m = _toy_model()
    b = build_backend(list(m.named_parameters()), fake_dp_world, {"backend": "diloco", "inner_steps": 2})
    assert b.replicas_in_sync()                       # identical start
    b.after_optimizer_step(0)                         # a local step, no sync due: replicas drift
    assert not b.replicas_in_sync()
    assert build_backend(list(m.named_parameters()), fake_dp_world, {"backend": "allreduce"}).replicas_in_sync()
    assert build_backend(list(m.named_parameters()), None, {"backend": "diloco"}).replicas_in_sync()


def test_merge_replica_states_averages_what_each_replica_owes():
    """A resume on another DP width: Streaming DiLoCo keeps the agreed state of the first replica,
    drops the syncs in flight (their progress is in the averaged weights) and averages the error
    buffers, which hold each fragment's last completed round's residual, still owed."""
    from ds_twocircuit.dp.diloco import StreamingDiLoCo
    from ds_twocircuit.dp.powersgd import PowerSGD

    def state(e, backup):
        return {"backend": "streaming_diloco", "names": ["a", "b"], "backup": [torch.full((2,), backup)],
                "momentum": None, "fragments": [["a"], ["b"]], "inner_steps": 4, "last_step": 5,
                "pending": [{"fragment": 1, "launched": 5, "due": 6, "round": None}], "dirty": [False, True],
                "compressor": {"error": {"a": torch.full((2, 2), e), "b": torch.full((2, 2), 3 * e)},
                               "q": {"a": torch.ones(2, 1)}, "rounds": 7}}
    merged = StreamingDiLoCo.merge_replica_states([state(1.0, 5.0), state(3.0, 5.0)])
    assert merged["pending"] == [] and merged["dirty"] == [True, True] and merged["last_step"] == 5
    assert torch.equal(merged["compressor"]["error"]["a"], torch.full((2, 2), 2.0))
    assert torch.equal(merged["compressor"]["error"]["b"], torch.full((2, 2), 6.0))   # not reset
    assert merged["compressor"]["rounds"] == 7 and torch.equal(merged["backup"][0], torch.full((2,), 5.0))
    p = PowerSGD.merge_replica_states([{"backend": "powersgd", "compressor": {"error": {"a": torch.zeros(1)}, "q": {}, "rounds": 1}},
                                              {"backend": "powersgd", "compressor": {"error": {"a": torch.ones(1)}, "q": {}, "rounds": 1}}])
    assert torch.equal(p["compressor"]["error"]["a"], torch.tensor([0.5]))


# --------------------------------------------------------------------------------------------
# quantised pseudo-gradients (compression "quant"), two replicas in one process

def _in_process(world):
    from ds_twocircuit.engines.reference import InProcessGroup, run_replicas
    group = InProcessGroup(world)
    return group, run_replicas


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_quantized_mean_is_the_same_average_on_every_replica(bits):
    """Each replica decodes every replica's payload in rank order: identical results, equal to the
    mean of the dequantised inputs, within the quantiser's step of the exact mean; the bytes are a
    ring all-gather of the payload (values at ``bits`` plus a bf16 scale per block)."""
    from ds_twocircuit.dp.quantmean import QuantConfig, QuantizedMean, decode, encode
    cfg = QuantConfig(bits=bits, block=16)
    world = 2
    group, run_replicas = _in_process(world)
    inputs = [[torch.randn(7, 9, generator=torch.Generator().manual_seed(10 * r + i)) for i in range(2)]
              for r in range(world)]
    errors = [[torch.zeros_like(t) for t in ts] for ts in inputs]

    def replica(r):
        comm = Collective(group.comm(r))
        ts = [t.clone() for t in inputs[r]]
        QuantizedMean(ts, comm, cfg, errors=errors[r]).finish()
        return ts, comm.pop_stats()["bytes_sent"]
    out = run_replicas(group, replica, world)
    (a, bytes_a), (b, bytes_b) = out
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    flat = [torch.cat([t.reshape(-1) for t in ts]) for ts in inputs]
    decoded = [decode(encode(f, cfg), f.numel(), cfg) for f in flat]
    mean = (decoded[0] + decoded[1]) / 2
    assert torch.equal(torch.cat([t.reshape(-1) for t in a]), mean)
    exact = (flat[0] + flat[1]) / 2
    step = max(f.abs().max() for f in flat) / ((1 << (bits - 1)) - 1)
    assert float((torch.cat([t.reshape(-1) for t in a]) - exact).abs().max()) <= float(step) / 2 + 1e-6
    n = 2 * 7 * 9
    assert bytes_a == bytes_b == (world - 1) * cfg.payload_bytes(n) == -(-n // 16) * (16 * bits // 8 + 2)
    for r in range(world):    # the residual is what the replica meant to send minus what it sent
        assert torch.allclose(torch.cat([e.reshape(-1) for e in errors[r]]), flat[r] - decoded[r], atol=0)


def test_quantized_mean_error_feedback_loses_nothing():
    """Over many rounds the decoded values a replica sent plus its last residual add up to the
    values it was asked to send (error feedback delays the quantisation error, never drops it)."""
    from ds_twocircuit.dp.quantmean import QuantConfig, QuantizedMean, decode, encode
    cfg = QuantConfig(bits=2, block=8)
    comm = Collective(None)
    err = [torch.zeros(40)]
    sent_total, asked_total = torch.zeros(40), torch.zeros(40)
    g = torch.Generator().manual_seed(3)
    for _ in range(25):
        x = torch.randn(40, generator=g)
        asked_total += x
        t = x.clone()
        before = err[0].clone()
        QuantizedMean([t], comm, cfg, errors=err).finish()
        assert torch.equal(t, decode(encode(x + before, cfg), 40, cfg))   # one replica: the mean is its own decode
        sent_total += t
    assert torch.allclose(sent_total + err[0], asked_total, atol=1e-4)
    assert float(err[0].abs().max()) < 2.0                     # the residual stays bounded


@pytest.mark.parametrize("world", [2, 3, 4])
def test_quantized_reduce_scatter_mean_agrees_everywhere_and_sends_allreduce_shaped_bytes(world):
    """``"collective": "reduce_scatter"``: every replica ends with the same values, within two
    quantiser steps of the exact mean (each chunk is rounded, averaged and rounded again), equal to
    decoding the owners' re-quantised means; each replica sends ``2 (world - 1)`` chunk payloads (an
    all-to-all, then an all-gather), where the all-gather sends ``world - 1`` full payloads."""
    from ds_twocircuit.dp.quantmean import QuantConfig, QuantizedReduceScatterMean, decode, encode
    cfg = QuantConfig(bits=4, block=16, collective="reduce_scatter")
    group, run_replicas = _in_process(world)
    inputs = [[torch.randn(7, 9, generator=torch.Generator().manual_seed(10 * r + i)) for i in range(2)]
              for r in range(world)]
    n = 2 * 7 * 9
    chunk = cfg.chunk_numel(n, world)
    assert chunk % 16 == 0 and world * chunk >= n > world * (chunk - 16)
    errors = [[torch.zeros_like(t) for t in ts] for ts in inputs]
    owners = [torch.zeros(chunk) for _ in range(world)]

    def replica(r):
        comm = Collective(group.comm(r))
        ts = [t.clone() for t in inputs[r]]
        rnd = QuantizedReduceScatterMean(ts, comm, cfg, errors=errors[r], owner_error=owners[r], async_op=True)
        rnd.launch_q()
        rnd.finish()
        return ts, comm.pop_stats()["bytes_sent"]
    out = run_replicas(group, replica, world)
    got = [torch.cat([t.reshape(-1) for t in ts]) for ts, _ in out]
    assert all(torch.equal(got[0], g) for g in got[1:])
    flat = [torch.cat([t.reshape(-1) for t in ts]) for ts in inputs]
    exact = sum(flat) / world
    padded = [torch.cat([f, torch.zeros(world * chunk - n)]).view(world, chunk) for f in flat]
    means = [sum(decode(encode(p[j], cfg), chunk, cfg) for p in padded) / world for j in range(world)]
    expect = torch.cat([decode(encode(m, cfg), chunk, cfg) for m in means])[:n]
    assert torch.allclose(got[0], expect, atol=1e-6)
    step = max(f.abs().max() for f in flat) / 7
    assert float((got[0] - exact).abs().max()) <= float(step) + 1e-6
    assert float((got[0] - exact).abs().max()) > 0                          # it is quantised
    payload = cfg.payload_bytes(chunk)
    assert all(b == 2 * (world - 1) * payload == cfg.sync_bytes(n, world) for _, b in out)
    full = QuantConfig(bits=4, block=16)
    assert full.sync_bytes(n, world) == (world - 1) * full.payload_bytes(n)
    # residuals: each replica's own first rounding, and each owner's second rounding of its chunk
    for r in range(world):
        sent = torch.cat([decode(encode(c, cfg), chunk, cfg) for c in padded[r]])[:n]
        assert torch.allclose(torch.cat([e.reshape(-1) for e in errors[r]]), flat[r] - sent, atol=1e-6)
        assert torch.allclose(owners[r], means[r] - decode(encode(means[r], cfg), chunk, cfg), atol=1e-6)


def test_quantized_reduce_scatter_owner_error_feedback_loses_nothing():
    """Over many rounds on one value stream per replica, the decoded means plus the replicas' and
    owners' residuals add up to the exact means: both roundings are delayed, not dropped."""
    from ds_twocircuit.dp.quantmean import QuantConfig, QuantizedReduceScatterMean
    cfg = QuantConfig(bits=2, block=8, collective="reduce_scatter")
    world, n = 3, 40
    group, run_replicas = _in_process(world)
    chunk = cfg.chunk_numel(n, world)
    errs = [[torch.zeros(n)] for _ in range(world)]
    owners = [torch.zeros(chunk) for _ in range(world)]
    gens = [torch.Generator().manual_seed(7 + r) for r in range(world)]
    got_total, exact_total = torch.zeros(n), torch.zeros(n)
    for _ in range(20):
        xs = [torch.randn(n, generator=g) for g in gens]
        exact_total += sum(xs) / world

        def replica(r):
            t = xs[r].clone()
            QuantizedReduceScatterMean([t], Collective(group.comm(r)), cfg, errors=errs[r],
                                       owner_error=owners[r]).finish()
            return t
        got_total += run_replicas(group, replica, world)[0]
    owed = sum(e[0] for e in errs) / world + torch.cat(owners)[:n]
    assert torch.allclose(got_total + owed, exact_total, atol=1e-4)
    assert float(owed.abs().max()) < 3.0


def test_reduce_scatter_owner_residuals_in_the_state():
    """The owners' residuals are saved and restored; a state of another width (other chunks) is
    refused, a merged state (an elastic resize) drops them, and a state that holds them does not
    load into an all-gather config."""
    rs = {"backend": "streaming_diloco", "inner_steps": 4, "num_fragments": 2, "overlap": False,
          "compression": "quant", "quant": {"bits": 2, "block": 8, "collective": "reduce_scatter"}}
    m, opt, b = _make(rs, 0, 1)
    assert [e.numel() for e in b.quant_owner_errors] == [
        b.quant.chunk_numel(sum(b.backup[i].numel() for i in frag), 1) for frag in b.fragments]
    for k, e in enumerate(b.quant_owner_errors):
        e.fill_(0.5 + k)
    sd = b.state_dict()
    m2, opt2, b2 = _make(rs, 0, 1)
    b2.load_state_dict(sd)
    assert all(torch.equal(x, y) for x, y in zip(b2.quant_owner_errors, b.quant_owner_errors))
    merged = type(b).merge_replica_states([sd, sd])
    assert merged["quant_owner_errors"] is None
    b2.load_state_dict(merged)
    assert all(float(e.abs().max()) == 0 for e in b2.quant_owner_errors)
    bad = {**sd, "quant_owner_errors": [torch.zeros(e.numel() + 8) for e in sd["quant_owner_errors"]]}
    with pytest.raises(ValueError, match="owner residuals of .* this width's chunks"):
        b2.load_state_dict(bad)
    m3, opt3, b3 = _make({**rs, "quant": {"bits": 2, "block": 8}}, 0, 1)
    with pytest.raises(ValueError, match="quant.collective"):
        b3.load_state_dict(sd)


def test_streaming_diloco_quant_keeps_replicas_identical_and_counts_its_bytes():
    """Streaming DiLoCo with 4-bit pseudo-gradients on two in-process replicas: after each
    non-overlapped sync the synced fragment is bit-identical on both, and the DP bytes are the
    all-gathers' (7.5x below the fp32 all-reduce at blocks of 64)."""
    cfg = {"backend": "streaming_diloco", "inner_steps": 4, "num_fragments": 2, "overlap": False,
           "outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False, "compression": "quant"}
    world = 2
    group, run_replicas = _in_process(world)
    models = [_toy_model() for _ in range(world)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    backends = [build_backend(list(m.named_parameters()), group.comm(r), cfg) for r, m in enumerate(models)]
    n = sum(p.numel() for p in models[0].parameters())

    def replica(r):
        synced_equal = []
        for s in range(12):
            x, y = _batch(r, s)
            opts[r].zero_grad()
            F.mse_loss(models[r](x), y).backward()
            backends[r].reduce_gradients(s)
            opts[r].step()
            backends[r].after_optimizer_step(s)
            stats = backends[r].pop_step_stats()
            synced_equal.append((s, stats.get("synced_fragments", []),
                                 [p.detach().clone() for p in models[r].parameters()], stats["bytes_sent"]))
        return synced_equal
    a, b = run_replicas(group, replica, world)
    synced = 0
    from ds_twocircuit.dp.quantmean import QuantConfig
    q = QuantConfig()
    for (s, frags, pa, sent), (_, _, pb, _) in zip(a, b):
        numel = [sum(pa[i].numel() for i in backends[0].fragments[f]) for f in frags]
        assert sent == sum((world - 1) * q.payload_bytes(k) for k in numel)
        for f in frags:
            synced += 1
            idx = backends[0].fragments[f]
            assert all(torch.equal(pa[i], pb[i]) for i in idx), f"fragment {f} differs after step {s}"
    assert synced == 5    # fragment 0 after steps 3, 7, 11; fragment 1 after 5, 9
    assert q.payload_bytes(64_000) == 1000 * 34 and 4 * 64_000 / q.payload_bytes(64_000) > 7.5   # vs fp32, 2 replicas
    assert not torch.equal(torch.cat([p.reshape(-1) for p in a[-1][2]]), torch.cat([p.reshape(-1) for p in b[-1][2]]))
    sd = backends[0].state_dict()
    assert sd["quant_errors"] is not None and any(float(e.abs().max()) > 0 for e in sd["quant_errors"])


def test_inner_lr_factor_by_backend_and_width():
    """``inner_lr_scale``: a number as given, "sqrt_replicas" as sqrt(N); every other backend 1."""
    sq = config_from_dict({"backend": "streaming_diloco", "inner_lr_scale": "sqrt_replicas"})
    assert [sq.inner_lr_factor(n) for n in (1, 2, 4, 9)] == [1.0, pytest.approx(2 ** 0.5), 2.0, 3.0]
    assert config_from_dict({"backend": "diloco", "inner_lr_scale": 1.5}).inner_lr_factor(4) == 1.5
    assert config_from_dict({"backend": "diloco"}).inner_lr_factor(4) == 1.0
    for other in ({"backend": "allreduce"}, {"backend": "powersgd"}):
        assert config_from_dict(other).inner_lr_factor(4) == 1.0
    assert sq.to_dict()["inner_lr_scale"] == "sqrt_replicas"
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        sq.inner_lr_factor(0)
