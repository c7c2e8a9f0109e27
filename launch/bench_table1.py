#!/usr/bin/env python
"""The paper's Table 1, side by side, on an emulated slow mesh: every number from a command.

Rows (the paper's): Baseline (dense PP, dense DP), Baseline + DP compression, M90, M90 + AP,
M95, M95 + AP; the masked rows use DP compression too, as in the paper (their bytes/token are
below the compressed baseline's). Each row is the real launcher (`launch/train.py`, PP=2 x DP=2,
plus a Z=1 anchor replica for the AP rows) run through `launch/mesh.py`: one network namespace
per rank, every directed link capped at --mbit. Columns:

* ``bytes_per_token``: everything the project sends per trained token (summary.json), with the
  periodic traffic in steady state: DiLoCo fragment syncs (measured bytes per sync x F / H) and
  anchor traffic (measured snapshot + gradient bytes per anchor update / K);
* ``link_bytes_per_step``: the busiest directed link's bytes per step in steady state (the kernel's
  counters for PP/DP traffic, plus the anchor traffic of one stage for AP rows);
* ``link_bound_tokens_per_s``: tokens per step / (busiest link's bytes per step / bandwidth): the
  throughput the links allow when compute is free, the regime the paper's speed-ups are about;
  ``speedup`` is its ratio to the baseline's;
* ``tokens_per_s_measured``: what this CPU machine achieved on the emulated mesh (compute-bound
  here: 2 cores run 4-6 ranks of SmolLM2);
* quality columns come from the anchor-quality benchmark (single-process equivalent runs of the
  same variants, same data and steps): held-out loss with dense and with masked inference.

    sudo python launch/bench_table1.py --mbit 200 --steps 20      # docs/benchmarks/table1.{json,md}
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "docs", "benchmarks")
ROWS = [  # name, config, anchor replicas, quality variant in anchor_quality.json
    ("Baseline (dense PP, dense DP)", "dense.json", 0, "dense"),
    ("Baseline + DP compression", "dense_dp.json", 0, "dense"),
    ("M90", "m90_dp.json", 0, "m90"),
    ("M90 + AP", "m90_ap_dp.json", 1, "m90_ap"),
    ("M95", "m95_dp.json", 0, "m95"),
    ("M95 + AP", "m95_ap_dp.json", 1, "m95_ap"),
]


def run_row(name, config, z, args, work):
    out = os.path.join(work, config.replace(".json", ""))
    ranks = 4 + 2 * z
    train = ["launch/train.py", "--deepspeed", f"ds_configs/{config}", "--model", args.model, "--pp", "2",
             "--dp", "2", "--steps", str(args.steps), "--eval-sequences", "0", "--no-save-model",
             "--output-dir", out]
    if z:
        train += ["--anchor-replicas", str(z)]
    cmd = [sys.executable, "launch/mesh.py", "--ranks", str(ranks), "--mbit", str(args.mbit), "--", *train]
    print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    summary = json.load(open(os.path.join(out, "summary.json")))
    mesh = json.load(open(os.path.join(out, "mesh.json")))
    metrics = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return summary, mesh, metrics, "python " + " ".join(shlex.quote(a) for a in cmd[1:]).replace(ROOT + "/", "")


def steady_state(summary, mesh, metrics, steps, config):
    """Bytes per token and the busiest link's bytes per step, periodic traffic at its steady rate.

    Ranks are DeepSpeed's PipeDataParallelTopology (rank = stage x dp + replica): with pp = dp = 2,
    the PP links are 0<->2 and 1<->3 and the DP links 0<->1 and 2<->3, so the kernel's per-link
    counters separate the two kinds. DiLoCo syncs only every H steps and the anchor every K steps,
    which a short run catches a few times: their measured bytes per event are scaled to the rate
    of a long run (DP: per fragment sync x F / H; anchor: per update / K)."""
    cfg = json.load(open(os.path.join(ROOT, "ds_configs", config)))["twocircuit"]
    dp = cfg.get("dp", {})
    tokens_per_step = summary["tokens"] / summary["steps"]
    wb = dict(summary["wire_bytes"])
    dp_scale = 1.0
    syncs = sum(len(m.get("dp.synced_fragments") or []) for m in metrics)
    if dp.get("backend") in ("diloco", "streaming_diloco") and syncs:
        frags = dp.get("num_fragments", 1) if dp["backend"] == "streaming_diloco" else 1
        steady = wb["dp"] / syncs * frags / dp.get("inner_steps", 10) * steps
        dp_scale, wb["dp"] = steady / wb["dp"], steady
    anchor_per_step = 0.0
    an = summary.get("anchor")
    if an and wb["anchor"]:
        updates = len(range(0, steps, an["every"]))           # snapshots published in the run
        anchor_per_step = wb["anchor"] / updates / an["every"]
        wb["anchor"] = anchor_per_step * steps
    per_token = sum(wb.values()) / (tokens_per_step * steps)
    links = {}
    for link, nbytes in mesh["kernel_bytes"].items():
        i, j = (int(x) for x in link.split("->"))
        if i >= 4 or j >= 4:
            continue  # anchor ranks: their traffic is the files, added below
        is_dp = i // 2 == j // 2
        links[link] = nbytes / steps * (dp_scale if is_dp else 1.0)
    if anchor_per_step:
        for stage in range(2):  # each fast stage sends its snapshot share and gets its gradients
            links[f"stage{stage}<->anchor"] = anchor_per_step / 2
    return per_token, max(links.values()), tokens_per_step, links


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mbit", type=float, default=200.0)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rows", default=None, help="comma-separated row indices (default: all)")
    args = p.parse_args()
    command = "python launch/bench_table1.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    work = os.path.join(ROOT, "runs", "table1")
    os.makedirs(work, exist_ok=True)
    quality = {}
    qpath = os.path.join(OUT, "anchor_quality.json")
    if os.path.exists(qpath):
        quality = {v["variant"]: v for v in json.load(open(qpath))["variants"]}
    rows = []
    wanted = ROWS if not args.rows else [ROWS[int(i)] for i in args.rows.split(",")]
    for name, config, z, qvar in wanted:
        s, mesh, metrics, cmd = run_row(name, config, z, args, work)
        per_token, busiest, tps, links = steady_state(s, mesh, metrics, s["steps"], config)
        q = quality.get(qvar, {})
        rows.append({"variant": name, "config": f"ds_configs/{config}", "anchor_replicas": z,
                     "bytes_per_token": round(per_token, 1), "link_bytes_per_step": int(busiest),
                     "link_bound_tokens_per_s": round(tps / (busiest * 8 / (args.mbit * 1e6)), 1),
                     "tokens_per_s_measured": s["tokens_per_s"],
                     "heldout_loss": q.get("heldout_loss"), "heldout_loss_masked": q.get("heldout_loss_masked"),
                     "quality_variant": qvar if q else None, "quality_command": q.get("command"),
                     "wire_bytes_measured": s["wire_bytes"], "kernel_bytes": mesh["kernel_bytes"],
                     "link_bytes_per_step_by_link": {k: int(v) for k, v in links.items()},
                     "steps": s["steps"], "tokens": s["tokens"], "command": cmd})
    base = rows[0]["link_bound_tokens_per_s"] if rows and rows[0]["variant"].startswith("Baseline (") else None
    for r in rows:
        r["speedup"] = round(r["link_bound_tokens_per_s"] / base, 2) if base else None
    res = {"benchmark": "table1", "model": args.model, "mbit": args.mbit, "mesh": "pp=2 x dp=2 (+ Z=1 x pp=2 anchor)",
           "rows": rows, "command": command}
    os.makedirs(OUT, exist_ok=True)
    json.dump(res, open(os.path.join(OUT, "table1.json"), "w"), indent=2)
    print(f"{'variant':32} {'bytes/token':>12} {'link-bound tok/s':>17} {'speed-up':>9} {'measured tok/s':>15}")
    for r in rows:
        print(f"{r['variant']:32} {r['bytes_per_token']:>12,.0f} {r['link_bound_tokens_per_s']:>17,.0f} "
              f"{str(r['speedup']):>9} {r['tokens_per_s_measured']:>15,.1f}")


if __name__ == "__main__":
    main()
