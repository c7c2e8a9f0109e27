#!/usr/bin/env python
"""Quality study: held-out loss of the shipped configs, trained side by side on the same protocol.

Every run is ``launch/train.py --engine reference`` on one config file (plus ``--set`` overrides), so a
row comes from the code path a user runs: the Trainer, the config's codec objects at the pipeline's
boundaries, its DP backend on simulated replicas and its anchor correction in-process, the bytes
counted by the same meter as on a real mesh. The same data order, seeds, token count and held-out
windows for every config; the held-out loss is scored dense (how a user scores the checkpoint) and
through the codec (how the mesh serves it), at the start, every ``--eval-every`` steps and at the end.

    python launch/bench_quality.py --configs dense,lowrank --seeds 0,1,2 --steps 250 --data sympy
    python launch/bench_quality.py --configs lowrank --set twocircuit.codec.groups='[[112,4]]' --seeds 0
    python launch/bench_quality.py --report     # docs/benchmarks/quality.{json,md,png} from the rows
    python launch/bench_quality.py --configs dense,lowrank20 --steps 20 --eval-sequences 0 --seeds 1 ...
                                                # a screen: the paired training-loss gap only

Each run appends one row to ``--results`` (JSON lines) as soon as it ends; ``--report`` builds the
table: per config (and overrides) and domain, the mean over seeds, the seed-to-seed spread, the
standard error of one held-out loss, and the paired per-seed differences with the baseline config
(dense boundaries, all-reduce) on the same seeds. Every row also keeps the run's per-step training
losses: the report pairs them step by step with the baseline's on the same seed (the same batches),
a screen that needs no held-out evaluation (``--eval-sequences 0``: such rows appear only there).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "docs", "benchmarks", "quality.jsonl")
BASELINE = "dense"


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="dense,lowrank",
                   help="comma-separated config files or shipped config names (ds_configs/<name>.json)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of every config (dotted path, JSON value), as launch/train.py --set")
    p.add_argument("--label", default=None, help="the rows' name for the overridden config (default: file + overrides)")
    p.add_argument("--seeds", default="0")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--data", default="sympy", help="comma-separated corpora (launch/train.py --data)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--pp", type=int, default=2, help="stages: the boundaries a pp-stage pipeline has")
    p.add_argument("--dp", type=int, default=1, help="DP replicas (simulated in one process)")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="sequences per micro-batch (default: the config's); with --grad-accum, the same "
                        "tokens a step in fewer, larger micro-batches (a GPU's fast layout)")
    p.add_argument("--grad-accum", type=int, default=None, help="micro-batches per step (default: the config's)")
    p.add_argument("--device", default="cpu", help="where the reference engine computes: cpu (default) or cuda[:N]")
    p.add_argument("--eval-sequences", type=int, default=512)
    p.add_argument("--eval-every", type=int, default=0, help="a held-out point every N steps (0: start and end)")
    p.add_argument("--save-dir", default=None,
                   help="keep each trained model as a Hugging Face folder <save-dir>/<label>_<data>_seed<S>")
    p.add_argument("--work-dir", default=os.path.join(ROOT, "runs", "quality"))
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="keep each finished run's checkpoint folder (default: removed once its row is "
                        "written; a SmolLM2 run on PP 2 x DP 2 keeps 7-13 GB; a run cut short keeps its "
                        "checkpoint and continues from it)")
    p.add_argument("--results", default=RESULTS)
    p.add_argument("--baseline", default=BASELINE, help="the config the others are compared with")
    p.add_argument("--report", action="store_true", help="build the JSON/Markdown/PNG from the results")
    p.add_argument("--min-ratio-bf16", type=float, default=20.0,
                   help="--report: recommend only configs with at least this many times fewer boundary bytes "
                        "than bf16 (default 20)")
    p.add_argument("--min-dp-ratio", type=float, default=0.0,
                   help="--report: ... and at least this many times fewer DP bytes in the training loop than "
                        "the baseline's all-reduce, both as a bf16 run sends them (the study runs in fp32; "
                        "default 0: no DP condition)")
    p.add_argument("--within", type=float, default=0.01,
                   help="--report: ... and a held-out loss within this fraction of the baseline's (default 0.01)")
    p.add_argument("--min-seeds", type=int, default=2,
                   help="--report: ... measured with at least this many seeds on every domain (default 2)")
    p.add_argument("--title", default="Quality at the boundary bytes of each config",
                   help="--report: the Markdown note's title")
    p.add_argument("--readme", default=None,
                   help="--report: also rewrite a short table of the study between the lines "
                        "'<!-- quality: written by launch/bench_quality.py --report --readme -->' and "
                        "'<!-- end of quality -->' of this Markdown file (how the README's codec table reads "
                        "from docs/benchmarks/quality.json); both lines must be there")
    return p.parse_args(argv)


def label_of(config: str, overrides: list[str], label: str | None) -> str:
    if label:
        return label
    name = os.path.splitext(os.path.basename(config))[0]
    return name + "".join(f" {o}" for o in overrides)


def train_argv(args, config: str, seed: int, data: str, out: str) -> list[str]:
    argv = ["--engine", "reference", "--deepspeed", config, "--model", args.model, "--data", data,
            "--steps", str(args.steps), "--seed", str(seed), "--seq-len", str(args.seq_len), "--pp", str(args.pp),
            "--dp", str(args.dp), "--eval-sequences", str(args.eval_sequences), "--output-dir", out,
            "--resume", "auto"]   # a study cut short continues from the run's last checkpoint
    if args.eval_every:
        argv += ["--eval-every", str(args.eval_every)]
    if args.micro_batch_size:
        argv += ["--micro-batch-size", str(args.micro_batch_size)]
    if args.grad_accum:
        argv += ["--grad-accum", str(args.grad_accum)]
    if args.device != "cpu":
        argv += ["--device", args.device]
    if not args.save_dir:
        argv.append("--no-save-model")
    for o in args.overrides:
        argv += ["--set", o]
    return argv


def row_of(summary: dict, label: str, config: str, overrides: list[str], command: str) -> dict:
    """One row of the study from a run's ``summary.json``."""
    # the whole run: a resumed launch's ``wire_bytes`` and ``tokens`` count the steps since its resume;
    # ``run`` (carried by its checkpoints) counts everything since step 0. Without it (a checkpoint
    # written before it existed) the bytes are per token of the resumed part, as the row says.
    run = summary.get("run")
    steps = summary["first_step"] + summary["steps"]
    if run is not None:
        wb, tokens_run = run["wire_bytes"], run["tokens"]
        tokens = tokens_run
    else:
        wb, tokens_run = summary["wire_bytes"], summary["tokens"]
        tokens = tokens_run // summary["steps"] * steps
    hidden, links = summary["hidden_size"], summary["mesh"]["pp"] - 1
    back_state = wb.get("pp_grad_state", 0)   # state sent back with the gradients (absent in older rows)
    pp = wb["pp_activations"] + wb["pp_gradients"] + wb["pp_codec_state"] + back_state
    per_token = pp / (2 * tokens_run * links) if links else 0.0   # per boundary, per direction, state included
    # each direction on its own (a codec may spend differently each way), with the state it carries
    fwd = (wb["pp_activations"] + wb["pp_codec_state"]) / (tokens_run * links) if links else 0.0
    bwd = (wb["pp_gradients"] + back_state) / (tokens_run * links) if links else 0.0
    dtype_bytes = 4   # the study trains in fp32 (the reference engine); bf16 users: the _bf16 ratio
    final = summary.get("dp_final_sync_bytes", 0)   # the end-of-run sync that makes replicas agree
    first = summary["heldout_curve"][0] if summary.get("heldout_curve") else {}
    return {
        "label": label, "config": config, "overrides": overrides, "seed": summary["config"]["seed"],
        "domain": summary["data"]["spec"], "data_fingerprint": summary["data"]["fingerprint"],
        "steps": steps, "first_step": summary["first_step"], "tokens": tokens,
        "bytes_over": "the whole run" if run is not None or not summary["first_step"] else
                      f"steps {summary['first_step']}-{steps} (resumed; earlier launches' bytes unknown)",
        "dp": summary["mesh"]["dp"],
        "pp": summary["mesh"]["pp"],
        "micro_batch_size": summary["config"].get("micro_batch_size"),
        "gradient_accumulation_steps": summary["config"].get("gradient_accumulation_steps"),
        "device": summary["config"].get("device", "cpu"),
        "codec": summary["codec"], "dp_backend": summary["dp_backend"],
        "anchor": (summary["config"]["twocircuit"]["anchor"]["correction"]
                   if summary["config"]["twocircuit"]["anchor"]["enabled"] else None),
        "clean_every": summary["config"]["twocircuit"].get("clean_every", 0),
        "pp_bytes_per_token": round(per_token, 3),
        "pp_bytes_ratio": round(hidden * dtype_bytes / per_token, 3) if per_token else None,
        "pp_bytes_ratio_bf16": round(hidden * 2 / per_token, 3) if per_token else None,
        "pp_bytes_per_token_fwd": round(fwd, 3), "pp_bytes_per_token_bwd": round(bwd, 3),
        # the busier direction against a bf16 boundary: the bound a per-direction budget must meet
        "pp_bytes_ratio_bf16_busier": round(hidden * 2 / max(fwd, bwd), 3) if max(fwd, bwd) else None,
        "pp_codec_state_bytes": wb["pp_codec_state"], "pp_grad_state_bytes": back_state,
        "dp_bytes": wb["dp"], "anchor_bytes": wb["anchor"], "dp_final_sync_bytes": final,
        "bytes_per_token_by_kind": {k: round(v / tokens_run, 3) for k, v in sorted(wb.items())},
        "dp_bytes_per_token": round(wb["dp"] / tokens_run, 3),
        "dp_bytes_per_token_training": round((wb["dp"] - final) / tokens_run, 3),
        "heldout_loss": summary.get("heldout_loss"), "heldout_loss_coded": summary.get("heldout_loss_masked"),
        "heldout_stderr": summary.get("heldout_loss_se"),
        "heldout_loss_base": first.get("loss"), "heldout_loss_base_coded": first.get("loss_coded"),
        "heldout_tokens": summary["data"]["heldout_scored_tokens"],
        "curve": summary.get("heldout_curve", []), "train_loss_last": summary["loss_last"],
        "tokens_per_s": summary["tokens_per_s"], "command": command,
    }


def _rel(path: str) -> str:
    """A path inside the checkout as the commands print it (relative: they run from the checkout)."""
    path = os.path.abspath(path)
    return os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else path


def run(args) -> None:
    from ds_twocircuit import train
    from ds_twocircuit.config import resolve_config
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    base_cmd = "python launch/bench_quality.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    configs = [resolve_config(c if c.endswith(".json") or "/" in c else f"{c}.json") for c in args.configs.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    for data in args.data.split(","):
        for config in configs:
            label = label_of(config, args.overrides, args.label)
            for seed in seeds:
                # the whole protocol in the run's folder: --resume auto only ever continues the same run
                proto = f"{args.model}_s{args.steps}_l{args.seq_len}_pp{args.pp}_dp{args.dp}" + (
                    f"_mb{args.micro_batch_size}" if args.micro_batch_size else "") + (
                    f"_ga{args.grad_accum}" if args.grad_accum else "")
                tag = f"{label.replace(' ', '_').replace('/', '_')}_{data}_seed{seed}"[:100] + "_" + proto
                out = os.path.join(args.save_dir or args.work_dir, tag)   # <out>/hf: the model
                argv = train_argv(args, _rel(config), seed, data, _rel(out))
                cwd = os.getcwd()
                os.chdir(ROOT)           # the printed command runs from the checkout
                try:
                    rc = train.run(argv)
                finally:
                    os.chdir(cwd)
                if rc != 0:
                    sys.exit(f"launch/train.py {' '.join(shlex.quote(a) for a in argv)} exited with {rc}")
                summary = json.load(open(os.path.join(out, "summary.json")))
                cmd = "python launch/train.py " + " ".join(shlex.quote(a) for a in argv)
                row = row_of(summary, label, _rel(config), args.overrides, cmd)
                row["study_command"] = base_cmd
                row["train_losses"] = train_losses(out)
                os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
                with open(args.results, "a") as f:
                    f.write(json.dumps(row) + "\n")
                if not args.keep_checkpoints:   # the row is written: the run is done
                    shutil.rmtree(os.path.join(out, "checkpoint"), ignore_errors=True)
                held = "-" if row["heldout_loss"] is None else f"{row['heldout_loss']:.4f}"
                print(f"[bench_quality] {label} {data} seed {seed}: held-out {held} "
                      f"(coded {row['heldout_loss_coded']}), {row['pp_bytes_per_token']} bytes/token/direction",
                      flush=True)


def train_losses(out: str) -> list[float]:
    """The run's training loss at every step since step 0 (the Trainer keeps ``metrics.jsonl`` across
    a resume, each step once)."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f if line.strip()]


def _length_free(row: dict) -> bool:
    """Whether the row's first N steps are those of a longer run of its config (the same batches and
    learning rates): no learning-rate scheduler, which could depend on the run's length."""
    if any(str(o).startswith("scheduler") for o in row.get("overrides") or []):
        return False
    try:
        with open(row["config"]) as f:
            return "scheduler" not in json.load(f)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _baseline_for(r: dict, base: dict):
    """The baseline row of ``r``'s domain and seed: of the same length, else (a short screen) the
    shortest longer one, whose first steps are the same batches where neither config's learning rate
    depends on the run's length."""
    same = base.get((r["domain"], r["seed"], r["steps"]))
    if same is not None:
        return same
    longer = [b for (d, s, n), b in base.items() if d == r["domain"] and s == r["seed"] and n > r["steps"]]
    if not longer or not _length_free(r):
        return None
    b = min(longer, key=lambda b: b["steps"])
    return b if _length_free(b) else None


def train_gaps(rows: list[dict], baseline: str) -> list[dict]:
    """Per (label, domain, steps): the training loss minus the baseline's at the same step of the same
    seed (the same batches; through the codec, as the run trains), over steps 1 .. end (at step 0
    both train the same weights: with ``reference: base`` the gap is exactly 0 there). A run shorter
    than the baseline's (a 20-step screen) is paired with the baseline's first steps (see
    :func:`_baseline_for`). ``mean``: over every seed's steps; ``se``: the per-step gaps' spread over the
    square root of their count (steps are treated as independent); ``per_seed``: each seed's mean."""
    import statistics
    base = {(r["domain"], r["seed"], r["steps"]): r for r in rows if r["label"] == baseline and r.get("train_losses")}
    groups: dict = {}
    for r in rows:
        if r["label"] != baseline and r.get("train_losses") and _baseline_for(r, base) is not None:
            groups.setdefault((r["label"], r["domain"], r["steps"]), []).append(r)
    out = []
    for (label, domain, steps), rs in sorted(groups.items()):
        per_seed, gaps = {}, []
        for r in sorted(rs, key=lambda r: r["seed"]):
            b = _baseline_for(r, base)["train_losses"][:len(r["train_losses"])]
            if len(b) != len(r["train_losses"]):
                continue
            g = [v - w for v, w in zip(r["train_losses"][1:], b[1:])]
            per_seed[r["seed"]] = statistics.fmean(g)
            gaps += g
        if len(gaps) > 1:
            out.append({"label": label, "domain": domain, "steps": steps, "seeds": sorted(per_seed),
                        "mean": statistics.fmean(gaps), "se": statistics.stdev(gaps) / len(gaps) ** 0.5,
                        "per_seed": per_seed})
    return out


# ------------------------------------------------------------------------------------------ report
def load_rows(path: str) -> list[dict]:
    latest = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                latest[(r["label"], r["domain"], r["seed"], r["steps"])] = r   # the newest run of each
    return list(latest.values())


def summarise(rows: list[dict], baseline: str) -> list[dict]:
    """Per (label, domain): mean over seeds, spread, the largest standard error, and the paired
    per-seed differences with the baseline on the same seeds."""
    import statistics
    base = {(r["domain"], r["seed"], r["steps"]): r for r in rows if r["label"] == baseline}
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["label"], r["domain"], r["steps"]), []).append(r)
    out = []
    for (label, domain, steps), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0] != baseline, kv[0][0])):
        rs = sorted(rs, key=lambda r: r["seed"])
        hl = [r["heldout_loss"] for r in rs]
        hc = [r["heldout_loss_coded"] for r in rs if r["heldout_loss_coded"] is not None]
        paired = {r["seed"]: r["heldout_loss"] - base[(domain, r["seed"], steps)]["heldout_loss"]
                  for r in rs if (domain, r["seed"], steps) in base}
        bmean = statistics.fmean(base[(domain, s, steps)]["heldout_loss"] for s in paired) if paired else None
        mean_diff = statistics.fmean(paired.values()) if paired else None
        diff_se = (statistics.stdev(paired.values()) / len(paired) ** 0.5) if len(paired) > 1 else None
        out.append({
            "label": label, "domain": domain, "steps": steps, "tokens": rs[0]["tokens"],
            "seeds": [r["seed"] for r in rs], "config": rs[0]["config"], "overrides": rs[0]["overrides"],
            "heldout_loss_mean": statistics.fmean(hl), "heldout_loss_spread": max(hl) - min(hl) if len(hl) > 1 else None,
            "heldout_stderr_max": max((r["heldout_stderr"] or 0.0) for r in rs),
            "heldout_loss_coded_mean": statistics.fmean(hc) if hc else None,
            "heldout_loss_base": rs[0]["heldout_loss_base"],
            "paired_diff": paired, "paired_diff_mean": mean_diff, "paired_diff_se": diff_se,
            "vs_baseline": (statistics.fmean(r["heldout_loss"] for r in rs if r["seed"] in paired) / bmean
                            if paired else None),
            "pp_bytes_per_token": rs[0]["pp_bytes_per_token"], "pp_bytes_ratio": rs[0]["pp_bytes_ratio"],
            "pp_bytes_ratio_bf16": rs[0]["pp_bytes_ratio_bf16"],
            "pp_bytes_ratio_bf16_busier": rs[0].get("pp_bytes_ratio_bf16_busier"),
            "pp_bytes_per_token_fwd": rs[0].get("pp_bytes_per_token_fwd"),
            "pp_bytes_per_token_bwd": rs[0].get("pp_bytes_per_token_bwd"),
            "dp_bytes": rs[0]["dp_bytes"], "anchor_bytes": rs[0]["anchor_bytes"],
            "dp": rs[0].get("dp", 1), "dp_ratio": rs[0].get("dp_ratio"), "dp_ratio_total": rs[0].get("dp_ratio_total"),
            "dp_ratio_bf16": rs[0].get("dp_ratio_bf16"), "dp_ratio_total_bf16": rs[0].get("dp_ratio_total_bf16"),
            "tokens_per_s": round(statistics.fmean(r["tokens_per_s"] for r in rs), 1),
        })
    return out


def _bf16_scale(backend: str | None) -> float | None:
    """How a DP backend's training-loop bytes in a bf16 run compare with this fp32 study's
    (``DPBackend.loop_bytes_dtype``): 0.5 where they are the gradients in their own dtype, 1 where
    they are formed in fp32 or are fixed-width codes, None for a mix (or an unknown backend)."""
    from ds_twocircuit.dp.registry import get_backend
    try:
        kind = get_backend(backend).loop_bytes_dtype
    except (KeyError, ValueError, TypeError):
        return None
    return {"grad": 0.5, "fp32": 1.0}.get(kind)


def _final_bf16_scale(world: int) -> float:
    """The end-of-run average's bytes for weights held in bf16 over those for fp32 weights, at
    ``world`` replicas (``ds_twocircuit.dp.base.final_average_bytes``: 0.5 at two)."""
    import torch
    from ds_twocircuit.dp.base import final_average_bytes
    n = 1 << 20
    fp32 = final_average_bytes(n, torch.float32, world)
    return final_average_bytes(n, torch.bfloat16, world) / fp32 if fp32 else 1.0


def add_dp_ratios(rows: list[dict], baseline: str) -> None:
    """Each row's ``dp_ratio`` (training loop) and ``dp_ratio_total`` (with the end-of-run sync): how
    many times fewer DP bytes per token it sent than the baseline (the all-reduce) on the same domain
    and DP width. None where there is no such baseline row or the baseline sent no DP bytes.

    The study trains in fp32 (the reference engine), so those divide by an fp32 all-reduce. A user
    who trains in bf16 all-reduces in bf16 (DeepSpeed's default communication dtype with
    ``bf16.enabled``): ``dp_ratio_bf16`` and ``dp_ratio_total_bf16`` are the same ratios for a bf16 run,
    each side's loop bytes scaled as its backend sends them (``_bf16_scale``), the end-of-run average
    as ``DPBackend.finalize`` sends bf16 weights (``_final_bf16_scale``). None where a backend's loop
    bytes are a mix of the two."""
    base = {}
    for r in rows:
        if r["label"] == baseline and r.get("dp_bytes_per_token"):
            base[(r["domain"], r.get("dp", 1))] = (r["dp_bytes_per_token"], _bf16_scale(r.get("dp_backend")))
    for r in rows:
        ref, ref_scale = base.get((r["domain"], r.get("dp", 1)), (None, None))
        loop, total = r.get("dp_bytes_per_token_training"), r.get("dp_bytes_per_token")
        r["dp_ratio"] = round(ref / loop, 2) if ref and loop else None
        r["dp_ratio_total"] = round(ref / total, 2) if ref and total else None
        scale = _bf16_scale(r.get("dp_backend"))
        if ref and loop and total and ref_scale and scale:
            loop_bf16 = loop * scale
            final_bf16 = (total - loop) * _final_bf16_scale(r.get("dp", 1))
            r["dp_ratio_bf16"] = round(ref * ref_scale / loop_bf16, 2)
            r["dp_ratio_total_bf16"] = round(ref * ref_scale / (loop_bf16 + final_bf16), 2)
        else:
            r["dp_ratio_bf16"] = r["dp_ratio_total_bf16"] = None


def _ratio_bf16(s: dict) -> float:
    """How many times fewer boundary bytes than bf16: the busier direction's where the row has it
    (rows from before it was recorded: both directions' mean)."""
    return s.get("pp_bytes_ratio_bf16_busier") or s["pp_bytes_ratio_bf16"] or 0


def recommend(summary: list[dict], baseline: str, min_ratio_bf16: float = 20.0, within: float = 0.01,
              min_dp_ratio: float = 0.0, min_seeds: int = 2):
    """The config with the lowest mean held-out loss among those at >= ``min_ratio_bf16`` fewer
    boundary bytes than bf16 (and, if ``min_dp_ratio``, at least that many times fewer DP bytes in
    the training loop than the baseline's all-reduce, both as a bf16 run sends them) on every domain measured with at least ``min_seeds`` seeds; None if
    none is within ``within`` of the baseline on every domain. A config must have rows on every domain the
    baseline has, and be a file as it ships: rows run with ``--set`` overrides are screens of a change to
    the file, not the file, and are never recommended."""
    by_label: dict = {}
    for s in summary:
        by_label.setdefault(s["label"], []).append(s)
    domains = {s["domain"] for s in by_label.get(baseline, [])}
    ok = []
    for label, ss in by_label.items():
        if label == baseline or not domains <= {s["domain"] for s in ss} or any(s.get("overrides") for s in ss):
            continue
        if any(_ratio_bf16(s) < min_ratio_bf16 or len(s["seeds"]) < min_seeds
               or (min_dp_ratio and (s.get("dp_ratio_bf16") or 0) < min_dp_ratio)
               or s["vs_baseline"] is None or s["vs_baseline"] > 1 + within for s in ss):
            continue
        ok.append((sum(s["heldout_loss_mean"] for s in ss) / len(ss), label, ss[0]["config"]))
    return min(ok)[2] if ok else None


TABLE_BEGIN, TABLE_END = "<!-- table: written by --report -->", "<!-- end of table -->"
README_BEGIN = "<!-- quality: written by launch/bench_quality.py --report --readme -->"
README_END = "<!-- end of quality -->"


def readme_lines(summary: list[dict], out: dict, baseline: str, note: str) -> list[str]:
    """The README's short table of a study: each config against the baseline on each domain."""
    lines = ["", f"| config | domain | seeds | held-out loss vs `{baseline}` (mean; per seed) "
             "| boundary bytes/token (forward / backward) | x fewer than bf16 (busier direction) |",
             "|---|---|---|---|---|---|"]
    for s in summary:
        if s["label"] == baseline:
            continue
        per_seed = ", ".join(f"{d:+.3f}" for _, d in sorted(s["paired_diff"].items()))
        vs = "-" if s["vs_baseline"] is None else f"**{(s['vs_baseline'] - 1) * 100:+.2f}%**; {per_seed}"
        lines.append(f"| `{s['config']}` | {s['domain']} | {','.join(map(str, s['seeds']))} | {vs} "
                     f"| {_bytes_cell(s)} | {_ratio_bf16(s):.1f} |")
    rec = out["recommended"]
    lines += ["", f"Recommended by this study: {f'`{rec}`' if rec else 'none yet'} (within "
              f"{out['recommended_if']['within']:.0%} of `{baseline}` at {out['recommended_if']['min_ratio_bf16']:g}x "
              f"fewer bytes than bf16, {out['recommended_if']['min_seeds']} seeds on every domain). From "
              f"[{os.path.basename(note)}]({note}).", ""]
    return lines


def report(args) -> dict:
    from benchnotes import write_section  # launch/, next to this script
    rows = load_rows(args.results)
    add_dp_ratios(rows, args.baseline)
    gaps = train_gaps(rows, args.baseline)
    all_rows, rows = rows, [r for r in rows if r.get("heldout_loss") is not None]   # screens: gaps only
    summary = summarise(rows, args.baseline)
    base = os.path.splitext(args.results)[0]
    out = {"benchmark": os.path.basename(base), "protocol": "launch/train.py --engine reference on each config: the Trainer, "
           "the config's codec at the pp-stage boundaries, its DP backend and anchor in-process; fp32; the "
           "same seeds, data order, token count and held-out windows for every config",
           "rows": all_rows, "summary": summary, "baseline": args.baseline,
           "recommended": recommend(summary, args.baseline, args.min_ratio_bf16, args.within, args.min_dp_ratio,
                                    args.min_seeds),
           "recommended_if": {"min_ratio_bf16": args.min_ratio_bf16, "min_dp_ratio": args.min_dp_ratio,
                              "within": args.within, "min_seeds": args.min_seeds},
           "train_loss_gaps": gaps,
           "commands": sorted({r["study_command"] for r in all_rows if r.get("study_command")})}
    with open(base + ".json", "w") as f:
        json.dump(out, f, indent=2)

    def f3(x):
        return "-" if x is None else f"{x:.3f}"
    with_dp = any(s["dp"] > 1 for s in summary)
    lines = ["", "| config | domain | seeds | tokens | held-out loss (mean) | spread | SE | paired diff vs "
             f"`{args.baseline}` (per seed) | vs `{args.baseline}` | through the codec | boundary bytes/token "
             "(forward / backward) | x fewer than fp32 | x fewer than bf16 (busier direction) |" + (" DP x fewer than fp32 all-reduce (loop / total) | DP x fewer than bf16 all-reduce (loop / total) |" if with_dp else ""),
             "|" + "---|" * (13 + 2 * with_dp)]
    for s in summary:
        per_seed = ", ".join(f"{d:+.3f}" for _, d in sorted(s["paired_diff"].items())) if s["paired_diff"] else "-"
        vs = "-" if s["vs_baseline"] is None else f"{(s['vs_baseline'] - 1) * 100:+.2f}%"
        lines.append(f"| `{s['label']}` | {s['domain']} | {','.join(map(str, s['seeds']))} | {s['tokens']:,} "
                     f"| {f3(s['heldout_loss_mean'])} | {f3(s['heldout_loss_spread'])} | {f3(s['heldout_stderr_max'] or None)} "
                     f"| {per_seed} | {vs} | {f3(s['heldout_loss_coded_mean'])} | {_bytes_cell(s)} "
                     f"| {2 * _ratio_bf16(s):.1f} | {_ratio_bf16(s):.1f} |"
                     + (f" {_dp_cell(s, '', args.baseline)} | {_dp_cell(s, '_bf16', args.baseline)} |"
                        if with_dp else ""))
    bases = sorted({(s["domain"], round(s["heldout_loss_base"], 3)) for s in summary if s["heldout_loss_base"]})
    lines += ["", "Base model (before training, dense inference): "
              + ", ".join(f"{d} {b:.3f}" for d, b in bases) + f". Recommended: `{out['recommended']}`.",
              "SE: the largest standard error of one held-out loss among the seeds; spread: the seed-to-seed "
              "range. A difference is a finding only where the paired differences agree in sign and exceed both.", ""]
    if gaps:
        lines += [f"Training loss minus `{args.baseline}`'s at the same step and seed (through the codec, as it "
                  "trains; steps 1 to the end, a shorter run against the baseline's first steps; SE: the per-step "
                  "gaps' spread over the square root of their count):",
                  "", "| config | domain | steps | seeds | gap (mean) | SE | per seed |", "|---|---|---|---|---|---|---|"]
        for g in gaps:
            lines.append(f"| `{g['label']}` | {g['domain']} | {g['steps']} | {','.join(map(str, g['seeds']))} "
                         f"| {g['mean']:+.4f} | {g['se']:.4f} | "
                         + ", ".join(f"{v:+.4f}" for _, v in sorted(g["per_seed"].items())) + " |")
        lines.append("")
    write_section(base + ".md", TABLE_BEGIN, TABLE_END, lines, args.title)
    if args.readme:
        text = open(args.readme).read()
        if README_BEGIN not in text or README_END not in text:
            raise SystemExit(f"--readme {args.readme}: the markers {README_BEGIN!r} and {README_END!r} are not "
                             "in it; put them where the table belongs")
        note = os.path.relpath(base + ".md", os.path.dirname(os.path.abspath(args.readme)))
        write_section(args.readme, README_BEGIN, README_END, readme_lines(summary, out, args.baseline, note), "")
    if rows:
        _plot(rows, base + ".png", args.baseline)
    print("\n".join(lines))
    return out


def _bytes_cell(s: dict) -> str:
    """Boundary bytes per token, each direction where the row has them (else both directions' mean)."""
    fwd, bwd = s.get("pp_bytes_per_token_fwd"), s.get("pp_bytes_per_token_bwd")
    return f"{fwd:,.1f} / {bwd:,.1f}" if fwd is not None and bwd is not None else f"{s['pp_bytes_per_token']:,.1f}"


def _dp_cell(s: dict, kind: str = "", baseline: str | None = None) -> str:
    """``kind`` "": against the study's fp32 all-reduce; "_bf16": against a bf16 run's."""
    loop, total = s.get("dp_ratio" + kind), s.get("dp_ratio_total" + kind)
    if s["dp"] <= 1:
        return "-"
    if loop == 1.0 and total == 1.0:
        return "1 (the baseline)" if s["label"] == baseline else "1 (all-reduce)"
    return f"{loop:.1f} / {total or 0:.1f}" if loop else "-"


def gap_curves(rows: list, baseline: str) -> dict:
    """{(label, domain, seed, "loss" | "loss_coded"): [(step, loss - baseline's loss)]}: each config's
    held-out curve minus the baseline's at the same domain, seed and step (dense inference of the
    baseline in both cases; step 0, where every config is the base model, left out)."""
    base = {(r["domain"], r["seed"], c["step"]): c["loss"] for r in rows if r["label"] == baseline
            for c in r["curve"]}
    out = {}
    for r in rows:
        if r["label"] == baseline:
            continue
        for key in ("loss", "loss_coded"):
            pts = [(c["step"], c[key] - base[(r["domain"], r["seed"], c["step"])]) for c in r["curve"]
                   if c["step"] > 0 and c.get(key) is not None and (r["domain"], r["seed"], c["step"]) in base]
            if pts:
                out[(r["label"], r["domain"], r["seed"], key)] = pts
    return out


def _plot(rows, path, baseline=None):
    """Top: held-out loss (dense inference) against step, one line per config and seed. Bottom, where
    the baseline config has rows: each config's gap to the baseline on the same seed and step, dense
    inference (solid) and through the codec (dotted): the picture a horizon question needs."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = sorted({r["label"] for r in rows})
    domains = sorted({r["domain"] for r in rows})
    gaps = gap_curves(rows, baseline) if baseline else {}
    nrows = 2 if gaps else 1
    fig, axes = plt.subplots(nrows, len(domains), figsize=(6 * len(domains), 4 * nrows), squeeze=False)
    for j, domain in enumerate(domains):
        ax = axes[0][j]
        for r in sorted((r for r in rows if r["domain"] == domain), key=lambda r: (r["label"], r["seed"])):
            i = labels.index(r["label"])
            pts = [(c["step"], c["loss"]) for c in r["curve"]]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, color=f"C{i % 10}",
                    ls=["-", "--", ":", "-."][r["seed"] % 4], label=f"{r['label']} (seed {r['seed']})")
        ax.set_title(f"held-out loss, dense inference ({domain})")
        ax.set_xlabel("step")
        ax.legend(fontsize=6)
        if not gaps:
            continue
        ax = axes[1][j]
        for (label, dom, seed, key), pts in sorted(gaps.items()):
            if dom != domain:
                continue
            coded = key == "loss_coded"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="x" if coded else "o", ms=3,
                    color=f"C{labels.index(label) % 10}", ls=":" if coded else "-",
                    label=f"{label} (seed {seed}, {'through the codec' if coded else 'dense inference'})")
        ax.axhline(0.0, color="k", lw=0.6)
        ax.set_title(f"gap to `{baseline}` on the same seed and windows ({domain})")
        ax.set_xlabel("step")
        ax.set_ylabel("held-out loss difference")
        ax.legend(fontsize=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    args = parse(argv)
    if args.report:
        report(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
