"""Save and resume *all* training state.

DeepSpeed's ``save_checkpoint`` writes the standard layout (per-layer weights, which the anchor
circuit and the eval CLI read) but keeps only data-parallel rank 0's optimizer and no state of
ours. Replicas are not identical under DiLoCo (local weights, inner optimizer) or PowerSGD (error
buffers), so every rank also writes ``<tag>/twocircuit/stage{S}_dp{D}.pt`` with its optimizer
state (spectral-correction state included), DP-backend state, local weights when they may differ
from rank 0's, and RNG state. A resumed run continues exactly where the saved one stopped: the
data position and the PRF mask keys are functions of the global step DeepSpeed restores (and of the
stream's origin, which moves when a run resumes on another DP width).

Resuming on another DP width: every new replica of a stage reads all the old replicas' files of
that stage and loads their merge (``ds_twocircuit.replicas``: agreed state from the first replica,
per-replica state averaged; each DP backend and codec says which is which), and the training stream
continues at the first sequence no replica has seen.
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from ..config import ConfigError
from ..files import atomic_write, atomic_write_json
from ..faults import COMMITTED, STATE_DIR, is_committed, maybe_inject, newest_committed


def _rank_file(ckpt_dir: str, tag: str, stage: int, dp_rank: int) -> str:
    return os.path.join(ckpt_dir, tag, STATE_DIR, f"stage{stage:02d}_dp{dp_rank:04d}.pt")


def _accelerator_rng_state():
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    return None if acc.device_name() == "cpu" else acc.get_rng_state()


def _set_accelerator_rng_state(state) -> None:
    from deepspeed.accelerator import get_accelerator
    get_accelerator().set_rng_state(state)


def save_training_state(engine, ckpt_dir: str, fault=None, origin=None) -> str:
    """Every rank writes its part (atomically: temp file, then rename); after a barrier rank 0
    writes ``twocircuit/COMPLETE.json`` -- the commit marker resume looks for -- and a second
    barrier makes the commit visible to all before training goes on."""
    tag = f"global_step{engine.global_steps}"
    backend = engine.dp_backend  # its state_dict() waits for in-flight syncs without finishing them
    engine.save_checkpoint(ckpt_dir, tag=tag, client_state={
        "twocircuit": {"pp": engine.num_stages, "dp": engine.dp_world_size,
                       "dp_backend": engine.tc.dp.backend, "mask_seed": engine.mask_seed}})
    path = _rank_file(ckpt_dir, tag, engine.stage_id, engine.dp_rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    state = {
        "global_steps": engine.global_steps,
        "optimizer": engine.optimizer.state_dict(),
        "dp_backend": backend.state_dict() if backend is not None else None,
        "module": engine.module.state_dict() if getattr(backend, "replicas_may_differ", False) else None,
        "rng": torch.get_rng_state(),
        # the accelerator's generator too (CUDA: this rank's device; on CPU it is the CPU generator)
        "accelerator_rng": _accelerator_rng_state(),
        "codec": ({"out": engine.codec_out.state_dict(), "in": engine.codec_in.state_dict()}
                  if getattr(engine.codec_out, "stateful", False) else None),
    }
    atomic_write(path, lambda f: torch.save(state, f), binary=True)
    maybe_inject(fault, "kill-in-checkpoint", dist.get_rank(), engine.global_steps)
    dist.barrier()
    if dist.get_rank() == 0:
        from ..data import StreamOrigin
        origin = origin or StreamOrigin()
        atomic_write_json(os.path.join(ckpt_dir, tag, STATE_DIR, COMMITTED),
                          {"global_steps": engine.global_steps, "pp": engine.num_stages,
                           "dp": engine.dp_world_size, "backend": engine.tc.dp.backend,
                           "micro_batch_size": engine.train_micro_batch_size_per_gpu(),
                           "origin": origin.to_dict(),
                           "consumed_micro_batches": origin.consumed(engine.global_steps, engine.dp_world_size,
                                                                     engine.micro_batches)})
    dist.barrier()
    return os.path.join(ckpt_dir, tag)


def _resolve_tag(ckpt_dir: str) -> tuple[str, str]:
    """A tag folder itself, or a checkpoint folder: its newest *committed* tag (DeepSpeed's
    ``latest`` may name one whose writing was cut short)."""
    if os.path.isfile(os.path.join(ckpt_dir, STATE_DIR, COMMITTED)):  # a tag folder itself
        return os.path.dirname(os.path.abspath(ckpt_dir)), os.path.basename(os.path.abspath(ckpt_dir))
    newest = newest_committed(ckpt_dir)
    if newest is not None:
        return ckpt_dir, os.path.basename(newest[1])
    latest = os.path.join(ckpt_dir, "latest")
    if not os.path.isfile(latest):
        raise ConfigError(f"--resume {ckpt_dir!r}: no committed checkpoint (global_step*/{STATE_DIR}/"
                          f"{COMMITTED}) and no 'latest' file; expected a folder written with "
                          "--save-checkpoint or --save-interval")
    return ckpt_dir, open(latest).read().strip()


def merge_rank_states(states: list[dict], backend_cls, codec_cls, backend_cfg=None) -> dict:
    """One rank file's state from the old replicas' files of a stage (a resume on another DP
    width): optimizer moments and local weights averaged, the DP backend's and the codec's state
    merged by their own rules, the rest from the first replica."""
    from ..replicas import mean_state
    first = states[0]
    merged = {**first, "optimizer": mean_state([s["optimizer"] for s in states]),
              "dp_backend": (backend_cls.merge_replica_states([s["dp_backend"] for s in states], backend_cfg)
                             if first["dp_backend"] is not None else None),
              "module": mean_state([s["module"] for s in states]) if first["module"] is not None else None}
    if first.get("codec") is not None:
        merged["codec"] = {end: codec_cls.merge_states([s["codec"][end] for s in states]) for end in ("out", "in")}
    return merged


def load_training_state(engine, ckpt_dir: str):
    """Restore everything; returns the global step to continue from and the training stream's
    origin (``data.StreamOrigin``)."""
    from ..data import StreamOrigin
    root, tag = _resolve_tag(ckpt_dir)
    meta_path = os.path.join(root, tag, STATE_DIR, COMMITTED)
    if not is_committed(root, tag):
        raise ConfigError(f"--resume {ckpt_dir!r}: checkpoint {tag} is incomplete ({meta_path} missing)")
    meta = json.load(open(meta_path))
    if meta["pp"] != engine.num_stages:
        raise ConfigError(f"--resume: checkpoint has pp={meta['pp']}, this run pp={engine.num_stages}; "
                          "resume with the same --pp (a replica that lost a stage drops out as a whole: the "
                          "pipeline stages are not elastic, the data-parallel width is)")
    backend_name = engine.tc.dp.backend
    if meta["backend"] != backend_name:
        raise ConfigError(f"--resume: checkpoint used twocircuit.dp.backend={meta['backend']!r}, this run "
                          f"{backend_name!r}")
    mb = engine.train_micro_batch_size_per_gpu()
    if meta.get("micro_batch_size", mb) != mb:
        raise ConfigError(f"--resume: checkpoint trained micro-batches of {meta['micro_batch_size']} sequences, "
                          f"this run {mb}; resume with the same --micro-batch-size")
    if meta.get("engine", "pipeline") != "pipeline":
        raise ConfigError(f"--resume {ckpt_dir!r}: a checkpoint of the {meta['engine']} engine; resume it with "
                          f"--engine {meta['engine']}")
    old_dp = meta["dp"]
    same_dp = old_dp == engine.dp_world_size
    if not same_dp and (engine.zero_optimization_stage() > 0 or engine.bfloat16_enabled() or engine.fp16_enabled()):
        raise ConfigError(f"--resume on dp={engine.dp_world_size} from a dp={old_dp} checkpoint needs "
                          "zero_optimization.stage = 0 and fp32 (under ZeRO and DeepSpeed's mixed-precision "
                          "optimizers each replica holds a shard of the optimizer state, which cannot be merged); "
                          f"resume with --dp {old_dp}")
    engine.load_checkpoint(root, tag=tag, load_optimizer_states=False, load_lr_scheduler_states=True)
    if same_dp:
        state = torch.load(_rank_file(root, tag, engine.stage_id, engine.dp_rank), map_location="cpu",
                           weights_only=False)
    else:
        files = [_rank_file(root, tag, engine.stage_id, d) for d in range(old_dp)]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ConfigError(f"--resume on dp={engine.dp_world_size} from a dp={old_dp} checkpoint: every new "
                              f"replica of stage {engine.stage_id} merges all {old_dp} old replicas' state, but "
                              f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not on this node; "
                              "use a shared --output-dir or copy the checkpoint's twocircuit/ folder to every node")
        from ..codecs import get_codec
        from ..dp.registry import get_backend
        state = merge_rank_states([torch.load(f, map_location="cpu", weights_only=False) for f in files],
                                  get_backend(backend_name), get_codec(engine.tc.mode),
                                  engine.dp_backend.cfg if engine.dp_backend is not None else None)
    # the stream goes on at the first unseen sequence, whatever the new width or --grad-accum
    origin = StreamOrigin(meta["global_steps"], meta.get("consumed_micro_batches",
                                                         meta["global_steps"] * old_dp * engine.micro_batches))
    engine.optimizer.load_state_dict(state["optimizer"])
    from ..engines import rescale_resumed_lr
    rescale_resumed_lr(engine.optimizer, engine.tc.dp, old_dp, engine.dp_world_size)
    if state["module"] is not None:
        engine.module.load_state_dict(state["module"])
    if engine.dp_backend is not None and state["dp_backend"] is not None:
        engine.dp_backend.load_state_dict(state["dp_backend"])
    torch.set_rng_state(state["rng"])
    if state.get("accelerator_rng") is not None:
        _set_accelerator_rng_state(state["accelerator_rng"])
    if state.get("codec") is not None and getattr(engine.codec_out, "stateful", False):
        engine.codec_out.load_state_dict(state["codec"]["out"])
        engine.codec_in.load_state_dict(state["codec"]["in"])
    if engine.global_steps != state["global_steps"]:
        raise ConfigError(f"--resume: DeepSpeed restored step {engine.global_steps} but "
                          f"{STATE_DIR} state is from step {state['global_steps']}")
    return engine.global_steps, origin
