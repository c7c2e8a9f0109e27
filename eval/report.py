"""Results: the terminal table, the JSON file and the pruning-sweep plot.

In the JSON, ``relative_drop`` is oriented so that positive always means worse than the unpruned
model: ``(base - score) / base`` for higher-is-better metrics, ``(score - base) / base`` for
perplexity. The table shows each score's own relative change (``pass@1 0.09 (-25.0%)``,
``perplexity 7.9 (+4.1%)``) and a ``mean quality change`` row, ``-mean(relative_drop)`` over the
tasks (negative = worse, as the paper reports "-19% vs -25% at 30% sparsity").
"""
from __future__ import annotations

import json
import math
import os


def relative_drop(base: float | None, score: float | None, higher_is_better: bool) -> float | None:
    if base is None or score is None or not math.isfinite(base) or not math.isfinite(score) or base == 0:
        return None
    return (base - score) / abs(base) if higher_is_better else (score - base) / abs(base)


def sweep_summary(checkpoint: dict) -> dict:
    """{task: [{sparsity, achieved, score, relative_drop}]} plus the mean drop per sparsity."""
    runs = checkpoint["runs"]
    base = next((r for r in runs if r["sparsity"] == 0.0), None)
    out: dict = {}
    for r in runs:
        for task, res in r["tasks"].items():
            b = base["tasks"].get(task, {}).get("score") if base else None
            out.setdefault(task, []).append({
                "sparsity": r["sparsity"],
                "achieved_sparsity": (r.get("pruning") or {}).get("achieved"),
                "score": res.get("score"),
                "relative_drop": relative_drop(b, res.get("score"), res.get("higher_is_better", True))})
    mean = []
    for r in runs:
        drops = [e["relative_drop"] for entries in out.values() for e in entries
                 if e["sparsity"] == r["sparsity"] and e["relative_drop"] is not None]
        mean.append({"sparsity": r["sparsity"], "mean_relative_drop": sum(drops) / len(drops) if drops else None,
                     "tasks": len(drops)})
    return {"tasks": out, "mean_relative_drop": mean}


def _fmt(v: float | None, metric: str) -> str:
    if v is None:
        return "-"
    if metric in ("perplexity", "loss"):
        return f"{v:.3f}"
    return f"{v:.4f}"


def _fmt_change(d: float | None, higher_is_better: bool) -> str:
    """The score's own relative change, from the quality-oriented drop."""
    if d is None:
        return ""
    return f" ({(-d if higher_is_better else d) * 100:+.1f}%)"


def table(results: dict) -> str:
    cps = results["checkpoints"]
    sweep = len({r["sparsity"] for c in cps for r in c["runs"]}) > 1 or any(
        r["sparsity"] > 0 for c in cps for r in c["runs"])
    header = ["task", "metric"] + (["sparsity"] if sweep else []) + \
        [c["label"] if len(cps) > 1 else "score" for c in cps] + (["n", "time"] if not sweep and len(cps) == 1 else [])
    rows = []
    tasks = []
    for c in cps:
        for r in c["runs"]:
            for t in r["tasks"]:
                if t not in tasks:
                    tasks.append(t)
    sparsities = sorted({r["sparsity"] for c in cps for r in c["runs"]})
    summaries = [sweep_summary(c) for c in cps]
    for t in tasks:
        for s in sparsities:
            metric = None
            cells = []
            extra = []
            for c, summ in zip(cps, summaries):
                run = next((r for r in c["runs"] if r["sparsity"] == s), None)
                res = run["tasks"].get(t) if run else None
                if res is None:
                    cells.append("-")
                    continue
                metric = res["metric"]
                entry = next(e for e in summ["tasks"][t] if e["sparsity"] == s)
                change = _fmt_change(entry["relative_drop"], res.get("higher_is_better", True))
                cells.append(_fmt(res["score"], metric) + (change if s > 0 else ""))
                extra = [str(res.get("n", res.get("tokens", ""))), f"{res.get('seconds', 0):.0f}s"]
            rows.append([t, metric or "-"] + ([f"{s:.2f}"] if sweep else []) + cells +
                        (extra if not sweep and len(cps) == 1 else []))
    if sweep:
        for s in sparsities:
            if s == 0:
                continue
            cells = []
            for summ in summaries:
                m = next((e for e in summ["mean_relative_drop"] if e["sparsity"] == s), None)
                d = m["mean_relative_drop"] if m else None
                cells.append("-" if d is None else f"{-d * 100:+.1f}%")
            rows.append(["mean quality change", "", f"{s:.2f}"] + cells)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)] if rows else [len(h) for h in header]
    line = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip()  # noqa: E731
    out = [line(header), line(["-" * w for w in widths])] + [line(r) for r in rows]
    errors = [(c["label"], t, m) for c in cps for t, m in c.get("errors", {}).items()]
    if errors:
        out.append("")
        out += ["failed" + (f" [{lab}]" if len(cps) > 1 else "") + f": {m}" for lab, t, m in errors]
    if len(cps) > 1:
        out.append("")
        out += [f"{c['label']}: {c['checkpoint']['path']}" + (" (masked inference)" if c.get("masked") else "")
                for c in cps]
    return "\n".join(out)


def write_json(results: dict, path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = path + ".partial"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=2, default=_json_default)
        f.write("\n")
    os.replace(tmp, path)


def _json_default(o):
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


def plot_kind(results: dict) -> str:
    """``sweep`` when some checkpoint was scored at more than one sparsity, else ``comparison``."""
    return "sweep" if any(len({r["sparsity"] for r in c["runs"]}) > 1 for c in results["checkpoints"]) \
        else "comparison"


def plot(results: dict, path: str) -> str:
    """A pruning sweep: one panel per task, score vs sparsity, one line per checkpoint, plus the
    mean relative drop. Without a sweep: side-by-side bars of each task's score per checkpoint."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if plot_kind(results) == "comparison":
        return _plot_comparison(results, path, plt)

    cps = results["checkpoints"]
    summaries = [sweep_summary(c) for c in cps]
    tasks = []
    for s in summaries:
        tasks += [t for t in s["tasks"] if t not in tasks]
    panels = tasks + ["mean quality change"]
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for i, t in enumerate(panels):
        ax = axes.flat[i]
        for c, summ in zip(cps, summaries):
            if t == "mean quality change":
                pts = [(e["sparsity"], -100 * e["mean_relative_drop"]) for e in summ["mean_relative_drop"]
                       if e["mean_relative_drop"] is not None]
                ax.set_ylabel("% change vs unpruned (higher = better)")
            else:
                pts = [(e["sparsity"], e["score"]) for e in summ["tasks"].get(t, []) if e["score"] is not None]
                metric = next((r["tasks"][t]["metric"] for r in c["runs"] if t in r["tasks"]), "")
                ax.set_ylabel(metric)
            if pts:
                pts.sort()
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=c["label"])
        ax.set_title(t)
        ax.set_xlabel("sparsity (decoder matrices)")
        ax.grid(alpha=0.3)
        if len(cps) > 1:
            ax.legend(fontsize=8)
    scope = results["settings"].get("pruning_scope", "")
    fig.suptitle(f"Magnitude-pruning robustness ({scope})" + (" - masked inference" if results["settings"].get("masked") else ""))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_comparison(results: dict, path: str, plt) -> str:
    cps = results["checkpoints"]
    tasks = []
    for c in cps:
        for r in c["runs"]:
            tasks += [t for t in r["tasks"] if t not in tasks]
    cols = min(3, max(1, len(tasks)))
    rows = max(1, math.ceil(len(tasks) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax in axes.flat[len(tasks):]:
        ax.axis("off")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, t in zip(axes.flat, tasks):
        labels, scores, metric, higher = [], [], "", True
        for c in cps:
            res = next((r["tasks"][t] for r in c["runs"] if t in r["tasks"]), {})
            labels.append(c["label"])
            scores.append(res.get("score"))
            metric = res.get("metric", metric)
            higher = res.get("higher_is_better", higher)
        xs = range(len(labels))
        bars = ax.bar(xs, [v if v is not None else 0.0 for v in scores],
                      color=[colors[i % len(colors)] for i in xs])
        for b, v in zip(bars, scores):
            ax.annotate("n/a" if v is None else f"{v:.4g}", (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs), labels, fontsize=8)
        ax.set_ylabel(f"{metric} ({'higher' if higher else 'lower'} is better)")
        ax.set_title(t)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle("Comparison: " + " vs ".join(c["label"] for c in cps)
                 + (" - masked inference" if results["settings"].get("masked") else ""))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
