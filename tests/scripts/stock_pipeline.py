"""Stock DeepSpeed PipelineEngine (deepspeed.initialize) on the same pipeline module and data as
launch/train.py; writes the final weights (HF names) and per-step losses. Used by the p = 0 test."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main(cfg_path, out, steps, seq):
    from ds_twocircuit.adapters.dist import init_world, prepare_runtime
    prepare_runtime()
    world = init_world(0)
    import deepspeed
    from transformers import AutoTokenizer
    from ds_twocircuit.data import MicroBatchStream, PackedSequences, load_documents, split_documents
    from ds_twocircuit.models.layers import ModelSpec
    from ds_twocircuit.adapters.pipe_module import build_pipeline, stage_hf_state
    from ds_twocircuit.models.presets import resolve_model

    cfg = json.load(open(cfg_path))
    tc = cfg.pop("twocircuit")
    opt = cfg.pop("optimizer")["params"]
    cfg["train_batch_size"] = cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"]
    folder = resolve_model("tiny")
    spec = ModelSpec(folder)
    module = build_pipeline(spec, 2, tc.get("partition", "type"), tc.get("tied_embeddings", "untie"))
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=opt["lr"], betas=tuple(opt["betas"]), eps=opt["eps"],
                                  weight_decay=opt["weight_decay"])
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, model_parameters=params, config=cfg)
    assert type(engine).__name__ == "PipelineEngine"
    tok = AutoTokenizer.from_pretrained(folder)
    train, _ = split_documents(load_documents("sympy"))
    seqs = PackedSequences(train, tok, seq, seed=0)
    stream = MicroBatchStream(seqs, cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"], 1, 0)
    losses = [float(engine.train_batch(stream)) for _ in range(steps)]
    state = stage_hf_state(engine.module, spec)
    parts = [None] * world.size if world.rank == 0 else None
    torch.distributed.gather_object(state, parts, dst=0)
    if world.rank == 0:
        os.makedirs(out, exist_ok=True)
        merged = {}
        for p in parts:
            merged.update(p)
        torch.save(merged, os.path.join(out, "weights.pt"))
        json.dump(losses, open(os.path.join(out, "losses.json"), "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
