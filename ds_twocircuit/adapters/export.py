"""The end-of-run export across the ranks (``ds_twocircuit.export`` is the file side).

No weight crosses a link: each pipeline stage's first data-parallel replica writes its own shard
into ``<out>.partial``, rank 0 adds config, tokenizer and index and renames the folder to
``<out>``. What crosses, counted as wire kind ``export`` (8 bytes of length plus the payload per
message sent to rank 0):

* the names and byte sizes of a stage's tensors, only for a shard rank 0 cannot see (an output
  folder not shared with that stage's node; that node's ``<out>`` then holds its shards, for
  ``python -m ds_twocircuit.export merge``);
* LoRA runs: each stage's adapters (PEFT reads one ``adapter_model.safetensors``, written by
  rank 0; the adapters are a small share of the model).

A barrier and one flag per stage (which shards rank 0 sees) coordinate this; they are control
messages, uncounted like the run's other barriers and scalar collectives.
"""
from __future__ import annotations

import os
import shutil

from .. import export as ex
from .. import wire


def export_hf_folder(engine, plan, world, out: str) -> str:
    """Write the trained model to ``out`` (every rank of the fast circuit calls this); returns
    ``out``."""
    if plan.tc.lora.enabled:
        return _export_adapters(engine, plan, world, out)
    import torch
    import torch.distributed as dist
    from .dist import from_comm, to_comm
    from .pipe_module import stage_hf_state

    partial = out + ".partial"
    stage, stages = engine.stage_id, engine.num_stages
    writer = engine.grid.get_data_parallel_id() == 0
    _rank0_then_each_node(world, lambda: shutil.rmtree(partial, ignore_errors=True))
    entries, dtype = {}, None
    if writer:
        tied_kept = plan.spec.tied and plan.tc.tied_embeddings in ("sync", "freeze")
        state = ex.owned_state(stage_hf_state(engine.module, plan.spec), stage, tied_kept)
        dtype = next(iter(state.values())).dtype if state else None
        entries = ex.write_shard(state, partial, stage, stages)
    dist.barrier()                               # every shard is written
    missing = torch.zeros(stages, dtype=torch.float64)
    if world.rank == 0:
        for s in range(1, stages):
            missing[s] = float(not os.path.isfile(os.path.join(partial, ex.shard_name(s, stages))))
    flags = to_comm(missing)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    elsewhere = [s for s, m in enumerate(from_comm(flags).tolist()) if m > 0]

    if world.rank == 0:
        try:
            by_stage = {0: entries}
            for s in range(1, stages):
                by_stage[s] = (ex.decode_entries(_recv_bytes(engine.grid.stage_to_global(s, data=0)))
                               if s in elsewhere else
                               ex.shard_entries(os.path.join(partial, ex.shard_name(s, stages))))
            index = ex.build_index(by_stage, stages)
            config = ex.hf_config(plan.model_folder, plan.spec.tied, plan.tc.tied_embeddings, dtype)
            ex.write_model_files(partial, index, config, plan.model_folder)
            ex.publish(partial, out)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        if elsewhere:
            print(f"[ds_twocircuit] {out}: the shards of stage(s) {', '.join(str(s) for s in elsewhere)} "
                  f"are in {out} on their own nodes (the output folder is not shared); {ex.MERGE_HINT}",
                  flush=True)
    elif writer and stage in elsewhere:
        _send_bytes(ex.encode_entries(entries), 0)
    if elsewhere:       # each other node's folder holds its stages' shards: renamed as rank 0's
        dist.barrier()  # after rank 0's rename (a node sharing its disk finds no .partial left)
        if world.rank != 0 and world.local_rank == 0 and os.path.isdir(partial):
            ex.publish(partial, out)
        dist.barrier()
    return out


def _export_adapters(engine, plan, world, out: str) -> str:
    """LoRA: a PEFT adapter folder written by rank 0 from every stage's adapters (sent to it,
    counted as ``export``)."""
    from ..lora import save_adapter_folder
    from .pipe_module import stage_adapter_state
    writer = engine.grid.get_data_parallel_id() == 0
    state = stage_adapter_state(engine.module) if writer else {}
    if world.rank == 0:
        for s in range(1, engine.num_stages):
            state.update(ex.decode_state(_recv_bytes(engine.grid.stage_to_global(s, data=0))))
        partial = out + ".partial"
        shutil.rmtree(partial, ignore_errors=True)
        try:
            save_adapter_folder(state, plan.tc.lora, plan.model_folder, partial)
            ex.copy_tokenizer(plan.model_folder, partial)
            ex.publish(partial, out)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    elif writer:
        _send_bytes(ex.encode_state(state), 0)
    return out


def _send_bytes(payload: bytes, dst: int) -> None:
    """``payload`` to rank ``dst``: its length (int64), then the bytes; counted as ``export``."""
    import torch
    import torch.distributed as dist
    from .dist import to_comm
    dist.send(to_comm(torch.tensor([len(payload)], dtype=torch.int64)), dst)
    if payload:
        dist.send(to_comm(torch.frombuffer(bytearray(payload), dtype=torch.uint8)), dst)
    wire.count("export", 8 + len(payload), messages=2 if payload else 1)


def _recv_bytes(src: int) -> bytes:
    import torch
    import torch.distributed as dist
    from .dist import from_comm, to_comm
    n = to_comm(torch.zeros(1, dtype=torch.int64))
    dist.recv(n, src)
    size = int(from_comm(n)[0])
    if not size:
        return b""
    buf = to_comm(torch.empty(size, dtype=torch.uint8))
    dist.recv(buf, src)
    return from_comm(buf).numpy().tobytes()


def _rank0_then_each_node(world, fn) -> None:
    """``fn()`` on rank 0, then on the first process of every other node (whose disk may not be
    shared with rank 0's; on a shared one rank 0 has done it by then)."""
    import torch.distributed as dist
    if world.rank == 0:
        fn()
    dist.barrier()
    if world.rank != 0 and world.local_rank == 0:
        fn()
    dist.barrier()
