#!/usr/bin/env python
"""GPU checks of the fast circuit's mask PRF and codec (run where a CUDA device exists).

1. The PRF gives bit-identical kept channels on CUDA and on CPU (several keys and shapes,
   including Llama-1B's hidden size).
2. The codec round trip on CUDA equals the CPU one (random mask, Top-K, bf16 wire).
3. Mask generation + pack + unpack at Llama-3.2-1B size (H = 2048, sequence 2048, one sequence per
   micro-batch, both directions, both ends) against the forward + backward of an 8-layer stage of
   Llama-1B-shaped decoder layers in bf16, as a share.

    python launch/gpu_check.py --out docs/benchmarks/gpu_check.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    import torch
    from ds_twocircuit import masks
    from ds_twocircuit.codec import Message, RandomMaskCodec, make_codec

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: this script checks the GPU path")
    dev = torch.device("cuda")
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}

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
            tx, rx = make_codec(codec_name, wire), make_codec(codec_name, wire)
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
    print(json.dumps(res, indent=2))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        json.dump(res, open(args.out, "w"), indent=2)


if __name__ == "__main__":
    main()
