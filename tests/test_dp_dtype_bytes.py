"""What each DP backend sends in a bf16 run against an fp32 run (``DPBackend.loop_bytes_dtype``).

The quality studies train in fp32 (the reference engine) and state their DP ratios against a bf16
all-reduce too (``launch/bench_quality.py``), by scaling each backend's measured bytes as this
attribute says. Here two replicas in one process train the same toy model in fp32 and in bf16 under
every built-in backend, and the bytes they count are compared: the attribute must be what the code
sends, and the end-of-run average what ``final_average_bytes`` says (half in bf16 at two replicas,
where the weights are all-gathered as they are and summed in fp32)."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ds_twocircuit.dp.base import final_average_bytes
from ds_twocircuit.dp.registry import available_backends, build_backend, get_backend
from ds_twocircuit.engines.reference import InProcessGroup, run_replicas

SYNC = {"inner_steps": 4, "num_fragments": 2, "outer_lr": 1.5, "outer_momentum": 0.0, "nesterov": False}
CONFIGS = {   # every built-in backend, the shipped sync among them (dense_dp200*.json's, H 4 here)
    "allreduce": {"backend": "allreduce"},
    "powersgd": {"backend": "powersgd", "powersgd": {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2}},
    "diloco": {"backend": "diloco", "inner_steps": 4, "outer_lr": 0.7},
    "streaming_diloco": {"backend": "streaming_diloco", **SYNC, "overlap": True, "overlap_steps": 2,
                         "merge_alpha": 0.5, "compression": "quant",
                         "quant": {"bits": 4, "block": 64, "error_feedback": True}},
    "streaming_diloco/powersgd": {"backend": "streaming_diloco", **SYNC, "compression": "powersgd",
                                  "powersgd": {"matrix_approximation_rank": 2, "start_powerSGD_iter": 0}},
    "streaming_diloco/none": {"backend": "streaming_diloco", **SYNC},
}
STEPS = 11   # ends between syncs: the end-of-run average has drifted fragments to send


def _bytes(cfg: dict, dtype: torch.dtype, n: int = 2, weights: list | None = None,
           capture: dict | None = None) -> tuple[int, int]:
    """(training-loop bytes, end-of-run average bytes) replica 0 sends over STEPS steps; ``weights``
    gets each replica's weights before and after the end-of-run average, ``capture[r]`` replica r's
    (DiLoCo backup, weights before, weights after) flattened in fp32."""
    group = InProcessGroup(n)
    models = []
    for _ in range(n):
        torch.manual_seed(0)
        models.append(nn.Sequential(nn.Linear(8, 96), nn.Tanh(), nn.Linear(96, 4)).to(dtype))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    backends = [build_backend(list(m.named_parameters()), group.comm(r), cfg) for r, m in enumerate(models)]
    loop = [0] * n

    def step(s):
        def one(r):
            g = torch.Generator().manual_seed(1000 * r + s)
            x, y = torch.randn(4, 8, generator=g).to(dtype), torch.randn(4, 4, generator=g).to(dtype)
            opts[r].zero_grad()
            F.mse_loss(models[r](x), y).backward()
            backends[r].reduce_gradients(s)
            opts[r].step()
            backends[r].after_optimizer_step(s)
            loop[r] += backends[r].pop_step_stats().get("bytes_sent", 0)
        run_replicas(group, one, n)
    for s in range(STEPS):
        step(s)

    def flat(r):
        return torch.cat([p.detach().reshape(-1) for p in models[r].parameters()])

    def final(r):
        backends[r].flush()   # what finalize finishes first, so that 'before' is what it averages
        before = flat(r).clone()
        backup = torch.cat([b.reshape(-1) for b in getattr(backends[r], "backup", [])] or [torch.zeros(0)])
        loop[r] += backends[r].pop_step_stats().get("bytes_sent", 0)
        backends[r].finalize()
        if weights is not None:
            weights.append((before, flat(r).clone()))
        if capture is not None:
            capture[r] = (backup, before.float(), flat(r).float())
        return backends[r].pop_step_stats().get("bytes_sent", 0)
    ends = run_replicas(group, final, n)
    assert len(set(loop)) == 1 and len(set(ends)) == 1
    return loop[0], ends[0]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_loop_bytes_dtype_is_what_the_backend_sends(name):
    cfg = CONFIGS[name]
    kind = get_backend(cfg["backend"]).loop_bytes_dtype
    (loop32, end32), (loop16, end16) = _bytes(cfg, torch.float32), _bytes(cfg, torch.bfloat16)
    assert loop32 > 0
    if kind == "grad":
        assert loop16 * 2 == loop32
    elif kind == "fp32":
        assert loop16 == loop32
    else:   # a mix: more than half, less than all
        assert kind is None and loop32 / 2 < loop16 < loop32
    if get_backend(cfg["backend"]).replicas_may_differ:
        assert end32 > 0 and end16 * 2 == end32   # bf16 weights all-gathered: half at two replicas
    else:
        assert end16 == end32 == 0


@pytest.mark.parametrize("n", [2, 3, 4])
def test_end_of_run_average_of_bf16_weights(n):
    """The end-of-run average of bf16 weights: the fp32 mean of every replica's weights rounded once
    to bf16, bit-identical on every replica, at the bytes of final_average_bytes (an all-gather of
    the bf16 values below four replicas, the fp32 all-reduce from four)."""
    cfg = CONFIGS["streaming_diloco/none"]
    weights = []
    _, end = _bytes(cfg, torch.bfloat16, n=n, weights=weights)
    before = [b for b, _ in weights]
    after = [a for _, a in weights]
    assert all(torch.equal(after[0], a) for a in after[1:])
    assert not all(torch.equal(before[0], b) for b in before[1:])   # they had drifted
    mean = sum(b.float() for b in before) / n
    assert torch.equal(after[0], mean.to(torch.bfloat16))
    # what was averaged: the drifted fragments' weights (here, with the last sync 3 steps back, all)
    numel = before[0].numel()
    assert end == final_average_bytes(numel, torch.bfloat16, n)
    assert end == (numel * 2 * (n - 1) if n < 4 else 2 * (n - 1) * numel * 4 // n)


def test_every_builtin_backend_is_measured():
    assert {c["backend"] for c in CONFIGS.values()} == set(available_backends())
    assert all(get_backend(b).loop_bytes_dtype in ("grad", "fp32", None) for b in available_backends())


def _bench_quality():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("bench_quality_dtype", os.path.join(root, "launch", "bench_quality.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_report_ratios_against_a_bf16_all_reduce():
    """The report's bf16 DP ratios: the all-reduce baseline halves, an fp32-formed sync does not, the
    end-of-run average halves at two replicas; a mixed backend gets none."""
    bq = _bench_quality()
    base = {"label": "dense", "domain": "d", "dp": 2, "dp_backend": "allreduce",
            "dp_bytes_per_token": 600.0, "dp_bytes_per_token_training": 600.0}
    sync = {"label": "s", "domain": "d", "dp": 2, "dp_backend": "streaming_diloco",
            "dp_bytes_per_token": 7.0, "dp_bytes_per_token_training": 3.0}
    mixed = {"label": "p", "domain": "d", "dp": 2, "dp_backend": "powersgd",
             "dp_bytes_per_token": 10.0, "dp_bytes_per_token_training": 10.0}
    rows = [base, sync, mixed]
    bq.add_dp_ratios(rows, "dense")
    assert (base["dp_ratio"], base["dp_ratio_bf16"], base["dp_ratio_total_bf16"]) == (1.0, 1.0, 1.0)
    assert (sync["dp_ratio"], sync["dp_ratio_total"]) == (200.0, round(600 / 7, 2))
    # in bf16: the all-reduce halves, the loop's fp32-formed sync stays, the end-of-run average halves
    assert (sync["dp_ratio_bf16"], sync["dp_ratio_total_bf16"]) == (100.0, 60.0)
    assert mixed["dp_ratio"] == 60.0 and mixed["dp_ratio_bf16"] is None
    # the gate reads the bf16 ratio: 100x in bf16 passes 100, not 101
    summary = [{"label": "dense", "domain": "d", "seeds": [0], "vs_baseline": 1.0, "overrides": [],
                "heldout_loss_mean": 2.0, "config": "dense.json", "pp_bytes_ratio_bf16": 1.0, **base},
               {"label": "s", "domain": "d", "seeds": [0], "vs_baseline": 1.005, "overrides": [],
                "heldout_loss_mean": 2.01, "config": "s.json", "pp_bytes_ratio_bf16": 1.0, **sync}]
    assert bq.recommend(summary, "dense", min_ratio_bf16=0.5, min_dp_ratio=100, min_seeds=1) == "s.json"
    assert bq.recommend(summary, "dense", min_ratio_bf16=0.5, min_dp_ratio=101, min_seeds=1) is None
    # the table: the baseline is "the baseline", another all-reduce row (a codec's) "all-reduce"
    codec = {"label": "codec", "dp": 2, "dp_ratio": 1.0, "dp_ratio_total": 1.0, "dp_ratio_bf16": 1.0,
             "dp_ratio_total_bf16": 1.0}
    assert bq._dp_cell({**codec, "label": "dense"}, "_bf16", "dense") == "1 (the baseline)"
    assert bq._dp_cell(codec, "_bf16", "dense") == "1 (all-reduce)"
    assert bq._dp_cell({**sync, "dp_ratio_total": 85.71}, "", "dense") == "200.0 / 85.7"
    assert bq._dp_cell(sync, "_bf16", "dense") == "100.0 / 60.0" and bq._dp_cell(mixed, "_bf16", "dense") == "-"



def _final(cfg: dict, dtype: torch.dtype) -> list[tuple]:
    """Each of two replicas' (backup, weights before, weights after, bytes) around the end-of-run
    average after STEPS steps."""
    capture = {}
    _, end = _bytes(cfg, dtype, capture=capture)
    return [(*capture[r], end) for r in range(2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_final_outer_lr_steps_from_the_backup_and_keeps_replicas_identical(dtype):
    """``final_outer_lr`` makes the end-of-run average an outer step, backup + lr * (mean -
    backup), at the plain average's bytes and the same on both replicas; 1 (the default) is the
    plain average. Fragments synced on the last step are left alone."""
    base = CONFIGS["streaming_diloco"]
    plain, stepped = _final(base, dtype), _final({**base, "final_outer_lr": 1.5}, dtype)
    assert [r[3] for r in plain] == [r[3] for r in stepped] and plain[0][3] > 0   # the same bytes
    (bk0, w0, mean, _), (bk1, w1, mean1, _) = plain
    assert torch.equal(mean, mean1) and not torch.equal(w0, w1)
    assert torch.equal(bk0, bk1)                                   # the backup agrees, as always
    assert torch.equal(stepped[0][1], w0) and torch.equal(stepped[1][1], w1)   # the same run
    s0, s1 = stepped[0][2], stepped[1][2]
    assert torch.equal(s0, s1)                                     # replicas agree
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(mean, (w0 + w1) / 2, atol=tol)
    drifted = (w0 != w1)
    want = bk0 + 1.5 * (mean - bk0)
    assert torch.allclose(s0[drifted], want[drifted], atol=tol, rtol=tol)
    # past the plain average by half the averaged drift (bf16: up to the weights' rounding, which is
    # a quarter of these small moves; the plain average would miss by all of it)
    past, half = (s0 - mean)[drifted], 0.5 * (mean - bk0)[drifted]
    assert half.norm() > 0.01 and (past - half).norm() <= (1e-5 if dtype == torch.float32 else 0.4) * half.norm()
    if dtype == torch.float32:   # (in bf16 a drifted weight can round to the same value on both)
        assert torch.equal(s0[~drifted], mean[~drifted])           # synced fragments: untouched
