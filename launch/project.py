#!/usr/bin/env python
"""Projected tokens/s of each method on a GPU mesh joined by slow links (a cost model, not a run).

    python launch/project.py --model-size 1.24e9 --hidden 2048 --mesh 8x8 --link-mbit 200 --gpu-tflops 125

``--mesh PPxDP``: pipeline stages x data-parallel replicas. Per method, the boundary bytes per
token follow from the codec (``--wire-bytes`` per value: 2 for bf16), the DP bytes from the DP
method (a ring all-reduce of every gradient, or the measured compression of
docs/benchmarks/dp.json for PowerSGD + Streaming DiLoCo), and the step time from
``ds_twocircuit.costmodel`` (1F1B with its bubbles, blocking sends, exposed DP time). The output
is labelled a projection; ``--out DIR`` writes ``projection.json`` and ``projection.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # launch/: bench_table1, benchnotes

from ds_twocircuit.costmodel import Setting, compute_only, ring_allreduce_bytes, step_breakdown  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DP_JSON = os.path.join(ROOT, "docs", "benchmarks", "dp.json")


def measured_dp_ratio(path: str = DP_JSON) -> float:
    """x fewer DP bytes than the all-reduce in the training loop, PowerSGD + Streaming DiLoCo
    (docs/benchmarks/dp.json, measured on SmolLM2)."""
    with open(path) as f:
        d = json.load(f)
    for e in d["entries"]:
        if e["backend"] == "powersgd+streaming_diloco":
            return float(e["dp_bytes_reduction_training_vs_allreduce"])
    raise KeyError(f"{path}: no powersgd+streaming_diloco entry")


DP200 = "ds_configs/lowrank_dp200.json"     # Streaming DiLoCo with 4-bit all-gathered pseudo-gradients


def methods(hidden: int, wire_bytes: int, lowrank_rank: int, lowrank_bits: int, dp_ratio: float) -> dict:
    """name -> (boundary bytes per token each way, DP sync, low-rank state or None). DP sync:
    ``None`` (a ring all-reduce of every gradient, every step), a number (that divided by the
    measured reduction, synced as ``dense_dp.json`` schedules it), a config file whose quantised
    sync is costed from its own settings (:func:`quant_sync_bytes_per_step`), or (file, collective):
    that sync with ``quant.collective`` set."""
    k95 = max(1, round(0.05 * hidden))
    lowrank = lowrank_rank * lowrank_bits / 8 + 2        # one group: values + its bf16 scale
    return {
        "dense": (hidden * wire_bytes, None, None),
        "dense + DP compression": (hidden * wire_bytes, dp_ratio, None),
        "M95 (paper codec)": (k95 * wire_bytes, None, None),
        "M95 + DP compression": (k95 * wire_bytes, dp_ratio, None),
        f"low-rank {lowrank_rank}x{lowrank_bits}b + DP compression (ours)": (lowrank, dp_ratio, lowrank_rank),
        f"low-rank {lowrank_rank}x{lowrank_bits}b + 4-bit DiLoCo (lowrank_dp200)": (lowrank, DP200, lowrank_rank),
        f"low-rank {lowrank_rank}x{lowrank_bits}b + 4-bit DiLoCo, reduce-scatter": (lowrank, (DP200, "reduce_scatter"),
                                                                              lowrank_rank),
    }


def quant_sync_bytes_per_step(config: str, stage_params: float, dp: int, collective: str | None = None) -> float:
    """Bytes one rank sends per step, on average, in the quantised Streaming DiLoCo sync of
    ``config``: one of F fragments (``stage_params / F`` values) every H / F steps, each value at
    ``bits`` bits plus a bf16 scale per ``block``; all-gathered (a rank sends its payload to each of
    the other ``dp - 1`` replicas: the bytes grow with the replicas) or, with ``collective``
    ``"reduce_scatter"`` (or the config's), ``2 (dp - 1) / dp`` of it (the shape of an all-reduce)."""
    import dataclasses
    from bench_table1 import dp_config
    cfg = dp_config(config)
    if cfg.backend != "streaming_diloco" or getattr(cfg, "compression", None) != "quant":
        raise ValueError(f"{config}: not a quantised Streaming DiLoCo sync")
    quant = dataclasses.replace(cfg.quant, collective=collective) if collective else cfg.quant
    _, every, _ = cfg.sync_schedule()
    return quant.sync_bytes(int(stage_params / cfg.num_fragments), dp) / every


def validation_setting(row: dict, params: float, framing: float) -> Setting:
    """The cost model's setting of one emulated Table-1 row (``launch/bench_table1.py``): PP = 2 x
    DP = 2, the row's measured bytes per token by kind (payload x ``framing``: the kernel cap
    charges TCP/IP headers), its DP backend's sync schedule (:func:`dp_schedule`), and a per-stage
    compute rate calibrated on the row's own uncapped run (so the model's compute-only step equals
    the measured one and what is validated is the communication). The anchor's snapshots and gradients travel as files in the emulation, not
    over the capped links, so they cost no link time here. The stages are balanced by compute, not
    by parameters (SmolLM2's embedding and untied head make one stage's gradients 1.17x the mean),
    and the step waits for the heavier stage's all-reduce: the DP bytes per rank are the mean
    scaled by the busiest DP link's share of the kernel's counters (:func:`dp_imbalance`)."""
    pp = dp = 2
    m, tokens_per_micro = row["micro_batches"], row["tokens_per_micro"]
    tokens_per_step = row["tokens_per_step"]
    co = row["tokens_per_s_compute_only"]
    t_compute = tokens_per_step / co
    flops = (m + pp - 1) * 6.0 * (params / pp) * tokens_per_micro / t_compute
    k = row["bytes_by_kind"]
    return Setting(params=params, pp=pp, dp=dp, micro_batches=m, tokens_per_micro=tokens_per_micro, flops=flops,
                   link_mbit=row["link_mbit"],
                   bytes_per_token=max(k["pp_activations"], k["pp_gradients"]) * framing,
                   state_bytes_per_step=k["codec_state"] * tokens_per_step / dp * framing,
                   dp_bytes_per_rank=k["dp"] * tokens_per_step / (pp * dp) * framing * dp_imbalance(row),
                   **dp_schedule(row.get("config")))


def dp_imbalance(row: dict) -> float:
    """Busiest DP link over the mean DP link, bytes per step from the kernel's counters; 1 without
    per-link counts."""
    from bench_table1 import link_kind
    links = [v for k, v in row.get("link_bytes_per_step_by_link", {}).items() if link_kind(k) == "dp"]
    mean = sum(links) / len(links) if links else 0.0
    return max(links) / mean if mean > 0 else 1.0


def dp_schedule(config: str | None) -> dict:
    """The cost model's ``dp_sync_every`` / ``dp_overlap_steps`` for a config's DP backend
    (the ``sync_schedule`` of the backend's own config class, ds_twocircuit/dp/<backend>.py)."""
    if not config:
        return {}
    from bench_table1 import dp_config
    _, every, overlap = dp_config(config).sync_schedule()
    return {"dp_sync_every": every, "dp_overlap_steps": overlap}


def validate(table1: dict, framing: float) -> list[dict]:
    """Predicted vs measured tokens/s for every emulated row with a compute-only run."""
    out = []
    for r in table1["rows"]:
        if not r.get("tokens_per_s_compute_only"):
            continue
        s = validation_setting({**r, "link_mbit": table1["link_mbit"]}, table1["params"], framing)
        pred = step_breakdown(s)["tokens_per_s"]
        out.append({"variant": r["variant"], "link_mbit": table1["link_mbit"], "measured_tokens_per_s": r["tokens_per_s"],
                    "predicted_tokens_per_s": round(pred, 2), "error": round(pred / r["tokens_per_s"] - 1, 4)})
    return out


def write_validation(rows: list[dict], table1_path: str, out_dir: str, target: float = 0.10) -> None:
    from benchnotes import write_section
    path = os.path.join(out_dir, "projection.json")
    d = json.load(open(path)) if os.path.exists(path) else {}
    d["validation"] = {"against": os.path.relpath(table1_path, ROOT), "target_abs_error": target, "rows": rows,
                       "within_target": all(abs(r["error"]) <= target for r in rows)}
    with open(path, "w") as f:
        json.dump(d, f, indent=2)
    lines = [f"Checked against the emulated runs of `{os.path.relpath(table1_path, ROOT)}` (each row's compute "
             f"rate calibrated on its own uncapped run; target: within {target:.0%}):", "",
             "| row | link Mbit/s | measured tokens/s | predicted | error |", "|---|---|---|---|---|"]
    for r in rows:
        flag = "" if abs(r["error"]) <= target else " (outside the target)"
        lines.append(f"| {r['variant']} | {r['link_mbit']:g} | {r['measured_tokens_per_s']:,.1f} | "
                     f"{r['predicted_tokens_per_s']:,.1f} | {r['error']:+.1%}{flag} |")
    write_section(os.path.join(out_dir, "projection.md"), "<!-- validation: written by launch/project.py --validate -->",
                  "<!-- end of validation -->", lines, "Throughput projection")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-size", type=float, required=True, help="parameters, e.g. 1.24e9")
    p.add_argument("--hidden", type=int, required=True, help="hidden size (boundary width)")
    p.add_argument("--mesh", default="8x8", help="PPxDP, e.g. 8x8")
    p.add_argument("--link-mbit", type=float, default=200.0)
    p.add_argument("--latency-ms", type=float, default=0.0)
    p.add_argument("--gpu-tflops", type=float, default=125.0, help="effective TFLOP/s per GPU (peak x MFU)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--micro-batches", type=int, default=8, help="per step and replica")
    p.add_argument("--wire-bytes", type=int, default=2, help="bytes per value on the wire (bf16: 2)")
    p.add_argument("--grad-bytes", type=int, default=2, help="bytes per gradient value in the DP sync")
    p.add_argument("--lowrank-rank", type=int, default=112, help="coefficients per token (bf16: half of fp32's 224)")
    p.add_argument("--lowrank-bits", type=int, default=4)
    p.add_argument("--refreshes", type=int, default=4, help="low-rank state refreshes over --steps")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--out", default=None, help="write projection.json / projection.md here")
    p.add_argument("--validate", default=None, metavar="TABLE1_JSON",
                   help="also check the model against emulated runs (docs/benchmarks/table1.json from "
                        "launch/bench_table1.py): predicted vs measured tokens/s per row")
    args = p.parse_args(argv)
    try:
        pp, dp = (int(x) for x in args.mesh.lower().split("x"))
    except ValueError:
        p.error(f"--mesh {args.mesh!r}: expected PPxDP, e.g. 8x8")
    dp_ratio = measured_dp_ratio()
    base = Setting(params=args.model_size, pp=pp, dp=dp, micro_batches=args.micro_batches,
                   tokens_per_micro=args.micro_batch * args.seq_len, flops=args.gpu_tflops * 1e12,
                   link_mbit=args.link_mbit, latency_s=args.latency_ms / 1e3)
    dense_dp = ring_allreduce_bytes(args.grad_bytes * args.model_size / pp, dp)
    rows = []
    for name, (bpt, dp_sync, rank) in methods(args.hidden, args.wire_bytes, args.lowrank_rank, args.lowrank_bits,
                                              dp_ratio).items():
        state = 0.0
        if rank is not None:  # mean + basis + per-direction scales, bf16, each refresh, amortised
            state = args.refreshes * (args.hidden + rank * args.hidden + rank) * 2 / args.steps
        if dp_sync is None:                   # the all-reduce, every step
            dp_bytes, sched = dense_dp, {}
        elif isinstance(dp_sync, (str, tuple)):   # a quantised sync, from its config's own settings
            path, collective = (dp_sync, None) if isinstance(dp_sync, str) else dp_sync
            dp_bytes = quant_sync_bytes_per_step(path, args.model_size / pp, dp, collective)
            sched = dp_schedule(path)
        else:  # PowerSGD + Streaming DiLoCo as in dense_dp.json: the measured reduction, its schedule
            dp_bytes, sched = dense_dp / dp_sync, dp_schedule("ds_configs/dense_dp.json")
        s = base.replace(bytes_per_token=bpt, state_bytes_per_step=state, dp_bytes_per_rank=dp_bytes, **sched)
        b = step_breakdown(s)
        wire_per_token = (2 * (pp - 1) * (bpt * s.tokens_per_micro * s.micro_batches + state) * dp
                          + dp * pp * s.dp_bytes_per_rank) / b["tokens_per_step"]
        rows.append({"method": name, "tokens_per_s": round(b["tokens_per_s"], 1),
                     "share_of_compute_only": round(b["tokens_per_s"] / step_breakdown(compute_only(s))["tokens_per_s"], 4),
                     "bytes_per_token": round(wire_per_token, 1), "boundary_bytes_per_token_each_way": bpt,
                     "step_s": round(b["step_s"], 3), "compute_s": round(b["compute_s"], 3),
                     "boundary_s": round(b["boundary_s"], 3), "dp_exposed_s": round(b["dp_exposed_s"], 3)})
    dense_tps = rows[0]["tokens_per_s"]
    for r in rows:
        r["speedup_vs_dense"] = round(r["tokens_per_s"] / dense_tps, 2)
    command = "python launch/project.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    out = {"kind": "projection (cost model, not a measurement)", "command": command,
           "setting": {**vars(args), "pp": pp, "dp": dp, "dp_compression_measured_x": dp_ratio}, "rows": rows}
    lines = [f"**Projection** (ds_twocircuit.costmodel, not a measurement): {args.model_size:.3g} parameters, "
             f"mesh {pp}x{dp}, {args.link_mbit:g} Mbit/s, {args.gpu_tflops:g} effective TFLOP/s per GPU, "
             f"{args.micro_batches} x {args.micro_batch} x {args.seq_len} tokens per replica and step. "
             f"Command: `{command}`", "",
             "| method | tokens/s | x dense | share of compute-only | bytes/token | step s (compute / boundaries / DP) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['tokens_per_s']:,.0f} | {r['speedup_vs_dense']:.1f} | "
                     f"{r['share_of_compute_only']:.0%} | {r['bytes_per_token']:,.0f} | {r['step_s']:.2f} "
                     f"({r['compute_s']:.2f} / {r['boundary_s']:.2f} / {r['dp_exposed_s']:.2f}) |")
    print("\n".join(lines))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "projection.json"), "w") as f:
            json.dump(out, f, indent=2)
        from benchnotes import write_section   # keeps the hand-written prose around the table
        write_section(os.path.join(args.out, "projection.md"), "<!-- projection: written by launch/project.py -->",
                      "<!-- end of projection -->", lines, "Throughput projection")
    if args.validate:
        from ds_twocircuit.pacing import FRAMING
        rows_v = validate(json.load(open(args.validate)), FRAMING)
        out["validation"] = rows_v
        for r in rows_v:
            print(f"validation: {r['variant']}: measured {r['measured_tokens_per_s']:,.1f} tokens/s, predicted "
                  f"{r['predicted_tokens_per_s']:,.1f} ({r['error']:+.1%})")
        if args.out:
            write_validation(rows_v, os.path.abspath(args.validate), args.out)
    return out


if __name__ == "__main__":
    main()
