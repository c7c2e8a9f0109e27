"""Benchmark notes: a benchmark rewrites only its generated table inside its Markdown note.

The prose around the table is written by hand and kept; the numbers between the markers always
come from the benchmark's JSON (so they can be traced to a command)."""
from __future__ import annotations

import os


def write_section(md_path: str, begin: str, end: str, lines: list[str], title: str) -> None:
    """Replace the text between the ``begin`` and ``end`` markers of ``md_path`` with ``lines``
    (a new note titled ``title`` is created if the file does not exist; the section is appended if
    the markers are missing)."""
    section = "\n".join([begin, *lines, end])
    text = open(md_path).read() if os.path.exists(md_path) else f"# {title}\n\n{begin}\n{end}\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    with open(md_path, "w") as f:
        f.write(text)


def run_variants(script: str, args, variants: dict, run_variant) -> None:
    """Run each of ``args.variants`` (comma-separated names of ``variants``) with ``run_variant(name,
    args)`` and append its record, with the exact command, to ``args.results`` (one JSON line each,
    written as soon as the variant ends: nothing is lost if a later one fails)."""
    import json
    import shlex
    import sys
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    cmd = f"python {script} " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    names = args.variants.split(",")
    for name in names:
        if name not in variants:
            sys.exit(f"unknown variant {name!r}; known: {', '.join(variants)}")
    for name in names:
        rec = run_variant(name, args)
        rec["command"] = cmd.replace(f"--variants {args.variants}", f"--variants {name}") \
            if "--variants" in cmd else cmd + f" --variants {name}"
        os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
        with open(args.results, "a") as f:
            f.write(json.dumps(rec) + "\n")


def study_parser(doc: str, variants: str, steps: int, eval_sequences: int, eval_every: int, results: str):
    """The arguments every training-quality study shares (model, data shape, optimizer, seed,
    evaluation, results file); a study adds its own on the returned parser."""
    import argparse
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=variants)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data", default="sympy", help="training corpus (as launch/train.py --data; default the pinned sympy)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="sequences per step (8 x 128 tokens as the configs)")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--pp", type=int, default=2, help="boundaries as in a pp-stage pipeline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-sequences", type=int, default=eval_sequences)
    p.add_argument("--eval-every", type=int, default=eval_every)
    p.add_argument("--results", default=results)
    p.add_argument("--report", action="store_true", help="build the JSON/Markdown/PNG from the results")
    return p


def heldout_loss(model, masker, seqs, n: int, mb: int, coded: bool) -> float:
    """Mean held-out loss of the first ``n`` sequences, with the boundary codec in the graph
    (``coded``) or not; evaluation keys live in the engine's evaluation step space."""
    return heldout_loss_se(model, masker, seqs, n, mb, coded)[0]


def heldout_loss_se(model, masker, seqs, n: int, mb: int, coded: bool) -> tuple[float, float | None]:
    """:func:`heldout_loss` and its standard error (that of the mean of the batch losses)."""
    import statistics
    import torch
    from ds_twocircuit.masks import EVAL_STEP_OFFSET
    from ds_twocircuit.models.layers import causal_lm_loss
    masker.enabled = coded
    n = min(n, len(seqs))  # never past the held-out set (a second pass would repeat windows)
    losses = []
    with torch.no_grad():
        for i in range(0, n, mb):
            x = seqs.batch(i, min(mb, n - i))
            masker.set_message(EVAL_STEP_OFFSET, i // mb)
            losses.append(float(causal_lm_loss(model(input_ids=x).logits, x)))
    masker.enabled = True
    se = statistics.stdev(losses) / len(losses) ** 0.5 if len(losses) > 1 else None
    return sum(losses) / len(losses), se
