"""The cost model's arithmetic on hand-checked cases (ds_twocircuit.costmodel, launch/project.py)."""
import json
import os
import sys

import pytest

from ds_twocircuit.costmodel import (Setting, compute_only, paper_equivalent_link_mbit, ring_allreduce_bytes,
                                     step_breakdown, tokens_per_s, transfer_s)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _s(**kw):
    base = dict(params=1e9, pp=1, dp=1, micro_batches=4, tokens_per_micro=1000, flops=1e12, link_mbit=100.0)
    return Setting(**{**base, **kw})


def test_compute_only_single_stage():
    # 6 N T / F = 6 s per micro-batch, 4 of them; 4000 tokens
    b = step_breakdown(_s())
    assert b["step_s"] == pytest.approx(24.0) and b["bubble_s"] == 0.0
    assert b["tokens_per_s"] == pytest.approx(4000 / 24)


def test_pipeline_bubbles_and_blocking_boundaries():
    # 2 stages: 3 s of compute per micro-batch and stage; a hop carries 1000 B/token x 1000 tokens
    # = 1e6 B = 8e6 bit at 1e8 bit/s = 0.08 s + 10 ms latency; a slot sends activations and
    # gradients: 3 + 2 x 0.09 = 3.18 s; (4 + 2 - 1) slots
    s = _s(pp=2, bytes_per_token=1000.0, latency_s=0.01)
    b = step_breakdown(s)
    assert b["step_s"] == pytest.approx(5 * 3.18)
    assert b["bubble_s"] == pytest.approx(3.0) and b["boundary_s"] == pytest.approx(5 * 0.18)
    assert b["tokens_per_s"] == pytest.approx(4000 / 15.9)
    # codec state per step spreads over the micro-batches: 4e6 B more per step = 1e6 B per hop
    assert step_breakdown(s.replace(state_bytes_per_step=4e6))["step_s"] == pytest.approx(5 * (3 + 2 * 0.17))


def test_dp_time_exposed_and_hidden():
    # one rank sends 1e6 B (0.08 s) in 2 (d - 1) ring steps of 10 ms latency each; half hidden
    s = _s(dp=2, dp_bytes_per_rank=1e6, latency_s=0.01, dp_hidden=0.5)
    b = step_breakdown(s)
    assert b["dp_s"] == pytest.approx(0.08 + 0.02)
    assert b["dp_exposed_s"] == pytest.approx(0.05)
    assert b["step_s"] == pytest.approx(24.0 + 0.05)
    assert b["tokens_per_step"] == 8000                     # both replicas' tokens
    # anchor bytes share the DP link
    assert step_breakdown(s.replace(anchor_bytes_per_step=1e6))["dp_s"] == pytest.approx(0.16 + 0.02)


def test_helpers():
    assert ring_allreduce_bytes(100, 4) == 150 and ring_allreduce_bytes(100, 1) == 0
    assert transfer_s(0, 1.0, 5.0) == 0.0 and transfer_s(125_000, 1.0) == pytest.approx(1.0)
    s = _s(pp=2, dp=2, bytes_per_token=10.0, dp_bytes_per_rank=1e9, latency_s=0.5)
    assert tokens_per_s(compute_only(s)) == pytest.approx(8000 / (5 * 3.0))
    assert tokens_per_s(s) < tokens_per_s(compute_only(s))
    with pytest.raises(ValueError, match="pp must be an integer >= 1"):
        _s(pp=0)
    with pytest.raises(ValueError, match="dp_hidden"):
        _s(dp_hidden=1.5)


def test_paper_equivalent_link_rate_scales_with_compute():
    # 100x slower compute keeps the same communication/computation ratio at a 100x slower link
    ref = _s(pp=2, flops=1e14, link_mbit=200.0, bytes_per_token=4096.0)
    slow = ref.replace(flops=1e12)
    assert paper_equivalent_link_mbit(slow, ref) == pytest.approx(2.0)


def test_project_cli_writes_the_projection(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "launch"))
    import project
    out = project.main(["--model-size", "1.24e9", "--hidden", "2048", "--mesh", "8x8", "--link-mbit", "200",
                        "--gpu-tflops", "125", "--out", str(tmp_path)])
    saved = json.load(open(tmp_path / "projection.json"))
    assert saved["rows"] == out["rows"] and saved["kind"].startswith("projection")
    rows = {r["method"]: r for r in out["rows"]}
    assert rows["dense"]["speedup_vs_dense"] == 1.0
    # M95 sends 102 of 2048 values (bf16): 204 B per token and direction
    assert rows["M95 (paper codec)"]["boundary_bytes_per_token_each_way"] == 204
    assert all(r["tokens_per_s"] > 0 for r in out["rows"])
    assert "Projection" in (tmp_path / "projection.md").read_text()
