"""The cost model's arithmetic on hand-checked cases (ds_twocircuit.costmodel, launch/project.py)."""
import json
import os
import sys

import pytest

from ds_twocircuit.costmodel import (Setting, compute_only, ring_allreduce_bytes,
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


def test_pipeline_bubbles_and_boundary_round_trips():
    # 2 stages: 3 s of compute per micro-batch and stage, (4 + 2 - 1) compute slots = 15 s; a hop
    # carries 1000 B/token x 1000 tokens = 1e6 B = 8e6 bit at 1e8 bit/s = 0.08 s + 10 ms latency;
    # the critical path holds 2 (m + pp - 2) = 8 hops: the first micro-batch's round trip, then one
    # round trip per further micro-batch of stage 0
    s = _s(pp=2, bytes_per_token=1000.0, latency_s=0.01)
    b = step_breakdown(s)
    assert b["step_s"] == pytest.approx(15 + 8 * 0.09)
    assert b["bubble_s"] == pytest.approx(3.0) and b["boundary_s"] == pytest.approx(8 * 0.09)
    assert b["tokens_per_s"] == pytest.approx(4000 / 15.72)
    # codec state per step spreads over the micro-batches: 4e6 B more per step = 1e6 B per hop
    assert step_breakdown(s.replace(state_bytes_per_step=4e6))["step_s"] == pytest.approx(15 + 8 * 0.17)
    # 4 stages: 2 (4 + 4 - 2) = 12 hops; a stage holds a quarter of the model
    b4 = step_breakdown(s.replace(pp=4))
    assert b4["compute_s"] == pytest.approx(7 * 1.5) and b4["boundary_s"] == pytest.approx(12 * 0.09)


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


def test_periodic_overlapped_dp_syncs():
    # a sync every 10 steps carries 10 x 1e6 B = 0.8 s + 2 latencies of 10 ms; behind one step of
    # pipeline work (24 s) it is hidden entirely
    s = _s(dp=2, dp_bytes_per_rank=1e6, latency_s=0.01, dp_sync_every=10, dp_overlap_steps=1)
    b = step_breakdown(s)
    assert b["dp_s"] == pytest.approx(0.082) and b["dp_exposed_s"] == 0.0 and b["step_s"] == pytest.approx(24.0)
    # at 1 Mbit/s the sync takes 80.02 s: 56.02 s of it are left after the step it overlaps,
    # spread over the 10 steps
    slow = step_breakdown(s.replace(link_mbit=1.0))
    assert slow["dp_exposed_s"] == pytest.approx((80.02 - 24.0) / 10)
    # not overlapped: all of it, spread over the 10 steps
    assert step_breakdown(s.replace(link_mbit=1.0, dp_overlap_steps=0))["dp_exposed_s"] == pytest.approx(8.002)
    with pytest.raises(ValueError, match="dp_overlap_steps"):
        _s(dp_overlap_steps=-1)


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
    # the 4-bit sync of lowrank_dp200.json (H 20, F 2, blocks of 64 at 4 bits + a bf16 scale): one
    # fragment of a stage (1.24e9 / 8 / 2 values) every 10 steps, all-gathered to 7 other replicas
    per_sync = 7 * (-(-77_500_000 // 64)) * (64 * 4 // 8 + 2)
    assert project.quant_sync_bytes_per_step("ds_configs/lowrank_dp200.json", 1.24e9 / 8, 8) == per_sync / 10
    assert project.quant_sync_bytes_per_step("ds_configs/lowrank_dp200.json", 1.24e9 / 8, 2) == per_sync / 7 / 10
    # the reduce-scatter: 2 (dp - 1) chunk payloads, a chunk being 1 / dp of the fragment in whole blocks
    chunk = -(-77_500_000 // (8 * 64)) * 64
    rs = project.quant_sync_bytes_per_step("ds_configs/lowrank_dp200.json", 1.24e9 / 8, 8, "reduce_scatter")
    assert rs == 2 * 7 * (chunk // 64) * 34 / 10 and per_sync / 10 / rs == pytest.approx(4.0, rel=1e-3)
    rows = {r["method"]: r for r in out["rows"]}
    ag, rsr = (rows[f"low-rank 112x4b + 4-bit DiLoCo{k}"] for k in (" (lowrank_dp200)", ", reduce-scatter"))
    assert rsr["dp_exposed_s"] < ag["dp_exposed_s"] and rsr["tokens_per_s"] > ag["tokens_per_s"]
    with pytest.raises(ValueError, match="not a quantised Streaming DiLoCo"):
        project.quant_sync_bytes_per_step("ds_configs/dense_dp.json", 1e6, 2)


def test_table1_paper_equivalent_rate_and_steady_state():
    sys.path.insert(0, os.path.join(ROOT, "launch"))
    import bench_table1 as t1
    # Table 1: 46.5k / 1.1k = 42.27 -> a Baseline step is 41.27 compute steps of communication
    assert t1.paper_comm_ratio() == pytest.approx(46.5 / 1.1 - 1)
    # 268 MB per step on the busiest link, 2.5 s compute: 268e6 x 8 bit / (41.27 x 2.5 s)
    assert t1.paper_equivalent_mbit(268e6, 2.5, 41.27) == pytest.approx(268e6 * 8 / (41.27 * 2.5) / 1e6)
    with pytest.raises(ValueError):
        t1.paper_equivalent_mbit(0, 2.5, 41.27)
    # steady step time: steps after the first; a DiLoCo row (H = 2) over steps H+1 .. 2H
    metrics = [{"step_s": s} for s in (9.0, 1.0, 5.0, 3.0, 1.0, 1.0)]
    assert t1.steady_step_s(metrics, 1) == pytest.approx(11 / 5)
    assert t1.steady_step_s(metrics, 2) == pytest.approx((3.0 + 1.0) / 2)
    with pytest.raises(ValueError, match="at least 7 steps"):
        t1.steady_step_s(metrics, 3)
    # two cycles of H = 2 after the first: steps 3 .. 6
    metrics7 = metrics + [{"step_s": 7.0}]
    assert t1.steady_step_s(metrics7, 2, cycles=2) == pytest.approx((3.0 + 1.0 + 1.0 + 7.0) / 4)
    assert t1.cycle_steps("dense.json") == 1 and t1.cycle_steps("dense_dp.json") == 10
    assert t1.dp_config("ds_configs/dense_dp.json") == t1.dp_config("dense_dp.json")
    # rank = stage x 2 + replica: 0<->1 and 2<->3 are DP links, 0<->2 and 1<->3 PP; 4, 5 the anchor's
    assert [t1.link_kind(k) for k in ("0->1", "3->2", "0->2", "3->1", "0->3", "4->0", "stage0<->anchor")] == \
        ["dp", "dp", "pp", "pp", "pp", None, None]
    # the schedule comes from the parsed section: Streaming DiLoCo's default F = 4 when unset
    from ds_twocircuit.dp.registry import config_from_dict
    assert config_from_dict({"backend": "streaming_diloco", "inner_steps": 8}).sync_schedule() == (8, 2, 1)
    assert config_from_dict({"backend": "streaming_diloco", "inner_steps": 8,
                             "overlap": False}).sync_schedule() == (8, 2, 0)
    assert config_from_dict({"backend": "diloco", "inner_steps": 6}).sync_schedule() == (6, 6, 0)
    assert config_from_dict({"backend": "powersgd"}).sync_schedule() == (1, 1, 0)
    assert config_from_dict({"backend": "allreduce"}).sync_schedule() == (1, 1, 0)
    # bytes by kind per token and the busiest link: DiLoCo syncs scaled to their steady rate
    summary = {"tokens": 4000, "steps": 4, "anchor": None, "dp_final_sync_bytes": 1000,
               "wire_bytes": {"pp_activations": 8000, "pp_gradients": 4000, "pp_codec_state": 400, "pp_handshake": 200,
                              "pp_tied": 0, "dp": 7000, "anchor": 0}}
    mesh = {"kernel_bytes": {"0->2": 4400, "2->0": 2100, "0->1": 3100, "1->0": 3000}}
    metrics = [{"dp.synced_fragments": [0]}, {}, {}, {}]  # one fragment sync in 4 steps, F = 2, H = 10
    per_token, by_kind, busiest, tps, links = t1.steady_state(summary, mesh, metrics, 4, "dense_dp.json")
    # steady DP: 6000 B per fragment sync (7000 less the end-of-run average) x 2 fragments / 10
    # steps = 1200 B per step, 4800 B in 4
    assert by_kind == pytest.approx({"pp_activations": 2.0, "pp_gradients": 1.0, "codec_state": 0.1,
                                     "dp": 1.2, "anchor": 0.0, "other": 0.05})
    assert per_token == pytest.approx(4.35) and tps == 1000
    assert links["0->1"] == pytest.approx(3100 / 4 * 4800 / 7000) and busiest == pytest.approx(1100)


def test_validation_predicts_an_emulated_row_by_hand(tmp_path):
    """One row, worked by hand: 2 micro-batches of 100 tokens per replica, compute-only 100 tokens/s
    (a 4 s step over both replicas' 400 tokens: 3 slots of 4/3 s); 50 B/token each way at 0.01
    Mbit/s: a hop of 5000 B takes 4 s, 2 (2 + 2 - 2) = 4 hops on the critical path; DP (all-reduce
    every step) 10 B/token x 400 / 4 ranks = 1000 B per rank = 0.8 s, blocking. The same row under
    dense_dp.json (Streaming DiLoCo, H = 10, F = 2, one step of overlap): a sync every 5 steps of
    5000 B = 4 s, behind a 20 s step: hidden."""
    sys.path.insert(0, os.path.join(ROOT, "launch"))
    import project
    row = {"variant": "r", "tokens_per_s": 10.0, "tokens_per_s_compute_only": 100.0, "micro_batches": 2,
           "tokens_per_micro": 100, "tokens_per_step": 400, "dp_hidden_share": 0.5,
           "bytes_by_kind": {"pp_activations": 50.0, "pp_gradients": 40.0, "codec_state": 0.0, "dp": 10.0,
                             "anchor": 5.0, "other": 0.0}}
    table = {"link_mbit": 0.01, "params": 1e6, "rows": [row]}
    s = project.validation_setting({**row, "link_mbit": 0.01}, 1e6, framing=1.0)
    b = step_breakdown(s)
    assert b["compute_s"] == pytest.approx(4.0) and b["boundary_s"] == pytest.approx(16.0)
    assert b["dp_exposed_s"] == pytest.approx(0.8)
    (v,) = project.validate(table, framing=1.0)
    assert v["predicted_tokens_per_s"] == pytest.approx(400 / 20.8, abs=0.01)
    assert v["error"] == pytest.approx(400 / 20.8 / 10.0 - 1, abs=1e-3)
    sd = project.validation_setting({**row, "link_mbit": 0.01, "config": "ds_configs/dense_dp.json"}, 1e6, 1.0)
    assert (sd.dp_sync_every, sd.dp_overlap_steps) == (5, 1)
    assert step_breakdown(sd)["dp_exposed_s"] == 0.0 and step_breakdown(sd)["step_s"] == pytest.approx(20.0)
    # stages balanced by compute carry unequal gradients: the heavier stage's all-reduce sets the
    # pace (DP links join ranks of one stage: 0<->1, 2<->3; PP links and the anchor's are ignored)
    links = {"0->1": 300, "1->0": 300, "2->3": 100, "3->2": 100, "0->2": 5000, "stage0<->anchor": 9}
    assert project.dp_imbalance({"link_bytes_per_step_by_link": links}) == 1.5
    assert project.dp_imbalance(row) == 1.0
    si = project.validation_setting({**row, "link_mbit": 0.01, "link_bytes_per_step_by_link": links}, 1e6, 1.0)
    assert si.dp_bytes_per_rank == 1.5 * s.dp_bytes_per_rank == 1500
    project.write_validation([v], str(tmp_path / "table1.json"), str(tmp_path))
    assert json.load(open(tmp_path / "projection.json"))["validation"]["within_target"] is False
    assert "outside the target" in (tmp_path / "projection.md").read_text()


def test_table1_rows_added_to_a_stored_table(tmp_path, monkeypatch):
    """``--add-rows``: rows run later join the stored table at its link rate, in table order, with
    speed-ups against the stored Baseline; other settings than the stored ones are refused."""
    import argparse
    sys.path.insert(0, os.path.join(ROOT, "launch"))
    import bench_table1 as t1
    calls = []

    def fake_measure(row, args, work, mbit, tag):
        calls.append((row[0], mbit))
        tps = {0: 300.0}.get(mbit, 150.0)                    # uncapped 300, capped 150
        return {"tokens_per_s": tps, "bytes_per_token": 25.0, "micro_batches": 2, "parameters": 10,
                "bytes_by_kind": dict.fromkeys(("pp_activations", "pp_gradients", "codec_state", "dp", "anchor",
                                                "other"), 1.0), "link_bytes_per_step": 7, "command": "c",
                "tokens_per_s_compute_only": None}
    monkeypatch.setattr(t1, "measure", fake_measure)
    stored = {"model": "m", "seq_len": 64, "link_mbit": 12.5, "command": "first", "mesh": "pp=2 x dp=2",
              "rows": [{**fake_measure(t1.ROWS[0], None, None, 12.5, ""), "variant": t1.ROWS[0][0],
                        "tokens_per_s": 10.0, "bytes_per_token": 1000.0},
                       {**fake_measure(t1.ROWS[6], None, None, 12.5, ""), "variant": t1.ROWS[6][0]}]}
    calls.clear()
    (tmp_path / "table1.json").write_text(json.dumps(stored))
    args = argparse.Namespace(add_rows="5,2", out=str(tmp_path), model="m", seq_len=64, micro_batches=None,
                              no_compute_only=False)
    t1.add_rows(args, str(tmp_path), "python launch/bench_table1.py --add-rows 5,2")
    res = json.load(open(tmp_path / "table1.json"))
    assert [r["variant"] for r in res["rows"]] == [t1.ROWS[i][0] for i in (0, 2, 5, 6)]
    assert sorted(calls) == sorted([(t1.ROWS[5][0], 0), (t1.ROWS[5][0], 12.5), (t1.ROWS[2][0], 0),
                                    (t1.ROWS[2][0], 12.5)])
    added = res["rows"][1]
    assert added["speedup"] == 15.0 and added["bytes_reduction"] == 40.0 and added["share_of_compute_only"] == 0.5
    assert res["commands_added"] == ["python launch/bench_table1.py --add-rows 5,2"]
    assert "rows added by `python launch/bench_table1.py --add-rows 5,2`" in (tmp_path / "table1.md").read_text()
    with pytest.raises(SystemExit, match="--seq-len 64, this run has 128"):
        t1.add_rows(argparse.Namespace(**{**vars(args), "seq_len": 128}), str(tmp_path), "x")


def test_table1_paced_rows_join_the_stored_rows(tmp_path, monkeypatch):
    """``--paced-rows``: a stored row run again under the software throttle at the table's rate
    (plain processes with ``--pace-mbit``, no namespaces, no root) gets its paced share of the
    stored compute-only rate beside the kernel cap's; rows the table lacks, and anchor rows (whose
    files the throttle does not pace), are refused."""
    sys.path.insert(0, os.path.join(ROOT, "launch"))
    import bench_table1 as t1
    seen, real_measure_paced = [], t1.measure_paced

    def fake_paced(row, args, work, mbit):
        seen.append((row[1], mbit))
        return {"tokens_per_s": 45.0, "command": "paced-cmd"}
    monkeypatch.setattr(t1, "measure_paced", fake_paced)
    monkeypatch.setattr(t1.os, "geteuid", lambda: 1000)                   # no root needed
    low = t1.ROWS[9]
    assert low[1] == "lowrank_dp200.json"
    row = {"variant": low[0], "tokens_per_s": 40.0, "tokens_per_s_compute_only": 50.0, "share_of_compute_only": 0.8,
           "speedup": 2.0, "bytes_per_token": 5.0, "micro_batches": 2, "link_bytes_per_step": 3,
           "bytes_by_kind": dict.fromkeys(("pp_activations", "pp_gradients", "codec_state", "dp", "anchor"), 1.0)}
    (tmp_path / "table1.json").write_text(json.dumps({"model": "m", "seq_len": 64, "link_mbit": 7.5, "command": "c",
                                                      "mesh": "pp=2 x dp=2", "rows": [row]}))
    monkeypatch.setattr(sys, "argv", ["bench_table1.py", "--paced-rows", "9", "--model", "m", "--seq-len", "64",
                                      "--out", str(tmp_path)])
    t1.main()
    assert seen == [("lowrank_dp200.json", 7.5)]
    stored = json.load(open(tmp_path / "table1.json"))
    r = stored["rows"][0]
    assert (r["tokens_per_s_paced"], r["share_of_compute_only_paced"], r["command_paced"]) == (45.0, 0.9, "paced-cmd")
    assert r["tokens_per_s"] == 40.0                                      # the kernel cap's run is kept
    assert stored["commands_paced"] == [f"python launch/bench_table1.py --paced-rows 9 --model m --seq-len 64 --out {tmp_path}"]
    md = (tmp_path / "table1.md").read_text()
    assert f"{low[0]}: 90% (45.0 tokens/s; kernel cap 80%)" in md and "--pace-mbit 7.5" in md
    monkeypatch.setattr(sys, "argv", ["bench_table1.py", "--paced-rows", "6", "--model", "m", "--seq-len", "64",
                                      "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"row 6 .* add it first \(--add-rows 6\)"):
        t1.main()
    with pytest.raises(SystemExit, match="anchor replica"):
        real_measure_paced(t1.ROWS[7], None, str(tmp_path), 7.5)
    cmd = t1.paced_command("lowrank_dp200.json", argparse_ns(model="m", seq_len=64, micro_batches=2), "o", 7.5, 42, 1234)
    assert cmd[cmd.index("--pace-mbit") + 1] == "7.5" and cmd[cmd.index("--nproc_per_node") + 1] == "4"
    assert cmd[cmd.index("--grad-accum") + 1] == "2" and "ds_configs/lowrank_dp200.json" in cmd


def argparse_ns(**kw):
    import argparse
    return argparse.Namespace(**kw)


def test_table1_sweep_reuses_a_stored_table(tmp_path, monkeypatch):
    """``--sweep R1,R2 --from-table T``: rows T holds take their compute-only run and their point
    at T's rate from it (nothing re-measured there); speed-ups are over the Baseline at the same
    rate; the JSON, the note and the plot are written; other settings than T's are refused."""
    import argparse
    sys.path.insert(0, os.path.join(ROOT, "launch"))
    import bench_table1 as t1
    calls = []

    def fake_measure(row, args, work, mbit, tag):
        calls.append((row[0], mbit))
        tps = 100.0 if mbit == 0 else (mbit if row[0].startswith("Baseline (") else 80.0)
        return {"tokens_per_s": tps, "step_s": 1.0, "steps": 2, "bytes_per_token": 5.0,
                "link_bytes_per_step": 9, "command": f"c{mbit}"}
    monkeypatch.setattr(t1, "measure", fake_measure)

    def stored_row(i, tps, co):
        return {"variant": t1.ROWS[i][0], "tokens_per_s": tps, "tokens_per_s_compute_only": co,
                "command_compute_only": "co", "step_s": 2.0, "steps": 2, "bytes_per_token": 7.0,
                "link_bytes_per_step": 11, "command": "stored", "micro_batches": 2}
    table = {"model": "m", "seq_len": 64, "link_mbit": 7.5, "paper_equivalent_mbit": 7.5,
             "rows": [stored_row(0, 1.5, 50.0), stored_row(8, 60.0, 70.0)]}
    (tmp_path / "table1.json").write_text(json.dumps(table))
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["bench_table1.py", "--sweep", "15,30", "--rows", "0,6,8", "--model", "m",
                                      "--seq-len", "64", "--from-table", str(tmp_path / "table1.json"),
                                      "--out", str(out)])
    monkeypatch.setattr(t1.os, "geteuid", lambda: 0)
    t1.main()
    sweep = json.load(open(out / "table1_sweep.json"))
    base, m95, low = (t1.ROWS[i][0] for i in (0, 6, 8))
    assert sweep["rates_mbit"] == [7.5, 15.0, 30.0]
    # stored rows: only the new rates measured; M95 (not in the table): compute-only and all three
    assert sorted(calls) == sorted([(base, 15.0), (base, 30.0), (low, 15.0), (low, 30.0),
                                    (m95, 0), (m95, 7.5), (m95, 15.0), (m95, 30.0)])
    assert sweep["series"][low]["compute_only"]["tokens_per_s"] == 70.0
    assert sweep["series"][low]["capped"]["7.5"]["tokens_per_s"] == 60.0
    assert sweep["series"][m95]["compute_only"]["tokens_per_s"] == 100.0
    assert sweep["speedup"][low] == {"7.5": 40.0, "15": 5.33, "30": 2.67}
    assert sweep["speedup"][base] == {"7.5": 1.0, "15": 1.0, "30": 1.0}
    md = (out / "table1_sweep.md").read_text()
    assert f"| {low} | 70.0 | 60.0 (40x) | 80.0 (5.33x) | 80.0 (2.67x) |" in md
    assert (out / "table1_sweep.png").stat().st_size > 10_000
    monkeypatch.setattr(sys, "argv", [*sys.argv[:-2], "--seq-len", "128", "--out", str(out)])
    with pytest.raises(SystemExit, match="--from-table: .* --seq-len 64, this run has 128"):
        t1.main()
    monkeypatch.setattr(sys, "argv", ["bench_table1.py", "--sweep", "15", "--from-table", str(tmp_path / "none.json")])
    with pytest.raises(SystemExit, match="--from-table: no table at"):
        t1.main()
    monkeypatch.setattr(sys, "argv", ["bench_table1.py", "--from-table", str(tmp_path / "table1.json")])
    with pytest.raises(SystemExit, match="--from-table only applies to --sweep"):
        t1.main()


def test_table1_sweep_of_some_rows_keeps_the_stored_series_of_the_others(tmp_path, monkeypatch):
    """``--sweep R --rows 9``: a stored sweep of the same settings keeps its other rows' series (in
    table order) and the command that measured them; its rates join this run's; a stored sweep of
    other settings is replaced."""
    sys.path.insert(0, os.path.join(ROOT, "launch"))
    import bench_table1 as t1
    monkeypatch.setattr(t1, "measure", lambda row, args, work, mbit, tag: {
        "tokens_per_s": 50.0 if mbit == 0 else 40.0, "step_s": 1.0, "steps": 42, "bytes_per_token": 5.0,
        "link_bytes_per_step": 9, "command": "new"})
    monkeypatch.setattr(t1.os, "geteuid", lambda: 0)
    base, low = t1.ROWS[0][0], t1.ROWS[9][0]
    old = {"model": "m", "seq_len": 64, "from_table": None, "rates_mbit": [7.5, 15.0], "command": "old-cmd",
           "series": {base: {"compute_only": {"tokens_per_s": 50.0},
                             "capped": {"7.5": {"tokens_per_s": 1.0}, "15": {"tokens_per_s": 2.0}}},
                      low: {"compute_only": {"tokens_per_s": 1.0}, "capped": {}}}}
    (tmp_path / "table1_sweep.json").write_text(json.dumps(old))
    monkeypatch.setattr(sys, "argv", ["bench_table1.py", "--sweep", "15", "--rows", "9", "--model", "m",
                                      "--seq-len", "64", "--out", str(tmp_path)])
    t1.main()
    sweep = json.load(open(tmp_path / "table1_sweep.json"))
    assert list(sweep["series"]) == [base, low] and sweep["rates_mbit"] == [7.5, 15.0]
    assert sweep["series"][base]["capped"]["15"]["tokens_per_s"] == 2.0          # kept, not re-run
    assert sweep["series"][low]["capped"]["15"]["tokens_per_s"] == 40.0          # re-run
    assert sweep["speedup"][low] == {"15": 20.0} and sweep["commands_before"] == ["old-cmd"]
    assert "earlier rows kept from `old-cmd`" in (tmp_path / "table1_sweep.md").read_text()
    monkeypatch.setattr(sys, "argv", ["bench_table1.py", "--sweep", "15", "--rows", "9", "--model", "m",
                                      "--seq-len", "128", "--out", str(tmp_path)])
    t1.main()
    assert list(json.load(open(tmp_path / "table1_sweep.json"))["series"]) == [low]


def test_table1_quality_columns_are_the_full_stack_rows_of_each_rows_own_config(tmp_path, monkeypatch):
    """A row's held-out loss is the mean over seeds of the full-stack study's rows of its own
    config on PP 2 x DP 2 (the newest run of each seed; rows with overrides, another mesh or another
    domain do not count); a config the study has not measured shows nothing, whatever a PP-only
    study says about its codec."""
    sys.path.insert(0, os.path.join(ROOT, "launch"))
    import bench_table1 as t1
    def row(label, seed, loss, **kw):
        return {"label": label, "seed": seed, "domain": "sympy", "dp": 2, "pp": 2, "overrides": [],
                "tokens": 251904, "heldout_loss": loss, **kw}
    rows = [row("dense", 0, 2.2), row("dense", 1, 2.4), row("dense", 1, 2.0),          # seed 1 re-run: 2.0
            row("dense", 2, 9.0, domain="deepspeed-cpp"), row("dense", 3, 9.0, dp=1),
            row("dense", 4, 9.0, overrides=["twocircuit.x=1"])]
    (tmp_path / "fullstack.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(t1, "OUT", str(tmp_path))
    res = {"model": "smollm2-135m", "rows": [{"variant": t1.ROWS[0][0], "heldout_loss": 9.0, "quality_from": "stale"},
                                             {"variant": t1.ROWS[6][0], "heldout_loss": 3.0, "quality_from": "x"},
                                             {"variant": "not a row"}]}
    t1.refresh_quality(res)
    assert res["rows"][0]["heldout_loss"] == 2.1
    assert res["rows"][0]["quality_from"] == "docs/benchmarks/fullstack.jsonl (dense, 2 seeds, 251,904 tokens)"
    assert "heldout_loss" not in res["rows"][1] and "heldout_loss" not in res["rows"][2]   # M95's full stack: -

def test_table1_refresh_quality_rewrites_the_loss_column_from_the_study_rows(tmp_path, monkeypatch):
    """``--refresh-quality`` runs nothing and takes each row's held-out loss from the full-stack
    study as it is now: the mean over the seeds of that row's own config on sympy, PP 2 x DP 2,
    without overrides; a config the study has not measured shows '-'."""
    sys.path.insert(0, os.path.join(ROOT, "launch"))
    import bench_table1 as t1

    def no_runs(*a, **k):
        raise AssertionError("--refresh-quality must not run anything")
    monkeypatch.setattr(t1, "measure", no_runs)
    monkeypatch.setattr(t1, "measure_paced", no_runs)
    monkeypatch.setattr(t1, "OUT", str(tmp_path))
    kinds = dict.fromkeys(("pp_activations", "pp_gradients", "codec_state", "dp", "anchor"), 1.0)
    rows = [{"variant": t1.ROWS[i][0], "config": f"ds_configs/{t1.ROWS[i][1]}", "tokens_per_s": 10.0 * (i + 1),
             "tokens_per_s_compute_only": 50.0, "speedup": 1.0, "bytes_per_token": 5.0, "micro_batches": 2,
             "link_bytes_per_step": 3, "bytes_by_kind": kinds, "heldout_loss": 9.9, "quality_from": "stale"} for i in (0, 8, 9)]
    (tmp_path / "table1.json").write_text(json.dumps({"model": "smollm2-135m", "seq_len": 64, "link_mbit": 7.5,
                                                      "command": "c", "mesh": "pp=2 x dp=2", "rows": rows}))
    study = [("dense", 0, "sympy", None, 2.10), ("dense", 1, "sympy", None, 2.20),
             ("dense", 0, "deepspeed-cpp", None, 1.00),                    # another domain: not this column
             ("lowrank_dp200", 0, "sympy", None, 2.25),
             ("lowrank_dp200", 1, "sympy", ["twocircuit.dp.overlap_steps=1"], 5.0)]   # a screen's override
    with open(tmp_path / "fullstack.jsonl", "w") as f:
        for label, seed, domain, overrides, loss in study:
            f.write(json.dumps({"label": label, "seed": seed, "domain": domain, "pp": 2, "dp": 2, "tokens": 251904,
                                "heldout_loss": loss, **({"overrides": overrides} if overrides else {})}) + "\n")
    monkeypatch.setattr(sys, "argv", ["bench_table1.py", "--refresh-quality", "--out", str(tmp_path)])
    t1.main()
    got = {r["variant"]: (r.get("heldout_loss"), r.get("quality_from")) for r in json.load(open(tmp_path / "table1.json"))["rows"]}
    assert got[t1.ROWS[0][0]] == (2.15, "docs/benchmarks/fullstack.jsonl (dense, 2 seeds, 251,904 tokens)")
    assert got[t1.ROWS[9][0]] == (2.25, "docs/benchmarks/fullstack.jsonl (lowrank_dp200, 1 seed, 251,904 tokens)")
    assert got[t1.ROWS[8][0]] == (None, None)                              # lowrank_dp.json: not in the study
    md = (tmp_path / "table1.md").read_text()
    assert "| 2.150 |" in md and "| 2.250 |" in md and "9.900" not in md and md.count("| - |") >= 1
    monkeypatch.setattr(sys, "argv", ["bench_table1.py", "--refresh-quality", "--add-rows", "9", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="runs nothing"):
        t1.main()
