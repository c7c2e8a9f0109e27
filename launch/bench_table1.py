#!/usr/bin/env python
"""The paper's Table 1, side by side, on an emulated slow mesh: every number from a command.

Each row is the real launcher (`launch/train.py`, PP = 2 x DP = 2, plus a Z = 1 anchor replica of
2 ranks for the AP rows) run through `launch/mesh.py`: one network namespace per rank, every
directed link capped by the kernel (HTB). Every row trains the same tokens per step; a row is run
twice, on capped links and uncapped (its compute-only rate on this machine).

Rows: Baseline (dense PP, dense DP), Baseline + DP compression, Top-K 90 (dense DP), M90, M90 + AP, M95 (dense
DP), M95, M95 + AP, and the recommended low-rank codec; "+ DP" rows use PowerSGD + Streaming DiLoCo
(`dense_dp.json`). Columns:

* ``tokens_per_s``: measured on the capped links, steady state (mean step time over the steps after
  the first; DiLoCo rows are timed over ``--cycles`` full cycles of H steps after the first one,
  in which every fragment's sync is launched and waited for once per cycle);
* ``tokens_per_s_compute_only``: the same row on uncapped links; ``share_of_compute_only`` their ratio;
* ``bytes_per_token`` and ``bytes_by_kind`` (PP activations, PP gradients, codec state, DP, anchor,
  other = handshakes and tied embeddings), periodic traffic at its steady rate (DiLoCo syncs,
  anchor updates);
* ``link_bytes_per_step``: the busiest directed link's bytes per step (the kernel's counters);
* ``speedup``: measured tokens/s over the Baseline's, at the same link rate;
* quality columns (held-out loss, dense inference): from the full-stack study's rows of each row's
  own config (``docs/benchmarks/fullstack.jsonl``: PP 2 x DP 2, its DP sync and anchors included;
  SmolLM2-135M only); ``-`` where that config's full stack has not been measured.

The regime. This machine computes ~100x slower than the paper's A100s, so at 200 Mbit/s its links
are not the bottleneck. ``--paper-equivalent`` first runs the Baseline uncapped, then sets the link
rate so that the Baseline's communication / computation ratio equals the paper's: in Table 1 the
best row (46.5k tokens/s) is taken as compute-bound and the Baseline makes 1.1k, so a Baseline step
is 42.3 compute steps, 41.3 of them communication. Rate = busiest link's bytes per step x 8 /
(41.3 x compute-only step time). Both the paper's rate and the equivalent rate are reported.

    python launch/bench_table1.py --paper-equivalent             # the table (root: network namespaces)
    python launch/bench_table1.py --mbit 200                      # at a given rate
    python launch/bench_table1.py --sweep 25,50,100,200,500,1000  # tokens/s vs link rate (PNG)
    python launch/bench_table1.py --add-rows 2,3,4 ...            # more rows, at the stored table's rate
    python launch/bench_table1.py --paced-rows 9 ...              # a stored row again with the software
                                      # throttle (train.py --pace-mbit, no namespaces, no root)
    python launch/bench_table1.py --sweep 14.35,28.7 --from-table docs/benchmarks/table1.json ...
                                      # a sweep reusing the table's compute-only runs and its rate's point
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
OUT = os.path.join(ROOT, "docs", "benchmarks")
# name, config, anchor replicas (a row's quality: the full-stack study's rows of its own config)
ROWS = [
    ("Baseline (dense PP, dense DP)", "dense.json", 0),
    ("Baseline + DP compression", "dense_dp.json", 0),
    ("Top-K 90 (dense DP)", "topk90.json", 0),
    ("M90", "m90_dp.json", 0),
    ("M90 + AP", "m90_ap_dp.json", 1),
    ("M95 (dense DP)", "m95.json", 0),
    ("M95", "m95_dp.json", 0),
    ("M95 + AP", "m95_ap_dp.json", 1),
    ("Low-rank 224x4b (recommended)", "lowrank_dp.json", 0),
    ("Low-rank 224x4b + 4-bit DiLoCo", "lowrank_dp200.json", 0),
]
FULLSTACK = "fullstack.jsonl"     # launch/bench_quality.py rows on PP 2 x DP 2: the table's mesh
SWEEP_ROWS = (0, 1, 6, 7, 8, 9)
# The paper's Table 1 (64 x A100, 200 Mbit/s): Baseline 1.1k tokens/s, M95 + AP + DP compression
# 46.5k (42.3x); the latter taken as compute-bound.
PAPER = {"link_mbit": 200.0, "baseline_tokens_per_s": 1100.0, "best_tokens_per_s": 46500.0,
         "baseline_bytes_per_token": 22900.0, "best_bytes_per_token": 446.0}


def paper_comm_ratio(paper: dict = PAPER) -> float:
    """Communication / computation time of the paper's Baseline step (Table 1, best row compute-bound)."""
    return paper["best_tokens_per_s"] / paper["baseline_tokens_per_s"] - 1.0


def paper_equivalent_mbit(link_bytes_per_step: float, compute_step_s: float, ratio: float) -> float:
    """The link rate (Mbit/s) at which sending ``link_bytes_per_step`` over the busiest link takes
    ``ratio`` times the compute-only step."""
    if link_bytes_per_step <= 0 or compute_step_s <= 0 or ratio <= 0:
        raise ValueError("need positive bytes per step, compute step time and ratio")
    return link_bytes_per_step * 8.0 / (ratio * compute_step_s) / 1e6


def dp_config(config: str):
    """The parsed ``twocircuit.dp`` section of a config (``m95.json`` or ``ds_configs/m95.json``),
    defaults filled in as the run fills them."""
    from ds_twocircuit.config import TwoCircuitConfig, load_ds_config
    return TwoCircuitConfig.from_dict(load_ds_config(config).get("twocircuit", {})).dp


def link_kind(link: str) -> str | None:
    """``"dp"`` or ``"pp"`` for a directed link ``"I->J"`` between fast ranks (DeepSpeed's
    PipeDataParallelTopology with pp = dp = 2: rank = stage x 2 + replica, so a DP link joins two
    ranks of one stage); None for the anchor's ranks (4, 5) and the anchor's estimated links."""
    m = re.fullmatch(r"(\d+)->(\d+)", link)
    if not m or max(int(m.group(1)), int(m.group(2))) >= 4:
        return None
    return "dp" if int(m.group(1)) // 2 == int(m.group(2)) // 2 else "pp"


def cycle_steps(config: str) -> int:
    """Steps in one period of the row's traffic (DiLoCo: H, every fragment syncs once; else 1)."""
    return dp_config(config).sync_schedule()[0]


def steady_step_s(metrics: list[dict], period: int, cycles: int = 1) -> float:
    """Mean step time in steady state: the steps after the first; with periodic traffic (DiLoCo,
    period H), ``cycles`` full cycles after the first one (steps H+1 .. (cycles+1) H: every
    fragment's sync is launched and waited for in them ``cycles`` times, also with overlap, and no
    start-up is in them)."""
    if period > 1:
        end = (cycles + 1) * period + 1
        if len(metrics) < end:
            raise ValueError(f"a row with a period of {period} steps needs at least {end} steps")
        return statistics.fmean(m["step_s"] for m in metrics[period + 1:end])
    times = [m["step_s"] for m in metrics[1:]] or [m["step_s"] for m in metrics]
    return statistics.fmean(times)


def run_row(config, z, args, work, mbit, tag, steps):
    out = os.path.join(work, f"{config.replace('.json', '')}_{tag}")
    ranks = 4 + 2 * z
    train = ["launch/train.py", "--deepspeed", f"ds_configs/{config}", "--model", args.model, "--pp", "2",
             "--dp", "2", "--steps", str(steps), "--seq-len", str(args.seq_len), "--eval-sequences", "0",
             "--no-save-model", "--output-dir", out]
    if args.micro_batches:
        train += ["--grad-accum", str(args.micro_batches)]
    if z:
        train += ["--anchor-replicas", str(z)]
    cmd = [sys.executable, "launch/mesh.py", "--ranks", str(ranks), "--mbit", f"{mbit:g}", "--", *train]
    print(f"== {config} at {'uncapped' if not mbit else f'{mbit:g} Mbit/s'}: {' '.join(cmd[1:])}", flush=True)
    p = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if p.returncode:
        sys.stderr.write(p.stderr[-6000:])
        raise SystemExit(f"error: the row {config} at {mbit:g} Mbit/s failed (exit {p.returncode}); its command: "
                         + " ".join(cmd[1:]))
    summary = json.load(open(os.path.join(out, "summary.json")))
    mesh = json.load(open(os.path.join(out, "mesh.json")))
    metrics = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return summary, mesh, metrics, "python " + " ".join(shlex.quote(a) for a in cmd[1:]).replace(ROOT + "/", "")


def paced_command(config, args, out, mbit, steps, port) -> list[str]:
    """The row as plain processes on this host (torchrun, no namespaces) with the software
    throttle pacing every link at ``mbit``: what a user without root sees."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_addr", "127.0.0.1",
           "--master_port", str(port), "launch/train.py", "--deepspeed", f"ds_configs/{config}", "--model", args.model,
           "--pp", "2", "--dp", "2", "--steps", str(steps), "--seq-len", str(args.seq_len), "--eval-sequences", "0",
           "--no-save-model", "--pace-mbit", f"{mbit:g}", "--output-dir", out]
    if args.micro_batches:
        cmd += ["--grad-accum", str(args.micro_batches)]
    return cmd


def measure_paced(row, args, work, mbit) -> dict:
    """tokens/s of one row under the software throttle at ``mbit``, timed as :func:`measure` times
    the kernel-capped run (the same steady-state steps)."""
    from ds_twocircuit.adapters.dist import free_port
    name, config, z = row
    if z:
        raise SystemExit(f"error: --paced-rows: {name} has an anchor replica, whose files the throttle does not pace")
    period = cycle_steps(config)
    steps = max(args.steps, (args.cycles + 1) * period + 2) if period > 1 else args.steps
    out = os.path.join(work, f"{config.replace('.json', '')}_{mbit:g}mbit_paced")
    cmd = paced_command(config, args, out, mbit, steps, free_port())
    print(f"== {config} paced at {mbit:g} Mbit/s: {' '.join(cmd[1:])}", flush=True)
    p = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if p.returncode:
        sys.stderr.write(p.stderr[-6000:])
        raise SystemExit(f"error: the row {config} paced at {mbit:g} Mbit/s failed (exit {p.returncode})")
    summary = json.load(open(os.path.join(out, "summary.json")))
    if summary.get("pace_mbit") != mbit:
        raise SystemExit(f"error: {out}/summary.json: the run was not paced at {mbit:g} Mbit/s")
    metrics = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    tps = summary["tokens"] / summary["steps"]
    shown = cmd[1:8] + ["PORT"] + cmd[9:]                                 # any free port
    return {"tokens_per_s": round(tps / steady_step_s(metrics, period, args.cycles), 2),
            "command": "python " + " ".join(shlex.quote(a) for a in shown).replace(ROOT + "/", "")}


def steady_state(summary, mesh, metrics, steps, config):
    """Bytes per token by kind and the busiest link's bytes per step, periodic traffic at its
    steady rate.

    Ranks are DeepSpeed's PipeDataParallelTopology (rank = stage x dp + replica): with pp = dp = 2,
    the PP links are 0<->2 and 1<->3 and the DP links 0<->1 and 2<->3, so the kernel's per-link
    counters separate the two kinds. DiLoCo syncs only every H steps and the anchor every K steps,
    which a short run catches a few times: their measured bytes per event are scaled to the rate
    of a long run (DP: per sync / the steps between syncs, H / F, the end-of-run average left out;
    anchor: per update / K)."""
    period, sync_every, _ = dp_config(config).sync_schedule()
    tokens_per_step = summary["tokens"] / summary["steps"]
    wb = dict(summary["wire_bytes"])
    dp_scale = 1.0
    syncs = sum(len(m.get("dp.synced_fragments") or []) for m in metrics)
    if period > 1 and syncs:
        # the end-of-run exact average (in wire_bytes.dp) is not a periodic sync
        periodic = wb["dp"] - summary.get("dp_final_sync_bytes", 0)
        steady = periodic / syncs / sync_every * steps
        dp_scale, wb["dp"] = steady / wb["dp"], steady
    anchor_per_step = 0.0
    an = summary.get("anchor")
    if an and wb["anchor"]:
        updates = len(range(0, steps, an["every"]))           # snapshots published in the run
        anchor_per_step = wb["anchor"] / updates / an["every"]
        wb["anchor"] = anchor_per_step * steps
    tokens = tokens_per_step * steps
    by_kind = {"pp_activations": wb["pp_activations"] / tokens, "pp_gradients": wb["pp_gradients"] / tokens,
               "codec_state": (wb["pp_codec_state"] + wb.get("pp_grad_state", 0)) / tokens, "dp": wb["dp"] / tokens,
               "anchor": wb["anchor"] / tokens, "other": (wb["pp_handshake"] + wb["pp_tied"]) / tokens}
    links = {}
    for link, nbytes in mesh["kernel_bytes"].items():
        kind = link_kind(link)
        if kind is None:
            continue  # anchor ranks: their traffic is the files, added below
        links[link] = nbytes / steps * (dp_scale if kind == "dp" else 1.0)
    if anchor_per_step:
        for stage in range(2):  # each fast stage sends its snapshot share and gets its gradients
            links[f"stage{stage}<->anchor"] = anchor_per_step / 2
    return sum(by_kind.values()), by_kind, max(links.values()), tokens_per_step, links


def measure(row, args, work, mbit, tag):
    name, config, z = row
    period = cycle_steps(config)
    steps = max(args.steps, (args.cycles + 1) * period + 2) if period > 1 else args.steps
    s, mesh, metrics, cmd = run_row(config, z, args, work, mbit, tag, steps)
    per_token, by_kind, busiest, tps, links = steady_state(s, mesh, metrics, s["steps"], config)
    step_s = steady_step_s(metrics, period, args.cycles)
    c, dpt = s["config"], s["dp_comm_s_all_ranks"]
    return {"tokens_per_s": round(tps / step_s, 2), "step_s": round(step_s, 4), "steps": s["steps"],
            "parameters": s["parameters"]["total"], "micro_batches": c["gradient_accumulation_steps"], "tokens_per_micro": c["micro_batch_size"] * c["seq_len"],
            "dp_hidden_share": round(dpt["hidden"] / dpt["total"], 3) if dpt["total"] else 0.0,
            "timed_steps": args.cycles * period if period > 1 else s["steps"] - 1,
            "tokens_per_step": tps, "bytes_per_token": round(per_token, 1),
            "bytes_by_kind": {k: round(v, 1) for k, v in by_kind.items()}, "link_bytes_per_step": int(busiest),
            "link_bytes_per_step_by_link": {k: int(v) for k, v in links.items()},
            "wire_bytes_measured": s["wire_bytes"], "kernel_bytes": mesh["kernel_bytes"], "command": cmd}


def quality_of(config: str, domain: str = "sympy") -> dict:
    """A row's held-out loss: the mean over seeds of the full-stack study's rows of its own config
    file (PP 2 x DP 2, DP compression and anchors included, the rows' token count), on ``domain``;
    nothing (the table shows -) where that config has not been measured there."""
    path = os.path.join(OUT, FULLSTACK)
    if not os.path.exists(path):
        return {}
    label = os.path.splitext(os.path.basename(config))[0]
    latest = {}
    for line in open(path):
        if line.strip():
            r = json.loads(line)
            if (r["label"] == label and r["domain"] == domain and r.get("dp") == 2 and r.get("pp") == 2
                    and not r.get("overrides")):
                latest[r["seed"]] = r                           # the newest run of each seed
    if not latest:
        return {}
    recs = [latest[k] for k in sorted(latest)]
    tokens = {r["tokens"] for r in recs}
    return {"heldout_loss": round(statistics.fmean(r["heldout_loss"] for r in recs), 4),
            "quality_from": f"docs/benchmarks/{FULLSTACK} ({label}, {len(recs)} seed{'s' if len(recs) > 1 else ''}, "
                            + "/".join(f"{t:,}" for t in sorted(tokens)) + " tokens)"}


def sweep_speedups(sweep: dict) -> dict:
    """Each series' tokens/s over the Baseline's at the same rate, where both were measured."""
    base = next((v for k, v in sweep["series"].items() if k.startswith("Baseline (")), None)
    if base is None:
        return {}
    return {name: {r: round(v["tokens_per_s"] / base["capped"][r]["tokens_per_s"], 2)
                   for r, v in series["capped"].items() if r in base["capped"]}
            for name, series in sweep["series"].items()}


def plot_sweep(sweep: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    speedups = sweep_speedups(sweep)
    fig, axes = plt.subplots(1, 2 if speedups else 1, figsize=(12.5 if speedups else 7.5, 4.8), squeeze=False)
    ax = axes[0][0]
    for k, (name, series) in enumerate(sweep["series"].items()):
        color = f"C{k}"
        pts = sorted((float(r), v["tokens_per_s"]) for r, v in series["capped"].items())
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=name)
        if series.get("compute_only"):
            ax.axhline(series["compute_only"]["tokens_per_s"], color=color, ls=":", lw=1)
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s (measured, all replicas)")
    ax.set_title("Throughput vs link rate (dotted: compute-only)", fontsize=10)
    ax.legend(fontsize=8)
    if speedups:
        bx = axes[0][1]
        for k, (name, sp) in enumerate(speedups.items()):
            pts = sorted((float(r), v) for r, v in sp.items())
            bx.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=f"C{k}", label=name)
        bx.set_ylabel("speed-up over the Baseline at the same rate")
        bx.set_title("Speed-up vs link rate", fontsize=10)
    for a in axes[0]:
        a.set_xscale("log")
        a.set_xticks(sweep["rates_mbit"], [f"{r:g}" for r in sweep["rates_mbit"]])
        a.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        a.set_xlabel("link rate, Mbit/s (each direction, every link)")
        a.grid(True, which="both", alpha=0.3)
        if sweep.get("paper_equivalent_mbit"):
            a.axvline(sweep["paper_equivalent_mbit"], color="grey", ls="--", lw=1)
            a.annotate("paper-equivalent", (sweep["paper_equivalent_mbit"], 1), xycoords=("data", "axes fraction"),
                       xytext=(3, -12), textcoords="offset points", fontsize=8, color="grey")
    fig.suptitle(f"{sweep['model']}, PP=2 x DP=2, measured on emulated links", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_sweep_markdown(sweep: dict, path: str) -> None:
    """The sweep as a table: tokens/s at each rate (speed-up over the Baseline in brackets)."""
    from benchnotes import write_section
    rates = [f"{r:g}" for r in sweep["rates_mbit"]]
    sp = sweep.get("speedup") or {}
    lines = [f"Model {sweep['model']}, mesh {sweep['mesh']}, sequence length {sweep['seq_len']}. Command: "
             f"`{sweep['command']}`" + (f"; compute-only runs and the {sweep['paper_equivalent_mbit']:g} Mbit/s "
                                         f"(paper-equivalent) points from `{sweep['from_table']}`"
                                         if sweep.get("from_table") else "")
             + "".join(f"; earlier rows kept from `{c}`" for c in sweep.get("commands_before", [])), "",
             "| variant | compute-only | " + " | ".join(f"{r} Mbit/s" for r in rates) + " |",
             "|---|---|" + "---|" * len(rates)]
    for name, series in sweep["series"].items():
        co = series.get("compute_only")
        cells = []
        for r in rates:
            v = series["capped"].get(r)
            x = sp.get(name, {}).get(r)
            cells.append("-" if v is None else f"{v['tokens_per_s']:,.1f}" + (f" ({x:g}x)" if x is not None else ""))
        lines.append(f"| {name} | {co['tokens_per_s']:,.1f} | " if co else f"| {name} | - | ")
        lines[-1] += " | ".join(cells) + " |"
    lines += ["", "Tokens/s measured on the capped links (all replicas); in brackets the speed-up over the "
              "Baseline at the same rate. Plot: [table1_sweep.png](table1_sweep.png)."]
    write_section(path, "<!-- table: written by launch/bench_table1.py --sweep -->", "<!-- end of table -->",
                  lines, "Table 1: throughput vs link rate")


def write_markdown(res: dict, path: str) -> None:
    from benchnotes import write_section  # launch/, next to this script
    lines = [f"Link rate {res['link_mbit']:g} Mbit/s"
             + (f" (paper-equivalent: the Baseline's communication / computation ratio equals the paper's "
                f"{res['paper_comm_ratio']:.1f} at 200 Mbit/s)" if res.get("paper_equivalent_mbit") else "")
             + f"; mesh {res['mesh']}; model {res['model']}. Command: `{res['command']}`"
             + "".join(f"; rows added by `{c}`" for c in res.get("commands_added", [])), "",
             "| variant | tokens/s | compute-only | share | speed-up | bytes/token | PP act / grad / state | DP | anchor "
             "| busiest link B/step | held-out loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        k = r["bytes_by_kind"]
        loss = f"{r['heldout_loss']:.3f}" if r.get("heldout_loss") is not None else "-"
        share = f"{r['share_of_compute_only']:.0%}" if r.get("share_of_compute_only") is not None else "-"
        co = f"{r['tokens_per_s_compute_only']:,.1f}" if r.get("tokens_per_s_compute_only") else "-"
        lines.append(f"| {r['variant']} | {r['tokens_per_s']:,.1f} | {co} | {share} | {r['speedup']}x | "
                     f"{r['bytes_per_token']:,.0f} | {k['pp_activations']:,.0f} / {k['pp_gradients']:,.0f} / "
                     f"{k['codec_state']:,.1f} | {k['dp']:,.0f} | {k['anchor']:,.0f} | {r['link_bytes_per_step']:,} "
                     f"| {loss} |")
    paced = [r for r in res["rows"] if r.get("share_of_compute_only_paced") is not None]
    if paced:
        lines += ["", f"The software throttle (`train.py --pace-mbit {res['link_mbit']:g}`: plain processes, no "
                  "namespaces or root; the project paces its own sends) on the same rows, share of the compute-only rate "
                  "against the kernel cap's: " + "; ".join(
                      f"{r['variant']}: {r['share_of_compute_only_paced']:.0%} ({r['tokens_per_s_paced']:,.1f} tokens/s; "
                      f"kernel cap {r['share_of_compute_only']:.0%})" for r in paced)
                  + ". Commands: " + "; ".join(f"`{c}`" for c in res.get("commands_paced", [])) + "."]
    sources = sorted({r["quality_from"] for r in res["rows"] if r.get("quality_from")})
    lines += ["", ("Held-out losses (dense inference) from the full-stack study of each row's own config: "
                   + "; ".join(sources) + ". '-': that config's full stack is not measured yet.") if sources else
              "No held-out losses: the full-stack study measured SmolLM2-135M, not this model, or none of these configs."]
    write_section(path, "<!-- table: written by launch/bench_table1.py -->", "<!-- end of table -->", lines,
                  "Table 1 on an emulated slow mesh")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mbit", type=float, default=200.0, help="link rate of the table (default 200)")
    p.add_argument("--paper-equivalent", action="store_true",
                   help="derive the link rate from an uncapped Baseline run (see above) instead of --mbit")
    p.add_argument("--sweep", default=None, help="comma-separated link rates: tokens/s of the sweep rows at each")
    p.add_argument("--steps", type=int, default=4, help="steps per run (DiLoCo rows: at least (cycles + 1) H + 2)")
    p.add_argument("--cycles", type=int, default=1,
                   help="DiLoCo rows: full cycles of H steps timed after the first one (default 1; more "
                        "average out the syncs' spread on a busy machine)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batches", type=int, default=None, help="micro-batches per step (default: the config's)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rows", default=None, help="comma-separated row indices (default: all; sweep: "
                   f"{','.join(map(str, SWEEP_ROWS))})")
    p.add_argument("--add-rows", default=None,
                   help="comma-separated row indices to add to the table already in --out, at its link rate "
                        "and settings (a long table in parts; the Baseline it holds stays the reference)")
    p.add_argument("--paced-rows", default=None,
                   help="comma-separated row indices of the table already in --out to run again with the software "
                        "throttle at its link rate (train.py --pace-mbit; plain processes: no root needed)")
    p.add_argument("--no-compute-only", action="store_true", help="skip the uncapped runs")
    p.add_argument("--refresh-quality", action="store_true",
                   help="run nothing: rewrite the stored table's held-out loss column from the full-stack study's "
                        "rows as they are now (docs/benchmarks/fullstack.jsonl, written by launch/bench_quality.py)")
    p.add_argument("--from-table", default=None,
                   help="sweep: a stored table1.json run with the same settings; rows it holds take their "
                        "compute-only run and their point at its link rate from it (added to the rates)")
    p.add_argument("--out", default=OUT, help="folder for table1.json / .md (sweep: table1_sweep.json / .png)")
    args = p.parse_args()
    command = "python launch/bench_table1.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    if args.refresh_quality:
        if args.sweep or args.add_rows or args.paced_rows or args.paper_equivalent or args.rows:
            sys.exit("error: --refresh-quality runs nothing: --sweep, --add-rows, --paced-rows, "
                     "--paper-equivalent and --rows do not apply")
        path = os.path.join(args.out, "table1.json")
        if not os.path.exists(path):
            sys.exit(f"error: --refresh-quality: no table at {path} (run the table first)")
        res = json.load(open(path))
        refresh_quality(res)
        json.dump(res, open(path, "w"), indent=2)
        return finish(res, args.out)
    if args.paced_rows:
        if args.sweep or args.add_rows or args.paper_equivalent or args.rows:
            sys.exit("error: --paced-rows runs stored rows at the stored table's rate: --sweep, --add-rows, "
                     "--paper-equivalent and --rows do not apply")
        return paced_rows(args, command)
    if os.geteuid() != 0:
        sys.exit("error: the emulated mesh needs root (network namespaces); see launch/mesh.py")
    work = os.path.join(ROOT, "runs", "table1")
    os.makedirs(work, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    if args.from_table and not args.sweep:
        sys.exit("error: --from-table only applies to --sweep")
    if args.from_table and not os.path.exists(args.from_table):
        sys.exit(f"error: --from-table: no table at {args.from_table} (run the table first, or leave the flag out)")
    if args.sweep:
        rates = [float(x) for x in args.sweep.split(",")]
        idx = [int(i) for i in args.rows.split(",")] if args.rows else list(SWEEP_ROWS)
        table = stored_table(args.from_table, args, "--from-table") if args.from_table else None
        if table:
            rates = sorted({*rates, table["link_mbit"]})
        sweep = {"benchmark": "table1_sweep", "model": args.model, "mesh": "pp=2 x dp=2", "rates_mbit": rates,
                 "seq_len": args.seq_len, "series": {}, "command": command,
                 "from_table": args.from_table, "paper_equivalent_mbit": (table or {}).get("paper_equivalent_mbit")}
        kept = stored_sweep(os.path.join(args.out, "table1_sweep.json"), sweep, [ROWS[i][0] for i in idx])
        if kept:
            sweep.update(kept)
            print(f"sweep: keeping the stored series of {', '.join(kept['series'])} (other rows: not re-run)", flush=True)
        for i in idx:
            sweep["series"][ROWS[i][0]] = sweep_series(ROWS[i], args, work, rates, table)
            json.dump(sweep, open(os.path.join(args.out, "table1_sweep.json"), "w"), indent=2)
        order = [r[0] for r in ROWS]
        sweep["series"] = dict(sorted(sweep["series"].items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 99))
        sweep["speedup"] = sweep_speedups(sweep)
        json.dump(sweep, open(os.path.join(args.out, "table1_sweep.json"), "w"), indent=2)
        plot_sweep(sweep, os.path.join(args.out, "table1_sweep.png"))
        write_sweep_markdown(sweep, os.path.join(args.out, "table1_sweep.md"))
        print(f"wrote {args.out}/table1_sweep.json, .md and .png")
        return
    if args.add_rows:
        if args.paper_equivalent or args.rows:
            sys.exit("error: --add-rows runs at the stored table's link rate, on the rows it names: "
                     "--paper-equivalent and --rows do not apply")
        return add_rows(args, work, command)
    wanted = [ROWS[int(i)] for i in args.rows.split(",")] if args.rows else ROWS
    ratio, equivalent, uncapped = paper_comm_ratio(), None, {}
    if args.paper_equivalent:
        base = ROWS[0]
        uncapped[base[0]] = measure(base, args, work, 0, "uncapped")
        b = uncapped[base[0]]
        equivalent = paper_equivalent_mbit(b["link_bytes_per_step"], b["step_s"], ratio)
        print(f"paper-equivalent link rate: {equivalent:.2f} Mbit/s (Baseline: {b['link_bytes_per_step']:,} B per "
              f"step on its busiest link, {b['step_s']:.2f} s per step uncapped, ratio {ratio:.1f})", flush=True)
    mbit = round(equivalent, 3) if equivalent else args.mbit
    rows = []
    for row in wanted:
        rows.append(table_row(row, args, work, mbit, uncapped))
        relative_to_baseline(rows)
        res = {"benchmark": "table1", "model": args.model, "link_mbit": mbit, "paper_link_mbit": PAPER["link_mbit"],
               "paper_equivalent_mbit": round(equivalent, 3) if equivalent else None,
               "paper_comm_ratio": round(ratio, 2), "paper": PAPER,
               "mesh": "pp=2 x dp=2 (+ Z=1 x pp=2 anchor for AP rows)", "seq_len": args.seq_len, "params": rows[0]["parameters"],
               "rows": rows, "command": command}
        json.dump(res, open(os.path.join(args.out, "table1.json"), "w"), indent=2)   # after every row
    finish(res, args.out)


def table_row(row, args, work, mbit, uncapped: dict) -> dict:
    name = row[0]
    if not args.no_compute_only and name not in uncapped:
        uncapped[name] = measure(row, args, work, 0, "uncapped")
    m = measure(row, args, work, mbit, f"{mbit:g}mbit")
    co = uncapped.get(name)
    return {"variant": name, "config": f"ds_configs/{row[1]}", "anchor_replicas": row[2], **m,
            "tokens_per_s_compute_only": co["tokens_per_s"] if co else None,
            "share_of_compute_only": round(m["tokens_per_s"] / co["tokens_per_s"], 3) if co else None,
            "command_compute_only": co["command"] if co else None,
            **(quality_of(row[1]) if args.model == "smollm2-135m" else {})}


def relative_to_baseline(rows: list[dict]) -> None:
    base = rows[0]["tokens_per_s"] if rows[0]["variant"].startswith("Baseline (") else None
    for r in rows:
        r["speedup"] = round(r["tokens_per_s"] / base, 2) if base else None
        r["bytes_reduction"] = round(rows[0]["bytes_per_token"] / r["bytes_per_token"], 1) if base else None


def stored_table(path: str, args, flag: str) -> dict:
    """The table at ``path``, checked to have been run with this run's model, sequence length and
    micro-batches (rows measured with other settings are not comparable)."""
    res = json.load(open(path))
    first = res["rows"][0]
    stored = {"--model": res["model"], "--seq-len": res["seq_len"], "--micro-batches": first["micro_batches"]}
    given = {"--model": args.model, "--seq-len": args.seq_len,
             "--micro-batches": args.micro_batches or first["micro_batches"]}
    for key in stored:
        if stored[key] != given[key]:
            sys.exit(f"error: {flag}: {path} was run with {key} {stored[key]}, this run has {given[key]}: "
                     "give the same settings")
    return res


def stored_sweep(path: str, sweep: dict, names: list[str]) -> dict:
    """What a stored sweep at ``path`` keeps when only ``names`` are run again: the series of its
    other rows and the commands that measured them, if it was run with the same model, sequence
    length and reference table; else nothing (it is replaced)."""
    if not os.path.exists(path):
        return {}
    old = json.load(open(path))
    if any(old.get(k) != sweep[k] for k in ("model", "seq_len", "from_table")):
        return {}
    series = {k: v for k, v in old["series"].items() if k not in names}
    if not series:
        return {}
    return {"series": series, "rates_mbit": sorted({*old["rates_mbit"], *sweep["rates_mbit"]}),
            "commands_before": [*old.get("commands_before", []), old["command"]]}


def sweep_series(row, args, work, rates, table: dict | None) -> dict:
    """One row of the sweep: tokens/s at each rate, and compute-only. With ``table`` (a stored
    table of the same settings holding this row), its compute-only run and its point at the
    table's rate are taken from there instead of being measured again."""
    name, config = row[0], row[1]
    series = {"config": f"ds_configs/{config}", "capped": {}}
    stored = next((r for r in (table or {}).get("rows", []) if r["variant"] == name), None)
    if stored is not None:
        series["from_table"] = True
        if stored.get("tokens_per_s_compute_only"):
            series["compute_only"] = {"tokens_per_s": stored["tokens_per_s_compute_only"],
                                      "command": stored["command_compute_only"]}
        series["capped"][f"{table['link_mbit']:g}"] = {k: stored[k] for k in (
            "tokens_per_s", "step_s", "steps", "bytes_per_token", "link_bytes_per_step", "command")}
    if not args.no_compute_only and "compute_only" not in series:
        series["compute_only"] = measure(row, args, work, 0, "uncapped")
    for r in rates:
        if f"{r:g}" not in series["capped"]:
            series["capped"][f"{r:g}"] = measure(row, args, work, r, f"{r:g}mbit")
    return series


def add_rows(args, work, command) -> None:
    """Rows added to a stored table at its link rate, with the settings its rows were run with."""
    path = os.path.join(args.out, "table1.json")
    if not os.path.exists(path):
        sys.exit(f"error: --add-rows: no table to add to at {path} (run the table first)")
    res = stored_table(path, args, "--add-rows")
    names = [r[0] for r in ROWS]
    mbit, uncapped = res["link_mbit"], {}
    res["commands_added"] = [*res.get("commands_added", []), command]
    for i in (int(x) for x in args.add_rows.split(",")):
        row = ROWS[i]
        res["rows"] = [r for r in res["rows"] if r["variant"] != row[0]]
        res["rows"].append(table_row(row, args, work, mbit, uncapped))
        res["rows"].sort(key=lambda r: names.index(r["variant"]))
        relative_to_baseline(res["rows"])
        refresh_quality(res)
        json.dump(res, open(path, "w"), indent=2)   # after every row
    finish(res, args.out)


def paced_rows(args, command) -> None:
    """Rows of the stored table run again with the software throttle at the table's rate: their
    share of the compute-only rate, beside the kernel cap's."""
    path = os.path.join(args.out, "table1.json")
    if not os.path.exists(path):
        sys.exit(f"error: --paced-rows: no table at {path} (run the table first)")
    res = stored_table(path, args, "--paced-rows")
    work = os.path.join(ROOT, "runs", "table1")
    os.makedirs(work, exist_ok=True)
    res["commands_paced"] = [*res.get("commands_paced", []), command]
    for i in (int(x) for x in args.paced_rows.split(",")):
        row = ROWS[i]
        stored = next((r for r in res["rows"] if r["variant"] == row[0]), None)
        if stored is None or not stored.get("tokens_per_s_compute_only"):
            sys.exit(f"error: --paced-rows: row {i} ({row[0]}) has no kernel-capped and compute-only run in {path}: "
                     f"add it first (--add-rows {i})")
        m = measure_paced(row, args, work, res["link_mbit"])
        stored.update({"tokens_per_s_paced": m["tokens_per_s"], "command_paced": m["command"],
                       "share_of_compute_only_paced": round(m["tokens_per_s"] / stored["tokens_per_s_compute_only"], 3)})
        json.dump(res, open(path, "w"), indent=2)   # after every row
    finish(res, args.out)


def refresh_quality(res: dict) -> None:
    """Every row's quality columns from the quality benchmarks as they are now (a stored row's
    may predate a seed added since)."""
    if res["model"] != "smollm2-135m":
        return
    configs = {r[0]: r[1] for r in ROWS}
    for r in res["rows"]:
        r.pop("heldout_loss", None), r.pop("quality_from", None)
        if r["variant"] in configs:
            r.update(quality_of(configs[r["variant"]]))


def finish(res: dict, out: str) -> None:
    rows = res["rows"]
    write_markdown(res, os.path.join(out, "table1.md"))
    print(f"{'variant':32} {'tok/s':>9} {'compute-only':>13} {'speed-up':>9} {'bytes/token':>12}")
    for r in rows:
        print(f"{r['variant']:32} {r['tokens_per_s']:>9,.1f} {str(r['tokens_per_s_compute_only']):>13} "
              f"{str(r['speedup']):>9} {r['bytes_per_token']:>12,.0f}")


if __name__ == "__main__":
    main()
