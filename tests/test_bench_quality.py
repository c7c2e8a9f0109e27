"""launch/bench_quality.py: every row is a launch/train.py --engine reference run of a config file
(plus --set overrides), its bytes from the run's meter; the report pairs each config with the
baseline on the same seeds. Tiny preset, single process, seconds."""
import json
import os
import sys

import pytest

from launch_helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "launch"))
import bench_quality as bq  # noqa: E402

SMALL = ["--model", "tiny", "--data", "deepspeed-cpp", "--seq-len", "32", "--steps", "2", "--eval-sequences", "8"]


def test_rows_come_from_the_trainer_on_the_config_files(tmp_path):
    results = tmp_path / "q.jsonl"
    common = [*SMALL, "--results", str(results), "--work-dir", str(tmp_path / "runs")]
    bq.main(["--configs", "dense", "--seeds", "0,1", *common])
    bq.main(["--configs", "lowrank", "--seeds", "0,1", "--set", "twocircuit.codec.groups=[[16,4]]", *common])
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [(r["label"], r["seed"]) for r in rows] == [
        ("dense", 0), ("dense", 1), ("lowrank twocircuit.codec.groups=[[16,4]]", 0),
        ("lowrank twocircuit.codec.groups=[[16,4]]", 1)]
    runs = sorted(os.listdir(tmp_path / "runs"))
    assert len(runs) == 4 and all((tmp_path / "runs" / r / "summary.json").is_file() for r in runs)
    dense, coded = rows[0], rows[2]
    assert dense["config"] == "ds_configs/dense.json" and coded["overrides"] == ["twocircuit.codec.groups=[[16,4]]"]
    import shlex
    argv = shlex.split(coded["command"])
    assert argv[:4] == ["python", "launch/train.py", "--engine", "reference"]
    assert argv[argv.index("--deepspeed") + 1] == "ds_configs/lowrank.json"
    assert argv[argv.index("--set") + 1] == "twocircuit.codec.groups=[[16,4]]"
    # bytes from the meter: the tiny model's 64 channels in fp32, and 16 coefficients at 4 bits plus a
    # bf16 scale per token (10 bytes) plus the state shipped once (mean + basis, bf16) over 2 x 2 x 4 x 32 tokens
    H, tokens = 64, 2 * 2 * 4 * 32
    assert dense["pp_bytes_per_token"] == H * 4 and dense["pp_bytes_ratio"] == 1.0
    assert dense["pp_bytes_ratio_bf16"] == 0.5
    state = coded["pp_codec_state_bytes"]
    assert state == 2 * (H + H * 16 + 16)                     # lowrank.json: coef_norm sqrt_std (16 scales)
    assert coded["pp_bytes_per_token"] == pytest.approx(10 + state / (2 * tokens), abs=1e-3)
    # each direction: the state travels with the activations; the busier one sets the bf16 bound
    assert coded["pp_bytes_per_token_fwd"] == pytest.approx(10 + state / tokens, abs=1e-3)
    assert coded["pp_bytes_per_token_bwd"] == 10
    assert coded["pp_bytes_ratio_bf16_busier"] == pytest.approx(H * 2 / (10 + state / tokens), abs=1e-3)
    assert coded["heldout_loss_coded"] is not None and dense["heldout_loss_coded"] is None
    assert dense["heldout_loss_base"] == coded["heldout_loss_base"]          # the same held-out windows
    assert [c["step"] for c in coded["curve"]] == [0, 2]

    out = bq.report(bq.parse(["--report", "--results", str(results)]))
    by = {s["label"]: s for s in out["summary"]}
    s = by["lowrank twocircuit.codec.groups=[[16,4]]"]
    paired = {r["seed"]: r["heldout_loss"] - rows[r["seed"]]["heldout_loss"] for r in rows[2:]}
    assert s["paired_diff"] == pytest.approx(paired)
    assert s["vs_baseline"] == pytest.approx((rows[2]["heldout_loss"] + rows[3]["heldout_loss"])
                                             / (rows[0]["heldout_loss"] + rows[1]["heldout_loss"]))
    table = (tmp_path / "q.md").read_text()
    assert "| `dense` | deepspeed-cpp | 0,1 |" in table and (tmp_path / "q.png").exists()


def test_a_screen_pairs_the_training_losses_step_by_step(tmp_path):
    """--eval-sequences 0: rows without a held-out score; the report pairs each step's training loss
    with the baseline's on the same seed (steps 1 on) and lists only that, with its standard error."""
    import statistics
    results = tmp_path / "s.jsonl"
    common = ["--model", "tiny", "--data", "deepspeed-cpp", "--seq-len", "32", "--steps", "4", "--eval-sequences", "0",
              "--results", str(results), "--work-dir", str(tmp_path / "runs"), "--seeds", "0,1"]
    bq.main(["--configs", "dense", *common])
    bq.main(["--configs", "lowrank", "--set", "twocircuit.codec.groups=[[8,4]]", "--label", "lr8", *common])
    rows = {(r["label"], r["seed"]): r for r in map(json.loads, results.read_text().splitlines())}
    assert all(r["heldout_loss"] is None and len(r["train_losses"]) == 4 for r in rows.values())
    for (label, seed), r in rows.items():       # the run's own per-step record
        metrics = [json.loads(line)["loss"] for line in open(os.path.join(
            ROOT, r["command"].split("--output-dir ")[1].split()[0], "metrics.jsonl"))]
        assert r["train_losses"] == metrics
    out = bq.report(bq.parse(["--report", "--results", str(results)]))
    assert out["summary"] == [] and len(out["rows"]) == 4
    gaps = [(rows[("lr8", s)]["train_losses"][t] - rows[("dense", s)]["train_losses"][t]) for s in (0, 1) for t in (1, 2, 3)]
    (g,) = out["train_loss_gaps"]
    assert g["label"] == "lr8" and g["seeds"] == [0, 1] and g["steps"] == 4
    assert g["mean"] == pytest.approx(statistics.fmean(gaps)) and g["se"] == pytest.approx(statistics.stdev(gaps) / 6 ** 0.5)
    assert g["per_seed"] == pytest.approx({0: statistics.fmean(gaps[:3]), 1: statistics.fmean(gaps[3:])})
    assert f"| `lr8` | deepspeed-cpp | 4 | 0,1 | {g['mean']:+.4f} |" in (tmp_path / "s.md").read_text()
    # a shorter screen pairs with the baseline's first steps: the same batches (a constant learning
    # rate), so its losses are the longer run's first ones
    short = [a if a != "4" else "3" for a in common[:-1]] + ["0"]
    bq.main(["--configs", "lowrank", "--set", "twocircuit.codec.groups=[[8,4]]", "--label", "lr8short", *short])
    r3 = next(r for r in map(json.loads, results.read_text().splitlines()) if r["label"] == "lr8short")
    assert r3["steps"] == 3 and r3["train_losses"] == rows[("lr8", 0)]["train_losses"][:3]
    out = bq.report(bq.parse(["--report", "--results", str(results)]))
    g3 = next(g for g in out["train_loss_gaps"] if g["label"] == "lr8short")
    d0 = rows[("dense", 0)]["train_losses"]
    assert g3["steps"] == 3 and g3["seeds"] == [0]
    assert g3["mean"] == pytest.approx(statistics.fmean([r3["train_losses"][t] - d0[t] for t in (1, 2)]))
    # not where a learning-rate scheduler could make the first steps depend on the run's length
    assert bq._length_free(r3) and not bq._length_free(dict(r3, overrides=["scheduler.type=WarmupDecayLR"]))


def test_report_recommends_only_what_meets_the_budget_on_two_seeds(tmp_path):
    def row(label, seed, loss, ratio_bf16, domain="sympy"):
        return {"label": label, "config": f"ds_configs/{label}.json", "overrides": [], "seed": seed,
                "domain": domain, "steps": 10, "tokens": 100, "heldout_loss": loss, "heldout_loss_coded": None,
                "heldout_stderr": 0.01, "heldout_loss_base": 3.0, "pp_bytes_per_token": 1.0, "pp_bytes_ratio": 2 * ratio_bf16,
                "pp_bytes_ratio_bf16": ratio_bf16, "dp_bytes": 0, "anchor_bytes": 0, "tokens_per_s": 1.0, "curve": []}
    rows = [row("dense", 0, 2.0, 0.5), row("dense", 1, 2.2, 0.5),
            row("a", 0, 2.01, 20.2), row("a", 1, 2.21, 20.2),        # +0.5%: meets both
            row("b", 0, 1.9, 25.0),                                  # better, one seed only
            row("c", 0, 2.0, 10.0), row("c", 1, 2.2, 10.0),          # too many bytes
            row("d", 0, 2.1, 30.0), row("d", 1, 2.3, 30.0),          # +4.8%: too far from dense
            row("a", 1, 2.25, 20.2)]                                 # the newest run of a seed counts
    results = tmp_path / "r.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = bq.summarise(bq.load_rows(str(results)), "dense")
    a = next(s for s in summary if s["label"] == "a")
    assert a["paired_diff"] == pytest.approx({0: 0.01, 1: 0.05})
    assert bq.recommend(summary, "dense") is None                    # a is +1.4% with the newest seed 1
    rows[-1] = row("a", 1, 2.211, 20.2)
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert bq.recommend(bq.summarise(bq.load_rows(str(results)), "dense"), "dense") == "ds_configs/a.json"
    # better than a and 25x on the mean of both directions, but its busier direction is only 15x
    e = [dict(row("e", seed, loss, 25.0), pp_bytes_ratio_bf16_busier=15.0) for seed, loss in ((0, 1.99), (1, 2.19))]
    results.write_text("".join(json.dumps(r) + "\n" for r in rows + e))
    assert bq.recommend(bq.summarise(bq.load_rows(str(results)), "dense"), "dense") == "ds_configs/a.json"
    e = [dict(r, pp_bytes_ratio_bf16_busier=21.0, pp_bytes_per_token_fwd=40.3, pp_bytes_per_token_bwd=54.9) for r in e]
    results.write_text("".join(json.dumps(r) + "\n" for r in rows + e))
    assert bq.recommend(bq.summarise(bq.load_rows(str(results)), "dense"), "dense") == "ds_configs/e.json"
    # better still, but run with --set overrides (a screen of a change to the file, not the file)
    f = [dict(row("e", seed, loss, 25.0), label="e x=1", overrides=["x=1"], pp_bytes_ratio_bf16_busier=21.0)
         for seed, loss in ((0, 1.98), (1, 2.18))]
    results.write_text("".join(json.dumps(r) + "\n" for r in rows + e + f))
    assert bq.recommend(bq.summarise(bq.load_rows(str(results)), "dense"), "dense") == "ds_configs/e.json"
    # the baseline on a second domain that e has not run: nothing is recommended until it has
    cpp = [row("dense", seed, 1.5, 0.5, domain="deepspeed-cpp") for seed in (0, 1)]
    results.write_text("".join(json.dumps(r) + "\n" for r in rows + e + cpp))
    assert bq.recommend(bq.summarise(bq.load_rows(str(results)), "dense"), "dense") is None
    e_cpp = [dict(r, domain="deepspeed-cpp", heldout_loss=1.51) for r in e]
    results.write_text("".join(json.dumps(r) + "\n" for r in rows + e + cpp + e_cpp))
    assert bq.recommend(bq.summarise(bq.load_rows(str(results)), "dense"), "dense") == "ds_configs/e.json"
    # the table shows each direction's bytes and the busier direction's ratio, not the mean's 25x
    table = (tmp_path / "r.md")
    bq.report(bq.parse(["--report", "--results", str(results), "--min-seeds", "2"]))
    e_line = next(l for l in table.read_text().splitlines() if l.startswith("| `e` |"))
    assert "| 40.3 / 54.9 | 42.0 | 21.0 |" in e_line
    assert "| 1.0 | 40.4 | 20.2 |" in next(l for l in table.read_text().splitlines() if l.startswith("| `a` |"))


@pytest.mark.parametrize("keep", [False, True])
def test_a_study_cut_short_resumes_and_its_row_is_the_whole_run(tmp_path, keep):
    """A run that stopped after a checkpoint continues (--resume auto) and its row reports the whole
    run (steps, tokens) with the step it resumed from; a run of another protocol is not continued.
    Once its row is written, the run's checkpoint folder is removed (gigabytes per SmolLM2 run)
    unless --keep-checkpoints."""
    from ds_twocircuit import train
    results, work = tmp_path / "q.jsonl", tmp_path / "runs"
    args = bq.parse(["--configs", "dense", "--seeds", "0", *SMALL, "--results", str(results), "--work-dir", str(work),
                     *(["--keep-checkpoints"] if keep else [])])
    config = os.path.join(ROOT, "ds_configs", "dense.json")
    out = os.path.join(str(work), "dense_deepspeed-cpp_seed0_tiny_s2_l32_pp2_dp1")
    argv = bq.train_argv(args, config, 0, "deepspeed-cpp", out)
    argv[argv.index("--steps") + 1] = "1"
    assert train.run([*argv, "--save-checkpoint"]) == 0               # the first step, then "cut short"
    assert os.path.isdir(os.path.join(out, "checkpoint", "global_step1"))
    bq.run(args)
    row = json.loads(results.read_text().splitlines()[-1])
    assert row["steps"] == 2 and row["first_step"] == 1 and row["tokens"] == 2 * 2 * 4 * 32
    # the whole run's held-out curve (the resume reuses the first launch's scores of steps 0 and 1)
    assert [c["step"] for c in row["curve"]] == [0, 1, 2]
    # and its bytes: the checkpoint carried the first launch's (the dense boundary, fp32 each way)
    assert row["bytes_over"] == "the whole run" and row["pp_bytes_per_token"] == 64 * 4
    assert os.path.isdir(os.path.join(out, "checkpoint", "global_step1")) is keep
    assert os.path.isfile(os.path.join(out, "summary.json"))                  # the run's record stays


def test_full_stack_rows_get_dp_ratios_against_the_all_reduce_and_the_dp_budget(tmp_path):
    """--report on full-stack rows (DP 2): each row's DP bytes per token against the baseline's
    all-reduce on the same domain and width, in the training loop and with the end-of-run sync;
    --min-dp-ratio keeps a config under the DP budget from being recommended. The study runs in fp32;
    the budget is read against a bf16 run's all-reduce (half the bytes) and the sync's fp32-formed
    payload as it is (its end-of-run average of bf16 weights: half, at two replicas)."""
    def row(label, seed, loss, dp_tok, final_tok):
        backend = "allreduce" if label == "dense" else "streaming_diloco"
        return {"label": label, "config": f"ds_configs/{label}.json", "overrides": [], "seed": seed, "dp": 2,
                "dp_backend": backend,
                "domain": "sympy", "steps": 10, "tokens": 1000, "heldout_loss": loss, "heldout_loss_coded": None,
                "heldout_stderr": 0.01, "heldout_loss_base": 3.0, "pp_bytes_per_token": 100.0, "pp_bytes_ratio": 20.0,
                "pp_bytes_ratio_bf16": 10.0, "dp_bytes": int(dp_tok * 1000), "anchor_bytes": 0, "tokens_per_s": 1.0,
                "curve": [], "dp_bytes_per_token": dp_tok, "dp_bytes_per_token_training": dp_tok - final_tok,
                "dp_final_sync_bytes": int(final_tok * 1000)}
    rows = [row("dense", 0, 2.0, 1000.0, 0.0), row("dense", 1, 2.2, 1000.0, 0.0),
            row("slow", 0, 2.001, 20.0, 15.0), row("slow", 1, 2.201, 20.0, 15.0),     # 200x in the loop, 50x in all (fp32)
            row("fast", 0, 2.0, 25.0, 0.0), row("fast", 1, 2.2, 25.0, 0.0)]           # 40x: under a 100x budget
    results = tmp_path / "fullstack.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--report", "--results", str(results), "--min-ratio-bf16", "10", "--title", "Full stack"]
    out = bq.report(bq.parse(args))
    by = {(r["label"], r["seed"]): r for r in out["rows"]}
    assert by[("slow", 0)]["dp_ratio"] == 200.0 and by[("slow", 0)]["dp_ratio_total"] == 50.0
    # a bf16 run: 500 bytes of all-reduce, the same 5 in the loop, half the 15 of the final average
    assert by[("slow", 0)]["dp_ratio_bf16"] == 100.0 and by[("slow", 0)]["dp_ratio_total_bf16"] == 40.0
    assert by[("dense", 1)]["dp_ratio"] == 1.0 and by[("fast", 1)]["dp_ratio"] == 40.0
    assert by[("dense", 1)]["dp_ratio_bf16"] == 1.0 and by[("fast", 1)]["dp_ratio_bf16"] == 20.0
    assert out["benchmark"] == "fullstack" and out["recommended"] == "ds_configs/fast.json"   # the lowest loss
    out = bq.report(bq.parse([*args, "--min-dp-ratio", "100"]))
    assert out["recommended"] == "ds_configs/slow.json" and out["recommended_if"]["min_dp_ratio"] == 100
    # 200x against the study's fp32 all-reduce is 100x against a bf16 run's: under a budget of 101
    assert bq.report(bq.parse([*args, "--min-dp-ratio", "101"]))["recommended"] is None
    assert bq.report(bq.parse([*args, "--min-seeds", "3"]))["recommended"] is None   # 2 seeds measured
    table = (tmp_path / "fullstack.md").read_text()
    assert table.startswith("# Full stack") and "| 200.0 / 50.0 | 100.0 / 40.0 |" in table
    assert "| 1 (the baseline) | 1 (the baseline) |" in table and "(all-reduce)" not in table
    # --readme: the README's table is rewritten between its markers from the same summary, the prose kept
    readme = tmp_path / "README.md"
    readme.write_text("# Project\n\ntext\n\n" + bq.README_BEGIN + "\nstale\n" + bq.README_END + "\n\nmore\n")
    out = bq.report(bq.parse([*args, "--min-dp-ratio", "100", "--readme", str(readme)]))
    text = readme.read_text()
    assert "stale" not in text and text.startswith("# Project\n\ntext\n") and text.endswith("more\n")
    assert "| `ds_configs/slow.json` | sympy | 0,1 | **+0.05%**; +0.001, +0.001 | 100.0 | 10.0 |" in text
    assert "`ds_configs/dense.json` |" not in text
    assert "Recommended by this study: `ds_configs/slow.json`" in text and "[fullstack.md](fullstack.md)" in text
    readme.write_text("# Project without the markers\n")
    with pytest.raises(SystemExit, match="markers"):
        bq.report(bq.parse([*args, "--readme", str(readme)]))
    assert readme.read_text() == "# Project without the markers\n"


def test_the_gpu_layout_is_the_same_tokens_in_fewer_micro_batches(tmp_path):
    """--micro-batch-size 8 --grad-accum 1 (how a GPU screen runs) trains the same 8 sequences a step as
    the config's 2 x 4: the rows record the layout and the device, the run folders differ, and the
    held-out loss after two steps agrees with the 2 x 4 run's up to float rounding (the same mean
    gradient, summed in another order)."""
    results = tmp_path / "q.jsonl"
    common = [*SMALL, "--results", str(results), "--work-dir", str(tmp_path / "runs"), "--configs", "dense"]
    bq.main([*common, "--label", "dense_2x4"])
    bq.main([*common, "--label", "dense_8x1", "--micro-batch-size", "8", "--grad-accum", "1", "--device", "cpu"])
    a, b = [json.loads(line) for line in results.read_text().splitlines()]
    assert (a["micro_batch_size"], a["gradient_accumulation_steps"]) == (2, 4)
    assert (b["micro_batch_size"], b["gradient_accumulation_steps"]) == (8, 1)
    assert a["device"] == b["device"] == "cpu"
    assert a["tokens"] == b["tokens"] == 2 * 8 * 32
    assert "--micro-batch-size 8 --grad-accum 1" in b["command"] and "--device" not in b["command"]
    assert len(os.listdir(tmp_path / "runs")) == 2
    assert abs(a["heldout_loss"] - b["heldout_loss"]) < 1e-4 and a["heldout_loss"] != a["heldout_loss_base"]


def test_gap_curves_pair_each_point_with_the_baseline_on_its_seed_and_step():
    def row(label, seed, curve, domain="sympy"):
        return {"label": label, "seed": seed, "domain": domain, "curve": curve}
    rows = [row("dense", 0, [{"step": 0, "loss": 3.0}, {"step": 5, "loss": 2.5}, {"step": 10, "loss": 2.0}]),
            row("dense", 1, [{"step": 0, "loss": 3.0}, {"step": 5, "loss": 2.4}, {"step": 10, "loss": 2.1}]),
            row("c", 0, [{"step": 0, "loss": 3.0, "loss_coded": 3.0}, {"step": 5, "loss": 2.6, "loss_coded": 2.7},
                         {"step": 10, "loss": 2.25, "loss_coded": 2.125}]),
            row("c", 1, [{"step": 5, "loss": 2.5, "loss_coded": None}, {"step": 7, "loss": 2.2}]),  # 7: no pair
            row("c", 2, [{"step": 5, "loss": 2.5}]),                                             # no seed 2 baseline
            row("c", 0, [{"step": 5, "loss": 2.6}], domain="wiki")]                              # nor this domain
    gaps = bq.gap_curves(rows, "dense")
    assert set(gaps) == {("c", "sympy", 0, "loss"), ("c", "sympy", 0, "loss_coded"), ("c", "sympy", 1, "loss")}
    def flat(pts):
        return [x for p in pts for x in p]
    assert flat(gaps[("c", "sympy", 0, "loss")]) == pytest.approx([5, 0.1, 10, 0.25])
    # through the codec, against the baseline's dense inference (the same windows)
    assert flat(gaps[("c", "sympy", 0, "loss_coded")]) == pytest.approx([5, 0.2, 10, 0.125])
    assert flat(gaps[("c", "sympy", 1, "loss")]) == pytest.approx([5, 0.1])
