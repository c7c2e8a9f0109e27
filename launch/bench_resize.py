#!/usr/bin/env python
"""What a width change costs in quality: a run loses a replica and goes on with the one left.

    python launch/bench_resize.py [--config ds_configs/dense_dp.json] [--before 20] [--after 20]

Three runs of ``launch/train.py --engine reference`` (the reference engine simulates the DP
replicas in one process; the merge is the one the pipeline engine's checkpoint loader does, as
``tests/test_elastic.py`` checks), on the same data, seed and held-out windows:

- ``uninterrupted``: PP 2 x DP 2 for ``before + after / 2`` steps, a checkpoint at ``before``:
  the same training tokens as each resized run;
- ``average``: from that checkpoint on DP 1 (``--resume .../global_step<before>``) for ``after``
  steps; the replicas' error-feedback buffers averaged (the default,
  ``twocircuit.dp.powersgd.error_feedback_on_resize: "average"``);
- ``reset``: the same with the buffers zeroed (``--set ...error_feedback_on_resize=reset``).

Every run scores the held-out windows (dense inference) where it starts and where it ends; the
resized runs' first score is the merged model's. Writes docs/benchmarks/resize.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "docs", "benchmarks")
KEY = "twocircuit.dp.powersgd.error_feedback_on_resize"


def _train(argv: list[str]) -> tuple[dict, float, str]:
    cmd = [sys.executable, "launch/train.py", *argv]
    print("==", " ".join(shlex.quote(a) for a in cmd[1:]), flush=True)
    t0 = time.time()
    subprocess.run(cmd, cwd=ROOT, check=True)
    out = argv[argv.index("--output-dir") + 1]
    return (json.load(open(os.path.join(out, "summary.json"))), time.time() - t0,
            "python " + " ".join(shlex.quote(a) for a in cmd[1:]).replace(ROOT + "/", ""))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="ds_configs/dense_dp.json",
                   help="a config whose DP sync keeps error feedback (PowerSGD, or DiLoCo with compression)")
    p.add_argument("--before", type=int, default=20, help="steps on DP 2 before the width change")
    p.add_argument("--after", type=int, default=20, help="steps on DP 1 after it (even)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data", default="sympy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-sequences", type=int, default=512)
    p.add_argument("--work-dir", default=os.path.join(ROOT, "runs", "bench_resize"))
    p.add_argument("--out", default=OUT, help="where resize.json and resize.md go")
    args = p.parse_args()
    if args.after % 2:
        p.error("--after must be even (the uninterrupted DP-2 run trains after / 2 steps on the same tokens)")
    common = ["--engine", "reference", "--deepspeed", args.config, "--model", args.model, "--pp", "2", "--data", args.data,
              "--seed", str(args.seed), "--eval-sequences", str(args.eval_sequences), "--no-save-model"]
    work = args.work_dir
    straight = os.path.join(work, "uninterrupted")
    rows = {}
    s, secs, cmd = _train([*common, "--dp", "2", "--steps", str(args.before + args.after // 2),
                           "--save-interval", str(args.before), "--eval-every", str(args.before),
                           "--output-dir", straight])
    rows["uninterrupted"] = (s, secs, cmd)
    ckpt = os.path.join(straight, "checkpoint", f"global_step{args.before}")
    for rule in ("average", "reset"):
        out = os.path.join(work, rule)
        rows[rule] = _train([*common, "--dp", "1", "--steps", str(args.before + args.after), "--resume", ckpt,
                             "--set", f"{KEY}={rule}", "--output-dir", out])
    entries = []
    for name, (s, secs, cmd) in rows.items():
        curve = s.get("heldout_curve") or []
        at_change = next((c["loss"] for c in curve if c["step"] == args.before), None)
        entries.append({"run": name, "dp": s["mesh"]["dp"], "first_step": s["first_step"],
                        "last_step": s["first_step"] + s["steps"], "launch_tokens": s["tokens"], "heldout_loss_at_change": at_change,
                        "heldout_loss": s["heldout_loss"], "heldout_loss_se": s.get("heldout_loss_se"),
                        "wall_s": round(secs, 1), "data_fingerprint": s["data"]["fingerprint"],
                        "heldout_scored_tokens": s["data"]["heldout_scored_tokens"], "command": cmd})
    by = {e["run"]: e for e in entries}
    res = {"benchmark": "resize", "config": args.config, "before": args.before, "after": args.after,
           "seed": args.seed, "data": args.data, "entries": entries,
           "reset_minus_average": round(by["reset"]["heldout_loss"] - by["average"]["heldout_loss"], 5),
           "average_minus_uninterrupted": round(by["average"]["heldout_loss"] - by["uninterrupted"]["heldout_loss"], 5),
           "command": "python launch/bench_resize.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])}
    os.makedirs(args.out, exist_ok=True)
    json.dump(res, open(os.path.join(args.out, "resize.json"), "w"), indent=2)
    _write_table(res, os.path.join(args.out, "resize.md"))
    for e in entries:
        print(f"{e['run']:>14}: dp {e['dp']}, steps {e['first_step']}..{e['last_step']}, held-out loss "
              f"{e['heldout_loss']:.4f} (se {e['heldout_loss_se'] or 0:.3f})")


TABLE_BEGIN, TABLE_END = "<!-- table: written by launch/bench_resize.py -->", "<!-- end of table -->"


def _write_table(res, md_path):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from benchnotes import write_section
    lines = ["", "| run | DP | steps | training tokens (this launch) | held-out loss at the change | held-out loss at the end | wall s (CPU) |",
             "|---|---|---|---|---|---|---|"]
    for e in res["entries"]:
        at = f"{e['heldout_loss_at_change']:.4f}" if e["heldout_loss_at_change"] is not None else "-"
        lines.append(f"| `{e['run']}` | {e['dp']} | {e['first_step']}..{e['last_step']} | {e['launch_tokens']:,} | {at} "
                     f"| {e['heldout_loss']:.4f} ± {e['heldout_loss_se'] or 0:.3f} | {e['wall_s']:.0f} |")
    lines += ["", f"`{res['config']}`, seed {res['seed']}, `--data {res['data']}`, "
              f"{res['entries'][0]['heldout_scored_tokens']:,} held-out tokens (the same windows in every run; "
              "± is the standard error of one score). Reset minus average: "
              f"{res['reset_minus_average']:+.4f}; average minus uninterrupted: {res['average_minus_uninterrupted']:+.4f}. "
              f"Command: `{res['command']}`", ""]
    write_section(md_path, TABLE_BEGIN, TABLE_END, lines, "Resuming on another DP width: what it costs")


if __name__ == "__main__":
    main()
