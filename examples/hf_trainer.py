#!/usr/bin/env python
"""The Hugging Face Trainer with compressed DP sync (PowerSGD, DiLoCo, Streaming DiLoCo).

    accelerate launch --config_file ds_configs/accelerate/streaming_diloco.yaml examples/hf_trainer.py

Fine-tunes the embedded default (SmolLM2-135M-Instruct) on the Python standard library's source.
The only line that differs from a stock Trainer script is marked ``<-- the one line``: the callback
switches DeepSpeed's all-reduce to the backend in the DeepSpeed JSON's ``"twocircuit": {"dp": ...}``
when training starts, puts the DP metrics (``dp/bytes_sent``, ``dp/compression_ratio``,
``dp/comm_s``, ``dp/replicas_in_sync``, ...) into every log (so ``report_to`` reporters and
``trainer_state.json`` get them; ``dp_metrics.csv`` in the output folder has them too), and
finishes the DP sync before the model is saved.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

from ds_twocircuit.adapters.accelerate import DPCompressionCallback, dp_metrics, replicas_identical
from ds_twocircuit.data import PackedSequences, load_documents, split_documents
from ds_twocircuit.models.presets import resolve_model


class Sequences(torch.utils.data.Dataset):
    """Packed token sequences of this replica (by torch.distributed's rank: Accelerate with
    DeepSpeed on a CPU-only host reports one process per rank and would not shard)."""

    def __init__(self, seqs: PackedSequences, n: int):
        self.seqs, self.n = seqs, n
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = self.seqs[i * self.world + self.rank]
        return {"input_ids": x, "labels": x}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m (default), tiny, or a folder")
    p.add_argument("--data", default="sympy", help="as launch/train.py --data (default: the pinned sympy corpus)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4, help="per replica; must match the DeepSpeed JSON")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--output-dir", default="runs/hf_trainer")
    p.add_argument("--report-to", default="none", help="as TrainingArguments.report_to (tensorboard, ...)")
    args = p.parse_args(argv)

    folder = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(folder)
    train, _ = split_documents(load_documents(args.data))
    data = Sequences(PackedSequences(train, tok, args.seq_len, seed=0), args.steps * args.batch_size)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    targs = TrainingArguments(output_dir=args.output_dir, max_steps=args.steps, learning_rate=args.lr,
                              per_device_train_batch_size=args.batch_size, logging_steps=1,
                              save_strategy="no", report_to=args.report_to, use_cpu=not torch.cuda.is_available(),
                              dataloader_drop_last=True)
    trainer = Trainer(model=model, args=targs, train_dataset=data)
    trainer.add_callback(DPCompressionCallback(trainer))       # <-- the one line
    trainer.train()
    trainer.save_model(os.path.join(args.output_dir, "hf"))   # Trainer saves on the main process only
    trainer.save_state()                                        # trainer_state.json: the log history
    # summary.json, as examples/accelerate_loop.py writes it: the run's DP totals and whether every
    # replica ends with the same weights
    engine = trainer.model_wrapped
    identical = replicas_identical(engine)
    if (dist.get_rank() if dist.is_initialized() else 0) == 0:
        with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
            json.dump({"steps": args.steps, "world_size": engine.dp_world_size,
                       "backend": engine.dp_backend.backend_name, "replicas_identical": identical,
                       **dp_metrics(engine)}, f, indent=2)
    trainer.accelerator.end_training()      # destroys the process group: gloo's threads must not outlive the interpreter


if __name__ == "__main__":
    main()
