#!/usr/bin/env python
"""GPU checks of the fast circuit's mask PRF and codec (run where a CUDA device exists).

1. The PRF gives bit-identical kept channels on CUDA and on CPU (several keys and shapes,
   including Llama-1B's hidden size).
2. The codec round trip on CUDA equals the CPU one (random mask, Top-K, bf16 wire).
3. Mask generation + pack + unpack at Llama-3.2-1B size (H = 2048, sequence 2048, one sequence per
   micro-batch, both directions, both ends) against the forward + backward of an 8-layer stage of
   Llama-1B-shaped decoder layers in bf16, as a share.
4. The low-rank codec on CUDA: the same wire bytes as on the CPU, and the same reconstruction up to
   float rounding (the basis is an eigendecomposition: computed on each device from the same data).
5. One-process training runs (``--pp 1``) of the model through DeepSpeed's own launcher, on NCCL
   (every collective of the summary on the GPU), in fp32 and in bf16 (``--set bf16.enabled=true``,
   DeepSpeed's BF16 optimizer), the same seed, data and held-out tokens.
6. The eval CLI on CUDA on the bf16 run's model (held-out code perplexity).

    python launch/gpu_check.py --out docs/benchmarks/gpu_check.json
    python launch/gpu_check.py --sections train,eval --model tiny --out ... --update   # one part only
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    import torch
    from ds_twocircuit import masks
    from ds_twocircuit.codecs import Message, build_codec
    from ds_twocircuit.codecs.mask import RandomMaskCodec

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--model", default="smollm2-135m", help="model of the training runs (train.py --model)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps of each training run")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated subset of: {', '.join(SECTIONS)}")
    p.add_argument("--update", action="store_true", help="merge into --out's existing JSON instead of replacing it")
    args = p.parse_args()
    sections = [x for x in args.sections.split(",") if x]
    bad = sorted(set(sections) - set(SECTIONS))
    if bad:
        sys.exit(f"--sections: unknown {', '.join(bad)}; allowed: {', '.join(SECTIONS)}")
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: this script checks the GPU path")
    dev = torch.device("cuda")
    res = {}
    if args.update and args.out and os.path.isfile(args.out):
        res = json.load(open(args.out))
    res.update({"device": torch.cuda.get_device_name(0), "torch": torch.__version__})
    commands = res.setdefault("commands", [])
    commands.append("python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]))
    if "codec" in sections:
        res.update(_codec_checks(torch, dev, masks, Message, build_codec, RandomMaskCodec))
    if "lowrank" in sections:
        res["lowrank_codec"] = _lowrank_check(torch, dev)
    if "train" in sections:
        runs = res.setdefault("train_pp1_nccl", {})
        for dtype in ("fp32", "bf16"):
            runs[f"{args.model}_{dtype}"], run_dir = _train_run(args.model, dtype, args.steps)
            print(json.dumps(runs[f"{args.model}_{dtype}"], indent=2), flush=True)
        if "eval" in sections:
            res.setdefault("eval_cli_cuda", {})[args.model] = _eval_run(run_dir)
    print(json.dumps(res, indent=2))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        json.dump(res, open(args.out, "w"), indent=2)


def _codec_checks(torch, dev, masks, Message, build_codec, RandomMaskCodec):
    res = {}

    same = True
    for (seed, b, step, mb, H, T, K) in [(0, 0, 0, 0, 576, 256, 29), (7, 1, 123, 5, 2048, 2048, 102),
                                          (3, 2, 9, 1, 4096, 512, 205), (11, 0, 1, 0, 64, 8, 3)]:
        key = masks.mask_key(seed, b, step, mb, H)
        cpu = masks.kept_indices(key, T, H, K, device="cpu")
        gpu = masks.kept_indices(key, T, H, K, device=dev).cpu()
        same &= bool(torch.equal(cpu, gpu))
    res["prf_cuda_equals_cpu"] = same

    x = torch.randn(2, 64, 2048)
    msg = Message(key=masks.mask_key(1, 0, 2, 3, 2048), shape=tuple(x.shape), keep=102)
    ok = True
    for codec_name, wire in (("random", "fp32"), ("random", "bf16"), ("topk", "fp32")):
        outs = []
        for d in ("cpu", dev):
            tx, rx = build_codec(codec_name, wire), build_codec(codec_name, wire)
            xd = x.to(d)
            sent = tx.pack_activation(xd, msg)
            y = rx.unpack_activation([t.clone() for t in sent], msg, xd.dtype)
            outs.append(y.cpu())
        ok &= bool(torch.equal(outs[0], outs[1]))
    res["codec_cuda_equals_cpu"] = ok

    H, T = 2048, 2048
    keep = masks.kept_count(H, 0.95)
    xa = torch.randn(1, T, H, device=dev, dtype=torch.bfloat16)
    ga = torch.randn_like(xa)

    def codec_round(i):
        tx, rx = RandomMaskCodec(), RandomMaskCodec()
        m = Message(key=masks.mask_key(0, 0, i, 0, H), shape=(1, T, H), keep=keep)
        sent = tx.pack_activation(xa, m)
        rx.unpack_activation([v.clone() for v in sent], m, xa.dtype)
        gs = rx.pack_gradient(ga, m)
        tx.unpack_gradient([v.clone() for v in gs], m, xa.dtype)

    def timed(fn, reps=10):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(reps):
            fn(i) if fn.__code__.co_argcount else fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps / 1000.0

    codec_s = timed(lambda i=0: codec_round(i))
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    cfg = LlamaConfig(hidden_size=H, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=64, max_position_embeddings=T)
    cfg._attn_implementation = "sdpa"
    layers = torch.nn.ModuleList([LlamaDecoderLayer(cfg, i) for i in range(8)]).to(dev, torch.bfloat16)
    rot = LlamaRotaryEmbedding(cfg).to(dev)
    pos = torch.arange(T, device=dev).unsqueeze(0)

    def stage():
        h = torch.randn(1, T, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
        cs = rot(h, pos)
        out = h
        for layer in layers:
            o = layer(out, attention_mask=None, position_ids=pos, position_embeddings=cs)
            out = o[0] if isinstance(o, tuple) else o
        out.float().sum().backward()

    stage_s = timed(stage, reps=5)
    res["llama1b"] = {"hidden": H, "seq_len": T, "keep": keep, "codec_s": round(codec_s, 6),
                      "stage_8_layers_fwd_bwd_s": round(stage_s, 6), "overhead_share": round(codec_s / stage_s, 5)}
    return res


def _lowrank_check(torch, dev):
    from ds_twocircuit.codecs import Message
    from ds_twocircuit.codecs.lowrank import LowRankCodec
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 256, generator=g) @ torch.randn(256, 576, generator=g) + 3.0
    msg = Message(key=1, shape=(512, 576), keep=576, refresh=True)
    outs, nbytes = [], []
    for d in ("cpu", dev):
        tx, rx = LowRankCodec(), LowRankCodec()
        sent = tx.pack_activation(x.to(d), msg)
        nbytes.append(sum(t.numel() * t.element_size() for t in sent))
        outs.append(rx.unpack_activation([t.clone() for t in sent], msg, torch.float32).cpu())
    rel = float((outs[0] - outs[1]).norm() / outs[0].norm())
    err = float((outs[0] - x).norm() / (x - x.mean(0)).norm())
    return {"bytes_cpu": nbytes[0], "bytes_cuda": nbytes[1], "cuda_vs_cpu_rel_diff": rel,
            "reconstruction_rel_err_cpu": err, "ok": nbytes[0] == nbytes[1] and rel < 1e-2}


def _launcher() -> list[str]:
    """DeepSpeed's launcher: the ``deepspeed`` script beside this Python, on PATH, or its module."""
    here = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    if os.path.isfile(here):
        return [here]
    found = shutil.which("deepspeed")
    return [found] if found else [sys.executable, "-m", "deepspeed.launcher.runner"]


def _train_run(model: str, dtype: str, steps: int):
    import subprocess
    import tempfile
    import time
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = os.path.join(tempfile.mkdtemp(prefix="gpu_check_"), "run")
    cmd = _launcher() + ["--num_gpus", "1", os.path.join(root, "launch", "train.py"), "--deepspeed",
                         os.path.join(root, "ds_configs", "lowrank.json"), "--pp", "1", "--steps", str(steps),
                         "--model", model, "--output-dir", out, "--eval-sequences", "32"]
    if dtype == "bf16":
        cmd += ["--set", "bf16.enabled=true"]
    t0 = time.time()
    p = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=1800)
    rec = {"command": " ".join(cmd), "returncode": p.returncode, "process_wall_s": round(time.time() - t0, 1)}
    if p.returncode != 0:
        rec["stderr_tail"] = (p.stdout + p.stderr)[-3000:]
        return rec, None
    summary = json.load(open(os.path.join(out, "summary.json")))
    rec.update({"nccl": "nccl" in (p.stdout + p.stderr).lower(), "steps": summary["steps"],
                "loss_first": summary["loss_first"], "loss_last": summary["loss_last"],
                "heldout_loss_first": summary.get("heldout_loss_first"), "heldout_loss": summary.get("heldout_loss"),
                "heldout_loss_se": summary.get("heldout_loss_se"), "tokens_per_s": summary["tokens_per_s"]})
    return rec, out


def _eval_run(run_dir):
    import subprocess
    if run_dir is None:
        return {"skipped": "the training run failed"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res_path = os.path.join(os.path.dirname(run_dir), "eval.json")
    cmd = [sys.executable, "-m", "eval", "--checkpoint", os.path.join(run_dir, "hf"), "--tasks", "code-ppl",
           "--device", "cuda", "--ppl-tokens", "4096", "--out", res_path]
    p = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=1800)
    rec = {"command": " ".join(cmd), "returncode": p.returncode}
    if p.returncode == 0 and os.path.isfile(res_path):
        r = json.load(open(res_path))
        rec["device"] = r.get("settings", {}).get("device")
        ck = r["checkpoints"][0]
        rec["dtype"] = ck["checkpoint"].get("dtype")
        rec["code_ppl"] = {k: ck["runs"][0]["tasks"]["code-ppl"].get(k) for k in ("loss", "perplexity", "tokens")}
    else:
        rec["stderr_tail"] = (p.stdout + p.stderr)[-3000:]
    return rec


SECTIONS = ("codec", "lowrank", "train", "eval")

if __name__ == "__main__":
    main()
