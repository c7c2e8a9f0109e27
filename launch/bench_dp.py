#!/usr/bin/env python
"""DP-compression benchmark: all-reduce vs PowerSGD vs DiLoCo vs PowerSGD + Streaming DiLoCo.

Side by side in one run on the default model: the real launcher (`deepspeed --num_gpus 2
launch/train.py --pp 1 --dp 2`) trains the same steps on the same data with each DP backend;
the table reports DP bytes per token (summed over ranks, as counted where sent), total bytes per
token, and the held-out loss (dense inference) after the same number of tokens.

    python launch/bench_dp.py            # writes docs/benchmarks/dp.{json,md}
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "docs", "benchmarks")

BACKENDS = {
    "allreduce": {"backend": "allreduce"},
    "powersgd": {"backend": "powersgd", "powersgd": {"matrix_approximation_rank": 64, "start_powerSGD_iter": 2}},
    "diloco": {"backend": "diloco", "inner_steps": 10, "outer_lr": 0.7, "outer_momentum": 0.9},
    # why plain DiLoCo loses in short fine-tuning. Suspect: the outer Nesterov momentum, under which
    # consistent pseudo-gradients move the weights 1.3x, 1.9x, 2.4x, 2.9x the replicas' mean progress
    # at the first four syncs. The same H with plain averaging (outer lr 1, no momentum: every H
    # steps the replicas' mean) and with the outer lr but no momentum
    "diloco_avg": {"backend": "diloco", "inner_steps": 10, "outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False},
    "diloco_m0": {"backend": "diloco", "inner_steps": 10, "outer_lr": 0.7, "outer_momentum": 0.0, "nesterov": False},
    "powersgd+streaming_diloco": {
        "backend": "streaming_diloco", "inner_steps": 10, "num_fragments": 2, "overlap": True, "overlap_steps": 1,
        "outer_lr": 0.7, "outer_momentum": 0.9, "compression": "powersgd",
        "powersgd": {"matrix_approximation_rank": 64, "start_powerSGD_iter": 0}},
    # the same sync without the outer momentum (the setting the diagnostics above point to), and
    # at H = 20: past 100x fewer DP bytes than the all-reduce in the training loop
    "powersgd+streaming_avg": {
        "backend": "streaming_diloco", "inner_steps": 10, "num_fragments": 2, "overlap": True, "overlap_steps": 1,
        "outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False, "compression": "powersgd",
        "powersgd": {"matrix_approximation_rank": 64, "start_powerSGD_iter": 0}},
    "powersgd+streaming_avg_h20": {
        "backend": "streaming_diloco", "inner_steps": 20, "num_fragments": 2, "overlap": True, "overlap_steps": 1,
        "outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False, "compression": "powersgd",
        "powersgd": {"matrix_approximation_rank": 64, "start_powerSGD_iter": 0}},
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--backends", default=",".join(BACKENDS),
                   help="the rows to (re)measure; the other rows of an existing docs/benchmarks/dp.json of the "
                        "same protocol (steps, model, data, batch, held-out windows) are kept")
    p.add_argument("--eval-sequences", type=int, default=512,
                   help="held-out windows scored at the start and the end (default 512: the protocol's 65,536 "
                        "tokens, a standard error of ~0.025)")
    p.add_argument("--data", default="sympy", help="the corpus (launch/train.py --data; default the pinned sympy)")
    args = p.parse_args()
    unknown = [b for b in args.backends.split(",") if b not in BACKENDS]
    if unknown:
        p.error(f"--backends: unknown {', '.join(unknown)}; known: {', '.join(BACKENDS)}")
    command = "python launch/bench_dp.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    work = os.path.join(ROOT, "runs", "bench_dp")
    os.makedirs(work, exist_ok=True)
    base = json.load(open(os.path.join(ROOT, "ds_configs", "dense.json")))
    entries = []
    for name in args.backends.split(","):
        cfg = json.loads(json.dumps(base))
        cfg["twocircuit"]["dp"] = BACKENDS[name]
        path = os.path.join(work, f"{name}.json")
        json.dump(cfg, open(path, "w"), indent=2)
        out = os.path.join(work, name)
        ds = os.path.join(os.path.dirname(sys.executable), "deepspeed")
        run = [ds, "--num_gpus", "2", "--master_port", str(free_port()), "launch/train.py", "--deepspeed", path,
               "--model", args.model, "--data", args.data, "--pp", "1", "--dp", "2", "--steps", str(args.steps),
               "--micro-batch-size", str(args.micro_batch_size), "--grad-accum", str(args.grad_accum),
               "--eval-sequences", str(args.eval_sequences), "--no-save-model", "--output-dir", out]
        print(f"== {name}: {' '.join(run)}", flush=True)
        subprocess.run(run, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        s = json.load(open(os.path.join(out, "summary.json")))
        rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
        hidden = sum(r.get("dp.hidden_comm_s", 0.0) for r in rows)
        comm = sum(r.get("dp.comm_s", 0.0) for r in rows)
        entries.append({
            "backend": name, "dp_config": BACKENDS[name],
            "bytes_per_token": s["bytes_per_token"],
            "dp_bytes_per_token": round(s["wire_bytes"]["dp"] / s["tokens"], 3),
            # the end-of-run sync that makes DiLoCo replicas agree is included above; without it:
            "dp_final_sync_bytes": s["dp_final_sync_bytes"],
            "dp_bytes_per_token_training": round((s["wire_bytes"]["dp"] - s["dp_final_sync_bytes"]) / s["tokens"], 3),
            "loss": s["heldout_loss"], "heldout_loss_first": s["heldout_loss_first"],
            "heldout_loss_se": s.get("heldout_loss_se"), "data": s["data"]["spec"],
            "data_fingerprint": s["data"]["fingerprint"], "heldout_scored_tokens": s["data"]["heldout_scored_tokens"],
            "train_loss_last5": round(sum(r["loss"] for r in rows[-5:]) / 5, 4),
            "tokens": s["tokens"], "tokens_per_s": s["tokens_per_s"],
            "dp_comm_s_rank0": round(comm, 3), "dp_hidden_comm_s_rank0": round(hidden, 3),
            "replicas_identical_at_end": s["dp_replicas_identical"],
            "command": " ".join(shlex.quote(a) for a in ["deepspeed"] + run[1:]).replace(work, "runs/bench_dp"),
        })
    protocol = {"steps": args.steps, "model": args.model, "data": args.data, "micro_batch_size": args.micro_batch_size,
                "grad_accum": args.grad_accum, "eval_sequences": args.eval_sequences}
    entries = _merge_with_kept_rows(entries, protocol)
    ref = next((e for e in entries if e["backend"] == "allreduce"), None)
    if ref is None:
        sys.exit("bench_dp: no allreduce row to compare with (measure it: --backends allreduce,...)")
    def reduction(e, key):  # x fewer bytes than the all-reduce run
        return round(ref[key] / e[key], 2) if e[key] else None
    for e in entries:
        e["dp_bytes_reduction_vs_allreduce"] = reduction(e, "dp_bytes_per_token")
        e["dp_bytes_reduction_training_vs_allreduce"] = reduction(e, "dp_bytes_per_token_training")
        e["loss_vs_allreduce"] = round(e["loss"] / ref["loss"] - 1.0, 5)
    res = {"benchmark": "dp", "model": args.model, "mesh": {"pp": 1, "dp": 2}, "steps": args.steps,
           "protocol": protocol,
           "entries": entries, "targets": {"powersgd+streaming_diloco": ">= 50x fewer DP bytes per token than "
                                           "allreduce, held-out loss within 2%"},
           "command": command}
    os.makedirs(OUT, exist_ok=True)
    json.dump(res, open(os.path.join(OUT, "dp.json"), "w"), indent=2)
    _write_table(res, os.path.join(OUT, "dp.md"))
    for e in entries:
        print(f"{e['backend']:>28}: dp bytes/token {e['dp_bytes_per_token']:>12,.1f} "
              f"({e['dp_bytes_reduction_vs_allreduce']}x less), held-out loss {e['loss']:.4f} "
              f"({100 * e['loss_vs_allreduce']:+.2f}%)")


def _merge_with_kept_rows(entries: list[dict], protocol: dict) -> list[dict]:
    """This run's rows, plus the rows of the existing dp.json that this run did not measure, if
    that file was measured under the same protocol; in the order of BACKENDS. Each row keeps its
    own command."""
    path = os.path.join(OUT, "dp.json")
    old = json.load(open(path)) if os.path.isfile(path) else {}
    kept = []
    if old.get("protocol") == protocol:
        new = {e["backend"] for e in entries}
        kept = [e for e in old.get("entries", []) if e["backend"] not in new and e["backend"] in BACKENDS]
        for e in kept:
            e.setdefault("measured_by", old.get("command"))
    order = list(BACKENDS)
    return sorted(entries + kept, key=lambda e: order.index(e["backend"]))


TABLE_BEGIN, TABLE_END = "<!-- table: written by launch/bench_dp.py -->", "<!-- end of table -->"


def _write_table(res, md_path):
    """Replace the table between the markers of the Markdown note (the prose around it is kept)."""
    from benchnotes import write_section  # launch/, next to this script
    lines = ["",
             "| backend | DP bytes/token | x fewer than all-reduce | DP bytes/token, training only "
             "| x fewer, training only | held-out loss | vs all-reduce | tokens/s (CPU) | replicas identical at end |",
             "|---|---|---|---|---|---|---|---|---|"]
    for e in res["entries"]:
        lines.append(f"| `{e['backend']}` | {e['dp_bytes_per_token']:,.0f} | {e['dp_bytes_reduction_vs_allreduce']} "
                     f"| {e['dp_bytes_per_token_training']:,.0f} | {e['dp_bytes_reduction_training_vs_allreduce']} "
                     f"| {e['loss']:.4f} "
                     f"| {100 * e['loss_vs_allreduce']:+.2f}% | {e['tokens_per_s']:.0f} "
                     f"| {e['replicas_identical_at_end']} |")
    e0 = res["entries"][0]
    lines += ["", f"{res['steps']} steps, {e0['tokens']:,} tokens per run on `--data {e0.get('data', 'stdlib')}`, "
              f"held-out loss before training {e0['heldout_loss_first']:.4f}"
              + (f", standard error of one held-out loss {max(e['heldout_loss_se'] or 0 for e in res['entries']):.3f} "
                 f"({e0['heldout_scored_tokens']:,} tokens)" if e0.get("heldout_loss_se") else "")
              + f". Command: `{res['command']}`", ""]
    write_section(md_path, TABLE_BEGIN, TABLE_END, lines, "DP compression")


if __name__ == "__main__":
    main()
