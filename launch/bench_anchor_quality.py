#!/usr/bin/env python
"""Anchor-quality benchmark: dense vs M95 vs M95+AP (and M90, M90+AP) on the default model.

Every variant trains SmolLM2-135M-Instruct on the same data, seed and step count, then scores the
held-out code loss with dense inference (how the eval CLI scores a checkpoint) and with masked
inference (how the mesh serves it). The runs use the single-process equivalent of the pipeline:
the HF model with the engine's PRF masks in its graph at the same boundary
(``ds_twocircuit.reference.BoundaryMasker``; ``tests/test_pipeline_equivalence.py`` shows it equals
the multi-process engine) and an in-process anchor with exact staleness K: at every step s with
s % K == 0 the dense (unmasked) gradient of the current weights on batch s is computed, and it is
handed to ``SpectralCorrection`` at step s + K, as ``anchor.consume = "scheduled"`` does. This costs
one extra forward/backward every K steps instead of two more processes on a 2-core machine.

Diagnostics per AP run (means over the 2-D decoder matrices): the cosine between the masked and
the dense gradient of the same batch at snapshot steps (the method assumes masked = dense + noise),
the share of the masked gradient's energy in the top-16 anchor directions, the filter's effect
``||G_use - G_mask|| / ||G_mask||`` and the number of directions with d > 0.5.

    python launch/bench_anchor_quality.py --variants dense,m95,m95_ap --steps 100
    python launch/bench_anchor_quality.py --report        # writes docs/benchmarks/anchor_quality.{json,md,png}
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "docs", "benchmarks", "anchor_quality.jsonl")

# name -> settings; "ap" holds the SpectralCorrection / anchor knobs
VARIANTS = {
    "dense": dict(mode="dense", p=0.0),
    "m95": dict(mode="random", p=0.95),
    "m90": dict(mode="random", p=0.90),
    # the paper's defaults with the EMA formula taken literally (M starts at zero) ...
    "m95_ap_paper": dict(mode="random", p=0.95, ap=dict(every=20, alpha=0.3, tau=1e-3, tau_mode="absolute",
                                                       ema_init="zero")),
    # ... and with a bias-corrected EMA (the first arrival is not shrunk by 1 - beta)
    "m95_ap": dict(mode="random", p=0.95, ap=dict(every=20, alpha=0.3, tau=1e-3, tau_mode="absolute")),
    "m90_ap": dict(mode="random", p=0.90, ap=dict(every=20, alpha=0.3, tau=1e-3, tau_mode="absolute")),
    "m95_ap_rel": dict(mode="random", p=0.95, ap=dict(every=20, alpha=0.3, tau=0.05, tau_mode="relative")),
    "m95_ap_rel_a0": dict(mode="random", p=0.95, ap=dict(every=20, alpha=0.0, tau=0.05, tau_mode="relative")),
    "m95_ap_rel_a0_k5": dict(mode="random", p=0.95, ap=dict(every=5, alpha=0.0, tau=0.05, tau_mode="relative")),
    # extension: the anchor prior itself mixed into the update (scaled to the masked gradient's norm)
    "m95_ap_mix": dict(mode="random", p=0.95, ap=dict(every=20, alpha=0.3, tau=0.05, tau_mode="relative", mix=0.5)),
    "m95_ap_mix_k5": dict(mode="random", p=0.95, ap=dict(every=5, alpha=0.3, tau=0.05, tau_mode="relative", mix=0.5)),
    "m90_ap_rel_a0_k5": dict(mode="random", p=0.90, ap=dict(every=5, alpha=0.0, tau=0.05, tau_mode="relative")),
    # the mask rate ramped linearly from 0 to 0.95 over the first 40 steps (MaskSchedule.ramp_steps),
    # alone and with the anchors (their early gradients then come from a nearly dense regime)
    "m95_ramp40": dict(mode="random", p=0.95, ramp=40),
    "m95_ramp40_ap": dict(mode="random", p=0.95, ramp=40,
                          ap=dict(every=20, alpha=0.3, tau=1e-3, tau_mode="absolute")),
}


def parse():
    from benchnotes import study_parser  # launch/, next to this script
    p = study_parser(__doc__, "dense,m95,m95_ap,m95_ap_rel,m95_ap_rel_a0,m95_ap_rel_a0_k5,m90,m90_ap_rel_a0_k5",
                     steps=100, eval_sequences=64, eval_every=25, results=RESULTS)
    p.add_argument("--every", type=int, default=None, help="override K of the AP variants")
    return p.parse_args()


def run_variant(name, args):
    from benchnotes import heldout_loss  # launch/, next to this script
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from ds_twocircuit.anchor.spectral import SpectralCorrection
    from ds_twocircuit.data import PackedSequences, heldout_sequences, load_documents, split_documents
    from ds_twocircuit.models.layers import causal_lm_loss, hf_decoder_matrices
    from ds_twocircuit.models.presets import resolve_model
    from ds_twocircuit.reference import BoundaryMasker, untie_head

    v = json.loads(json.dumps(VARIANTS[name]))
    if args.every and v.get("ap"):
        v["ap"]["every"] = args.every
    torch.manual_seed(args.seed)
    folder = resolve_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    untie_head(model)
    masker = BoundaryMasker(model, args.pp, mode=v["mode"], mask_rate=v["p"], seed=args.seed,
                            warmup_steps=v.get("warmup", 0), ramp_steps=v.get("ramp", 0))
    tok = AutoTokenizer.from_pretrained(folder)
    train, held = split_documents(load_documents(args.data))
    seqs = PackedSequences(train, tok, args.seq_len, seed=args.seed)
    hseqs = heldout_sequences(held, tok, args.seq_len)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    ap = v.get("ap")
    targets = hf_decoder_matrices(model)
    if ap:
        opt = SpectralCorrection(opt, targets, alpha=ap["alpha"], tau=ap["tau"], beta=0.95,
                                 tau_mode=ap["tau_mode"], ema_init=ap.get("ema_init", "bias_corrected"),
                                 anchor_mix=ap.get("mix", 0.0), seed=args.seed)
    gas = args.batch // args.micro_batch
    pending = {}  # source step -> dense gradients (delivered at source + K)
    log = {"variant": name, "settings": v, "steps": args.steps, "seed": args.seed,
           "tokens": args.steps * args.batch * args.seq_len, "train_loss": [], "heldout": [], "diag": []}

    def evaluate(step):
        rec = {"step": step, "dense": heldout_loss(model, masker, hseqs, args.eval_sequences, args.micro_batch, False)}
        if v["mode"] != "dense":
            rec["masked"] = heldout_loss(model, masker, hseqs, args.eval_sequences, args.micro_batch, True)
        log["heldout"].append(rec)
        print(f"[{name}] step {step}: held-out {rec}", flush=True)

    t0 = time.time()
    evaluate(0)
    for s in range(args.steps):
        opt.zero_grad(set_to_none=True)
        batch = seqs.batch(s * args.batch, args.batch)
        # anchor: dense gradient of the current weights on this step's batch, every K steps
        if ap and s % ap["every"] == 0:
            masker.enabled = False
            for m in range(gas):
                x = batch[m * args.micro_batch:(m + 1) * args.micro_batch]
                (causal_lm_loss(model(input_ids=x).logits, x) / gas).backward()
            masker.enabled = True
            pending[s] = {n: p.grad.detach().clone() for n, p in targets.items()}
            opt.zero_grad(set_to_none=True)
        total = 0.0
        for m in range(gas):
            x = batch[m * args.micro_batch:(m + 1) * args.micro_batch]
            masker.set_message(s, m)
            loss = causal_lm_loss(model(input_ids=x).logits, x)
            (loss / gas).backward()
            total += float(loss.detach()) / gas
        diag = {"step": s}
        if ap and s in pending:  # masked vs dense gradient of the same batch and weights
            cos = [float(torch.nn.functional.cosine_similarity(targets[n].grad.flatten(), g.flatten(), dim=0))
                   for n, g in pending[s].items()]
            diag["cos_mask_dense"] = sum(cos) / len(cos)
        if ap and (s - ap["every"]) in pending:
            src = s - ap["every"]
            opt.submit_anchor_gradients(pending.pop(src), src)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step(step=s) if ap else opt.step()
        if ap:
            st = opt.last_stats()
            diag.update({k.replace("spectral/", ""): st.get(k) for k in
                         ("spectral/alignment_topk", "spectral/filter_effect", "spectral/directions_passed")})
            log["diag"].append(diag)
        log["train_loss"].append(total)
        if (s + 1) % args.eval_every == 0 or s + 1 == args.steps:
            evaluate(s + 1)
        print(f"[{name}] step {s}: loss {total:.4f} ({time.time() - t0:.0f} s)", flush=True)
    log["wall_s"] = round(time.time() - t0, 1)
    log["heldout_loss"] = log["heldout"][-1]["dense"]
    log["heldout_loss_masked"] = log["heldout"][-1].get("masked")
    return log


def report(args):
    rows = {}
    with open(args.results) as f:
        for line in f:
            r = json.loads(line)
            rows[r["variant"]] = r  # the newest run of each variant
    out = {"benchmark": "anchor_quality", "model": args.model, "command": None, "variants": []}
    for name, r in rows.items():
        d = r.get("diag") or []
        cos = [x["cos_mask_dense"] for x in d if "cos_mask_dense" in x]
        eff = [x["filter_effect"] for x in d if x.get("filter_effect")]
        out["variants"].append({
            "variant": name, "heldout_loss": round(r["heldout_loss"], 4),
            "heldout_loss_masked": None if r["heldout_loss_masked"] is None else round(r["heldout_loss_masked"], 4),
            "heldout_loss_start": round(r["heldout"][0]["dense"], 4),
            "heldout_loss_masked_start": r["heldout"][0].get("masked"),
            "tokens": r["tokens"], "seed": r["seed"], "steps": r["steps"], "settings": r["settings"],
            "train_loss_last10": round(sum(r["train_loss"][-10:]) / min(10, len(r["train_loss"])), 4),
            "curve": r["heldout"],
            "cos_mask_dense": [round(c, 4) for c in cos],
            "mean_filter_effect": round(sum(eff) / len(eff), 4) if eff else None,
            "command": r["command"], "wall_s": r["wall_s"],
        })
        out["command"] = r["command"].split(" --variants")[0]
    with open(args.results.replace(".jsonl", ".json"), "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps([{k: v[k] for k in ("variant", "heldout_loss", "heldout_loss_masked", "tokens")}
                      for v in out["variants"]], indent=1))
    _write_table(out, args.results.replace(".jsonl", ".md"))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for i, v in enumerate(out["variants"]):  # one colour per variant on both panels
            steps, style = [c["step"] for c in v["curve"]], dict(marker="o", color=f"C{i % 10}", label=v["variant"])
            axes[0].plot(steps, [c["dense"] for c in v["curve"]], **style)
            if v["heldout_loss_masked"] is not None:
                axes[1].plot(steps, [c["masked"] for c in v["curve"]], **style)
        axes[0].set_title("held-out loss, dense inference")
        axes[1].set_title("held-out loss, masked inference")
        for ax in axes:
            ax.set_xlabel("step (8 x 128 tokens)")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.results.replace(".jsonl", ".png"), dpi=110)
    except ImportError:
        pass


TABLE_BEGIN, TABLE_END = "<!-- table: written by --report -->", "<!-- end of table -->"


def _write_table(out, md_path):
    """Replace the table between the markers of the Markdown note (the prose around it is kept)."""
    from benchnotes import write_section  # launch/, next to this script
    def fmt(x):
        return "-" if x is None else f"{x:.3f}"
    lines = ["",
             "| variant | held-out loss, dense inference | held-out loss, masked inference (step 0) | train loss (last 10) "
             "| cos(masked, dense grad) | filter effect | tokens | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for v in out["variants"]:
        cos = v["cos_mask_dense"]
        lines.append(f"| `{v['variant']}` | {fmt(v['heldout_loss'])} | {fmt(v['heldout_loss_masked'])}"
                     + (f" ({fmt(v['heldout_loss_masked_start'])})" if v["heldout_loss_masked_start"] else "") +
                     f" | {fmt(v['train_loss_last10'])} | {fmt(sum(cos) / len(cos)) if cos else '-'} "
                     f"| {fmt(v['mean_filter_effect'])} | {v['tokens']:,} | {v['wall_s']:.0f} |")
    lines += ["", f"Start (step 0, every variant): dense inference {fmt(out['variants'][0]['heldout_loss_start'])}."
              if out["variants"] else "", ""]
    write_section(md_path, TABLE_BEGIN, TABLE_END, lines, "Anchor quality")


def main():
    args = parse()
    if args.report:
        report(args)
        return
    from benchnotes import run_variants  # launch/, next to this script
    run_variants("launch/bench_anchor_quality.py", args, VARIANTS, run_variant)


if __name__ == "__main__":
    main()
