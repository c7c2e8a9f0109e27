#!/usr/bin/env python
"""Screen boundary codecs on the base model in minutes, before any long run.

For each config file (the codec of its ``twocircuit`` section, ``--set`` overrides applied): held-out
loss of the untrained model through the codec (state fitted on the sender's training activations,
as in a run), and the cosine between the gradient through the codec and the dense gradient of the
same batch, averaged over the 2-D decoder matrices below and above the boundary (the masked-gradient
premise of the anchor corrections). Same model, boundary, calibration batches, held-out sequences and
gradient batch for every config. The codec objects are the ones the engines build from the config
(``codecs.make_codec``); no optimizer is built: nothing trains here.

    python launch/screen_quality.py --configs dense,m95,meanfill95,lowrank
    python launch/screen_quality.py --configs lowrank --set twocircuit.codec.groups='[[112,4]]'
    python launch/screen_quality.py --configs lowrank --paired 1,4 --out docs/benchmarks/screen.json

``--paired N,M``: also screens the premise of delayed error feedback (``anchor.correction =
delayed_ef``) on each codec: the error ``c = G_dense - G_codec`` measured on N (then M) batches
other than the target ones, averaged (the correction's EMA keeps their systematic part), is added
to the target batches' codec gradient, ``cos(G_codec + lambda * c, G_dense)`` for each
``--paired-lambdas`` value (lambda 0 = the codec alone), every gradient first clipped to
``--paired-clip`` global norm over the decoder matrices (the pair on the same footing, as
``run_anchor`` clips the anchor's). A correction that helps raises the cosine above lambda 0.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULT = "dense,m95,meanfill95,lowrank"


def load_twocircuit(config: str, overrides: list[str]):
    """(label, TwoCircuitConfig) of a config file (or shipped name) with ``overrides`` applied."""
    from ds_twocircuit.config import TwoCircuitConfig, apply_overrides, load_ds_config, resolve_config
    path = resolve_config(config if config.endswith(".json") or "/" in config else f"{config}.json")
    from ds_twocircuit.adapters.dsconfig import deepspeed_knows
    ds = apply_overrides(load_ds_config(path), overrides, known=deepspeed_knows)
    label = os.path.splitext(os.path.basename(path))[0] + "".join(f" {o}" for o in overrides)
    return label, path, TwoCircuitConfig.from_dict(ds.get("twocircuit"))


def clip_global(g: dict, max_norm: float) -> dict:
    """``g`` scaled to global 2-norm ``max_norm`` if above it (``torch.nn.utils.clip_grad_norm_``'s rule)."""
    import torch
    if not max_norm > 0:
        return g
    norm = float(torch.nn.utils.get_total_norm(list(g.values())))
    f = max_norm / (norm + 1e-6)
    return {n: t * f for n, t in g.items()} if f < 1.0 else g


def paired_cosines(pairs, targets, lambdas, clip: float = 0.0) -> dict:
    """Delayed error feedback's premise: per lambda and matrix, the mean over ``targets`` of
    ``cos(G + lambda * mean_k(D_k - G_k), D)``.

    ``pairs``: (G_codec, G_dense) gradient dicts of the batches the error is measured on;
    ``targets``: (G_codec, G_dense) of other batches, the ones the error is replayed on. Every
    gradient is clipped to ``clip`` global norm first (0: unclipped).
    """
    import torch
    pairs = [(clip_global(g, clip), clip_global(d, clip)) for g, d in pairs]
    targets = [(clip_global(g, clip), clip_global(d, clip)) for g, d in targets]
    names = list(targets[0][0])
    corr = {n: sum(d[n] - g[n] for g, d in pairs) / len(pairs) for n in names}
    out = {}
    for lam in lambdas:
        out[lam] = {n: sum(float(torch.nn.functional.cosine_similarity(
            (g[n] + lam * corr[n]).flatten(), d[n].flatten(), dim=0)) for g, d in targets) / len(targets)
            for n in names}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=DEFAULT, help="comma-separated config files or shipped config names")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a key of every config (dotted path, JSON value), as launch/train.py --set")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default="sympy", help="training corpus (as launch/train.py --data)")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--calibration-sequences", type=int, default=32, help="sender statistics (training data)")
    ap.add_argument("--eval-sequences", type=int, default=24)
    ap.add_argument("--grad-sequences", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--paired", default="", help="screen delayed_ef: error averaged over N,M... pair batches")
    ap.add_argument("--paired-lambdas", default="0.25,0.5,1")
    ap.add_argument("--paired-clip", type=float, default=1.0, help="global norm clip of every gradient (0: none)")
    ap.add_argument("--paired-targets", type=int, default=3, help="target batches the error is replayed on")
    args = ap.parse_args()
    try:
        paired = [int(v) for v in args.paired.split(",") if v.strip()]
        lambdas = [0.0] + [float(v) for v in args.paired_lambdas.split(",") if v.strip()]
    except ValueError:
        raise SystemExit("--paired expects batch counts (e.g. 1,4) and --paired-lambdas numbers "
                         "(e.g. 0.25,0.5,1)") from None
    if any(n < 1 for n in paired) or args.paired_targets < 1:
        raise SystemExit("--paired counts and --paired-targets must be >= 1")
    from ds_twocircuit.config import ConfigError
    try:
        specs = [load_twocircuit(c, args.overrides) for c in args.configs.split(",")]
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))

    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from ds_twocircuit.data import PackedSequences, heldout_sequences, load_documents, split_documents
    from ds_twocircuit.masks import EVAL_STEP_OFFSET
    from ds_twocircuit.models.layers import causal_lm_loss, hf_decoder_matrices
    from ds_twocircuit.models.presets import resolve_model
    from ds_twocircuit.codecs import make_codec
    from ds_twocircuit.reference import BoundaryMasker, untie_head

    folder = resolve_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    untie_head(model)
    tok = AutoTokenizer.from_pretrained(folder)
    train, held = split_documents(load_documents(args.data))
    seqs = PackedSequences(train, tok, args.seq_len, seed=args.seed)
    hseqs = heldout_sequences(held, tok, args.seq_len)
    mats = hf_decoder_matrices(model)
    mb = 8

    def grads(masker, at=10_000, message=0):
        model.zero_grad(set_to_none=True)
        x = seqs.batch(at, args.grad_sequences)  # a batch apart from the calibration ones
        if masker is not None:
            masker.set_message(1, message)
        causal_lm_loss(model(input_ids=x).logits, x).backward()
        return {n: p.grad.detach().clone() for n, p in mats.items()}

    dense_g = grads(None)
    # delayed_ef screening: target batches, then pair batches, all apart from the above
    tgt_at = [20_000 + 1_000 * i for i in range(args.paired_targets)] if paired else []
    pair_at = [40_000 + 1_000 * i for i in range(max(paired, default=0))]
    dense_extra = {at: grads(None, at) for at in tqdm(tgt_at + pair_at, desc="dense gradients (paired)",
                                                       unit="batch", disable=not paired)}
    rows = []
    for spec, path, tc in tqdm(specs, desc="codecs", unit="codec"):
        t0 = time.time()
        masker = BoundaryMasker(model, args.pp, lambda tc=tc: make_codec(tc), seed=args.seed,
                                partition=tc.partition, gas=10 ** 9)
        masker.count = False   # a probe, not traffic
        layer = masker.parts[1] - 1  # the HF index of stage 1's first decoder: below it is stage 0
        with torch.no_grad():  # sender statistics from training activations; the last batch is
            n = len(range(0, args.calibration_sequences, mb))  # message 0 of step 0: a refresh
            for j, i in enumerate(range(0, args.calibration_sequences, mb)):
                masker.set_message(0, n - 1 - j)
                model(input_ids=seqs.batch(i, mb))
        losses = []
        with torch.no_grad():
            for i in range(0, args.eval_sequences, mb):
                masker.set_message(EVAL_STEP_OFFSET, i // mb)
                x = hseqs.batch(i, mb)
                losses.append(float(causal_lm_loss(model(input_ids=x).logits, x)))
        g = grads(masker)
        def below_above(per):  # mean cosine over the matrices below / above the boundary
            side = {"below": [], "above": []}
            for n, c in per.items():
                side["below" if int(n.split("layers.")[1].split(".")[0]) < layer else "above"].append(c)
            return {f"cos_{k}": round(sum(v) / max(1, len(v)), 4) for k, v in side.items()}
        cos = below_above({n: float(torch.nn.functional.cosine_similarity(g[n].flatten(), dense_g[n].flatten(), dim=0))
                           for n in mats})
        row_paired = []
        if paired and not masker.pair(0)[0].identity:
            coded = {at: grads(masker, at, k + 1) for k, at in enumerate(tgt_at + pair_at)}
            targets = [(coded[at], dense_extra[at]) for at in tgt_at]
            for n_pairs in paired:
                pcs = paired_cosines([(coded[at], dense_extra[at]) for at in pair_at[:n_pairs]], targets,
                                     lambdas, clip=args.paired_clip)
                row_paired += [{"pairs": n_pairs, "lambda": lam, **below_above(per)} for lam, per in pcs.items()]
        masker.remove()
        rows.append({"codec": spec, "config": os.path.relpath(path, ROOT) if path.startswith(ROOT) else path,
                     "overrides": args.overrides, "heldout_loss": round(sum(losses) / len(losses), 4), **cos,
                     "seconds": round(time.time() - t0, 1)})
        if row_paired:
            rows[-1]["paired"] = row_paired
        tqdm.write(json.dumps(rows[-1]))
    print("\n| codec | held-out loss (base model, through the codec) | cos(G, G_dense) below / above |")
    print("|---|---|---|")
    for r in rows:
        print(f"| `{r['codec']}` | {r['heldout_loss']:.3f} | {r['cos_below']:+.3f} / {r['cos_above']:+.3f} |")
    if any("paired" in r for r in rows):
        print(f"\ndelayed_ef premise: cos(G + lambda * c, G_dense) below / above, on {args.paired_targets} "
              f"target batches, c averaged over N pair batches, clip {args.paired_clip}")
        print("| codec | pair batches | " + " | ".join(f"lambda {lam:g}" for lam in lambdas) + " |")
        print("|---|---|" + "---|" * len(lambdas))
        for r in rows:
            for n_pairs in paired:
                cells = [p for p in r.get("paired", []) if p["pairs"] == n_pairs]
                if cells:
                    print(f"| `{r['codec']}` | {n_pairs} | " + " | ".join(
                        f"{p['cos_below']:+.3f} / {p['cos_above']:+.3f}" for p in cells) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "screen_quality", "command": "python launch/screen_quality.py "
                       + " ".join(sys.argv[1:]), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
