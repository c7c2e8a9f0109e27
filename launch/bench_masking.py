#!/usr/bin/env python
"""Masking benchmark: codec overhead as a share of stage compute, and dense vs M95 wire bytes.

Side by side in one run on the default model (SmolLM2-135M, pp=2, 8 x 128 tokens a step):
the real multi-process pipeline is launched once with dense boundaries and once with M95, both
for the same steps; from their summaries come

* ``overhead_share``: time in mask generation + packing + unpacking (``codec_s``, every boundary
  message, both directions, all ranks) over time in stage forward + backward (all ranks), M95 run;
* ``activation_bytes_ratio`` / ``gradient_bytes_ratio``: dense bytes / M95 bytes crossing the link.

It also times the codec at Llama-3.2-1B size (H = 2048, sequence 2048, one sequence per
micro-batch) against one Llama-1B-shaped decoder layer's forward + backward on this machine,
scaled to a stage of 8 layers (16 layers / 2 stages).

    python launch/bench_masking.py            # writes docs/benchmarks/masking.{json,md}
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
OUT = os.path.join(ROOT, "docs", "benchmarks")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(config, steps, out, model):
    ds = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [ds, "--num_gpus", "2", "--master_port", str(free_port()), "launch/train.py", "--deepspeed", config,
           "--model", model, "--steps", str(steps), "--eval-sequences", "0", "--no-save-model", "--output-dir", out]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def codec_at_llama1b(threads_note: str) -> dict:
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    from ds_twocircuit import masks
    from ds_twocircuit.codecs import Message
    from ds_twocircuit.codecs.mask import RandomMaskCodec

    H, T = 2048, 2048
    keep = masks.kept_count(H, 0.95)
    x = torch.randn(1, T, H)
    g = torch.randn(1, T, H)

    def codec_round(i):
        tx, rx = RandomMaskCodec(), RandomMaskCodec()
        msg = Message(key=masks.mask_key(0, 0, i, 0, H), shape=(1, T, H), keep=keep)
        t0 = time.perf_counter()
        vals = tx.pack_activation(x, msg)                         # sender: mask + gather
        rx.unpack_activation([v.clone() for v in vals], msg, x.dtype)  # receiver: mask + scatter
        gv = rx.pack_gradient(g, msg)                             # receiver: gather (mask cached)
        tx.unpack_gradient([v.clone() for v in gv], msg, x.dtype)  # sender: scatter (mask cached)
        return time.perf_counter() - t0

    codec_round(-1)
    codec = min(codec_round(i) for i in range(3))
    cfg = LlamaConfig(hidden_size=H, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=64, max_position_embeddings=T)
    cfg._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(cfg, 0)
    rot = LlamaRotaryEmbedding(cfg)
    pos = torch.arange(T).unsqueeze(0)
    h = torch.randn(1, T, H, requires_grad=True)

    def layer_step():
        t0 = time.perf_counter()
        out = layer(h, attention_mask=None, position_ids=pos, position_embeddings=rot(h, pos))
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))
        return time.perf_counter() - t0

    layer_step()
    one_layer = min(layer_step() for _ in range(2))
    stage = 8 * one_layer
    return {"hidden": H, "seq_len": T, "keep": keep, "codec_s_per_microbatch": round(codec, 4),
            "decoder_layer_fwd_bwd_s": round(one_layer, 3), "stage_8_layers_s": round(stage, 3),
            "overhead_share": round(codec / stage, 5), "threads": threads_note}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--skip-llama1b", action="store_true")
    args = p.parse_args()
    command = "python launch/bench_masking.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    tmp = os.path.join(ROOT, "runs", "bench_masking")
    dense = launch("ds_configs/dense.json", args.steps, os.path.join(tmp, "dense"), args.model)
    m95 = launch("ds_configs/m95.json", args.steps, os.path.join(tmp, "m95"), args.model)
    t = m95["timing_s_all_ranks"]
    share = t["codec_s"] / (t["forward_s"] + t["backward_s"])
    dw, mw = dense["wire_bytes"], m95["wire_bytes"]
    res = {
        "benchmark": "masking", "model": args.model, "steps": args.steps, "mesh": m95["mesh"],
        "overhead_share": round(share, 5),
        "activation_bytes_ratio": round(dw["pp_activations"] / mw["pp_activations"], 4),
        "gradient_bytes_ratio": round(dw["pp_gradients"] / mw["pp_gradients"], 4),
        "kept_channels": m95["kept_channels"], "hidden_size": m95["hidden_size"],
        "dense": {"wire_bytes": dw, "bytes_per_token": dense["bytes_per_token"], "tokens_per_s": dense["tokens_per_s"],
                  "timing_s_all_ranks": dense["timing_s_all_ranks"]},
        "m95": {"wire_bytes": mw, "bytes_per_token": m95["bytes_per_token"], "tokens_per_s": m95["tokens_per_s"],
                "timing_s_all_ranks": t},
        "targets": {"overhead_share": "<= 0.05", "bytes_ratio": ">= 19.5"},
        "command": command,
    }
    if not args.skip_llama1b:
        import torch
        res["llama1b_cpu"] = codec_at_llama1b(f"{torch.get_num_threads()} CPU threads")
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "masking.json"), "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps({k: res[k] for k in ("overhead_share", "activation_bytes_ratio", "gradient_bytes_ratio")}))
    if "llama1b_cpu" in res:
        print(json.dumps(res["llama1b_cpu"]))


if __name__ == "__main__":
    main()
