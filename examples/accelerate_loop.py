#!/usr/bin/env python
"""A plain Accelerate training loop with compressed DP sync (PowerSGD, DiLoCo, Streaming DiLoCo).

    accelerate launch --config_file ds_configs/accelerate/streaming_diloco.yaml examples/accelerate_loop.py

Fine-tunes the embedded default (SmolLM2-135M-Instruct) on the Python standard library's source.
The only line that differs from a stock Accelerate + DeepSpeed loop is marked ``<-- the one line``:
it reads ``"twocircuit": {"dp": {...}}`` from the DeepSpeed JSON the Accelerate config points to and
replaces DeepSpeed's all-reduce by that backend. ``finalize_dp`` at the end (DiLoCo: one exact
average of what drifted since the last sync) makes every replica hold the model that is saved.

Data is sharded by ``torch.distributed``'s rank, not by Accelerate's process count: Accelerate with
DeepSpeed on a CPU-only host reports one process per rank (``accelerator.num_processes == 1``), so
the loop and the integration never rely on it.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from accelerate import Accelerator
from transformers import AutoModelForCausalLM, AutoTokenizer

from ds_twocircuit.adapters.accelerate import dp_metrics, enable_dp_compression, finalize_dp, replicas_identical
from ds_twocircuit.data import PackedSequences, load_documents, split_documents
from ds_twocircuit.models.presets import resolve_model


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m (default), tiny, or a folder")
    p.add_argument("--data", default="sympy", help="as launch/train.py --data: sympy (default, pinned), deepspeed-cpp, a folder, or a .jsonl file")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="runs/accelerate_loop")
    p.add_argument("--stock", action="store_true", help="skip the one line: DeepSpeed's own all-reduce "
                   "(for comparison)")
    args = p.parse_args(argv)

    accelerator = Accelerator()
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    folder = resolve_model(args.model)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    if not args.stock:
        enable_dp_compression(accelerator)                      # <-- the one line
    engine = accelerator.deepspeed_engine_wrapped.engine
    mb = engine.train_micro_batch_size_per_gpu()

    tok = AutoTokenizer.from_pretrained(folder)
    train, _ = split_documents(load_documents(args.data))
    seqs = PackedSequences(train, tok, args.seq_len, seed=args.seed)
    t0 = time.time()
    for step in range(args.steps):
        gas = engine.gradient_accumulation_steps()
        for m in range(gas):
            x = seqs.batch(((step * gas + m) * world + rank) * mb, mb).to(accelerator.device)
            with accelerator.accumulate(model):
                loss = model(input_ids=x, labels=x).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
        if rank == 0 and (step % 5 == 0 or step + 1 == args.steps):
            m_ = dp_metrics(accelerator)
            ratio = (f"{m_['dp/compression_ratio']:.1f}x fewer than all-reduce" if "dp/compression_ratio" in m_
                     else f"no sync yet; an all-reduce would have sent {m_.get('dp/allreduce_bytes', 0):,}")
            print(f"step {step}: loss {loss.item():.4f}, DP bytes sent {m_.get('dp/bytes_sent', 0):,} ({ratio})",
                  flush=True)
    if not args.stock:
        finalize_dp(accelerator)
    metrics = dp_metrics(accelerator)
    identical = replicas_identical(engine)
    if rank == 0:                                               # saved once, whatever Accelerate reports
        os.makedirs(args.output_dir, exist_ok=True)
        engine.module.save_pretrained(os.path.join(args.output_dir, "hf"))
        tok.save_pretrained(os.path.join(args.output_dir, "hf"))
        with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
            json.dump({"steps": args.steps, "world_size": world, "seconds": round(time.time() - t0, 1),
                       "backend": engine.dp_backend.backend_name if not args.stock else "deepspeed",
                       "replicas_identical": identical,
                       "accelerate_num_processes": accelerator.num_processes, **metrics}, f, indent=2)
        print(f"saved {args.output_dir}/hf; {json.dumps(metrics)}", flush=True)
    accelerator.wait_for_everyone()
    accelerator.end_training()      # destroys the process group: gloo's threads must not outlive the interpreter


if __name__ == "__main__":
    main()
