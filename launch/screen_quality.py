#!/usr/bin/env python
"""Screen boundary codecs on the base model in minutes, before any long run.

For each codec: held-out loss of the untrained model through the codec (state fitted on the
sender's training activations, as in a run), and the cosine between the gradient through the codec
and the dense gradient of the same batch, averaged over the 2-D decoder matrices below and above
the boundary (the masked-gradient premise of the anchor corrections). Same model, boundary,
calibration batches, held-out sequences and gradient batch for every codec.

    python launch/screen_quality.py                                   # the default list
    python launch/screen_quality.py --codecs 'lowrank:16x8+184x4,random:0.95,meanfill:0.95'
    python launch/screen_quality.py --out docs/benchmarks/screen.json

Codec specs: ``dense``, ``random:P``, ``meanfill:P``, ``lowrank:NxB+NxB...`` (N coefficients at B
bits, leading principal directions first), optionally ``/sqrt_std`` (``codec.coef_norm``), e.g.
``lowrank:224x4/sqrt_std``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT = "dense,random:0.95,meanfill:0.95,lowrank:112x8,lowrank:16x8+184x4,lowrank:8x8+88x4"


def parse_spec(spec: str) -> dict:
    """``lowrank:16x8+184x4`` -> mode, mask rate and codec section; errors say what is allowed."""
    from ds_twocircuit.config import CodecConfig
    mode, _, arg = spec.partition(":")
    if mode == "dense":
        return {"mode": "dense", "p": 0.0, "codec": None}
    if mode in ("random", "meanfill"):
        try:
            p = float(arg)
        except ValueError:
            raise SystemExit(f"--codecs {spec!r}: expected {mode}:P with P a mask rate in [0, 1)") from None
        return {"mode": mode, "p": p, "codec": CodecConfig(refresh_steps=[0])}
    if mode == "lowrank":
        layout, _, norm = arg.partition("/")
        try:
            groups = [[int(v) for v in g.split("x")] for g in layout.split("+")]
        except ValueError:
            raise SystemExit(f"--codecs {spec!r}: expected lowrank:NxB+NxB[/COEF_NORM] (N coefficients at "
                             "B bits)") from None
        cfg = CodecConfig(groups=groups, refresh_steps=[0], coef_norm=norm or "none")
        cfg.validate("--codecs " + spec)
        return {"mode": "lowrank", "p": 0.0, "codec": cfg}
    raise SystemExit(f"--codecs {spec!r}: unknown codec; allowed: dense, random:P, meanfill:P, "
                     "lowrank:NxB+...[/COEF_NORM]")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--codecs", default=DEFAULT)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--calibration-sequences", type=int, default=32, help="sender statistics (training data)")
    ap.add_argument("--eval-sequences", type=int, default=24)
    ap.add_argument("--grad-sequences", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    specs = [(s, parse_spec(s)) for s in args.codecs.split(",")]
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))

    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from ds_twocircuit.data import PackedSequences, load_documents, split_documents
    from ds_twocircuit.masks import EVAL_STEP_OFFSET
    from ds_twocircuit.models.layers import causal_lm_loss, hf_decoder_matrices
    from ds_twocircuit.models.presets import resolve_model
    from ds_twocircuit.reference import BoundaryMasker, untie_head

    folder = resolve_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    untie_head(model)
    tok = AutoTokenizer.from_pretrained(folder)
    train, held = split_documents(load_documents("stdlib"))
    seqs = PackedSequences(train, tok, args.seq_len, seed=args.seed)
    hseqs = PackedSequences(held, tok, args.seq_len, shuffle=False)
    mats = hf_decoder_matrices(model)
    mb = 8

    def grads(masker):
        model.zero_grad(set_to_none=True)
        x = seqs.batch(10_000, args.grad_sequences)  # a batch apart from the calibration ones
        if masker is not None:
            masker.set_message(1, 0)
        causal_lm_loss(model(input_ids=x).logits, x).backward()
        return {n: p.grad.detach().clone() for n, p in mats.items()}

    dense_g = grads(None)
    rows = []
    for spec, v in tqdm(specs, desc="codecs", unit="codec"):
        t0 = time.time()
        masker = BoundaryMasker(model, args.pp, mode=v["mode"], mask_rate=v["p"], seed=args.seed,
                                codec_cfg=v["codec"], gas=10 ** 9)
        layer = masker.parts[1] - 1  # the first stage's last HF decoder index, for the split below
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
        cos = {"below": [], "above": []}
        for n in mats:
            idx = int(n.split("layers.")[1].split(".")[0])
            c = float(torch.nn.functional.cosine_similarity(g[n].flatten(), dense_g[n].flatten(), dim=0))
            cos["below" if idx < layer else "above"].append(c)
        masker.remove()
        rows.append({"codec": spec, "heldout_loss": round(sum(losses) / len(losses), 4),
                     "cos_below": round(sum(cos["below"]) / max(1, len(cos["below"])), 4),
                     "cos_above": round(sum(cos["above"]) / max(1, len(cos["above"])), 4),
                     "seconds": round(time.time() - t0, 1)})
        tqdm.write(json.dumps(rows[-1]))
    print("\n| codec | held-out loss (base model, through the codec) | cos(G, G_dense) below / above |")
    print("|---|---|---|")
    for r in rows:
        print(f"| `{r['codec']}` | {r['heldout_loss']:.3f} | {r['cos_below']:+.3f} / {r['cos_above']:+.3f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "screen_quality", "command": "python launch/screen_quality.py "
                       + " ".join(sys.argv[1:]), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
