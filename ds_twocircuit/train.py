"""The training entry point behind ``launch/train.py``.

One obvious path: validate everything (no process group yet) -> start the circuit's world ->
build the local pipeline stage from the HF folder -> MaskedPipelineEngine -> train, logging every
step -> evaluate held-out loss (dense and masked inference) -> sum the wire bytes of all ranks ->
write ``summary.json`` and the adapted model as a Hugging Face folder.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from . import pacing
from .config import ConfigError, TwoCircuitConfig, check_deepspeed_section, load_ds_config, resolve_config

DEFAULT_CONFIG = "ds_configs/lowrank.json"  # resolved by config.resolve_config after any install
OPTIMIZERS = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD", "adagrad": "Adagrad", "rmsprop": "RMSprop"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="launch/train.py",
        description="Two-circuit masked pipeline-parallel adaptation of a Hugging Face causal LM "
                    "on DeepSpeed. Launch with `deepspeed --num_gpus N launch/train.py ...`.")
    p.add_argument("--model", default="smollm2-135m",
                   help="HF model folder, hub id, or preset: smollm2-135m (default, offline), tiny")
    p.add_argument("--data", default="sympy",
                   help="sympy (default: the Python source of SymPy 1.14.0, pinned and verified), "
                        "deepspeed-cpp (C++/CUDA, pinned), stdlib (this interpreter's standard "
                        "library: not pinned), a folder of text files, a .jsonl file, or hf:<datasets name>")
    p.add_argument("--pp", type=int, default=None, help="pipeline stages (default: 2, or 1 for one process)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel replicas (default: fast ranks / pp)")
    p.add_argument("--anchor-replicas", type=int, default=None,
                   help="Z: anchor pipeline replicas on reserved ranks (default: the config's "
                        "twocircuit.anchor.replicas when twocircuit.anchor.enabled)")
    p.add_argument("--anchor-only", action="store_true",
                   help="run only the anchor circuit, as its own job, on the fast circuit's snapshot store "
                        "(every launched rank is an anchor rank; --dp names the fast circuit's dp)")
    p.add_argument("--anchor-store", default=None,
                   help="snapshot store folder shared by both circuits (default: twocircuit.anchor.store, "
                        "else <output_dir>/anchor_store)")
    p.add_argument("--steps", type=int, default=30,
                   help="total optimizer steps of the run (default 30); a resumed run continues to this step")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="sequences per micro-batch (default: the config's train_micro_batch_size_per_gpu)")
    p.add_argument("--grad-accum", type=int, default=None,
                   help="micro-batches per step per replica (default: the config's gradient_accumulation_steps)")
    p.add_argument("--lr", type=float, default=None, help="override the optimizer's lr")
    p.add_argument("--lora-r", type=int, default=None,
                   help="train LoRA adapters of this rank instead of the full model (twocircuit.lora.r; 0: off)")
    p.add_argument("--seed", type=int, default=0, help="data order and mask seed (default 0)")
    p.add_argument("--output-dir", default=None, help="default: runs/<config name>")
    p.add_argument("--eval-sequences", type=int, default=512,
                   help="held-out sequences scored at start and end, dense and through the codec "
                        "(default 512: 65,536 tokens at --seq-len 128; capped at the held-out set's "
                        "size; 0: skip)")
    p.add_argument("--save-checkpoint", action="store_true",
                   help="write a DeepSpeed checkpoint (weights, optimizer, DP and anchor state) at the end")
    p.add_argument("--save-interval", type=int, default=0,
                   help="checkpoint every N steps, and at the end (0: use --save-interval-minutes)")
    p.add_argument("--save-interval-minutes", type=float, default=10.0,
                   help="when --save-interval is 0: checkpoint about every M minutes of training "
                        "(default 10; turned into a step interval after the first steps; 0: off)")
    p.add_argument("--keep-checkpoints", type=int, default=2,
                   help="committed checkpoints kept in <output_dir>/checkpoint, older ones pruned (default 2)")
    p.add_argument("--resume", default=None,
                   help="'auto' (the newest committed checkpoint in <output_dir>/checkpoint, or a fresh "
                        "start if there is none) or a checkpoint folder. Under torchrun restarts "
                        "(--max-restarts) 'auto' is implied")
    p.add_argument("--peer-timeout", type=float, default=300.0,
                   help="seconds a rank waits for a silent peer (hung process, black-holed link) before "
                        "it stops with a diagnosis (default 300)")
    p.add_argument("--pace-mbit", type=float, default=None,
                   help="software throttle: pace this run's pipeline and DP sends as if every link ran at "
                        "this rate (Mbit/s each direction), for hosts where launch/mesh.py cannot create "
                        "network namespaces; default: $DS_TWOCIRCUIT_PACE_MBIT, else no pacing")
    p.add_argument("--no-save-model", action="store_true", help="skip writing <output_dir>/hf")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--deepspeed", dest="deepspeed_flag", action="store_true", default=False,
                   help=argparse.SUPPRESS)
    p.add_argument("--deepspeed_config", "--deepspeed-config", dest="config", default=None,
                   help="DeepSpeed JSON config with a \"twocircuit\" section (default ds_configs/lowrank.json; a shipped config's name works from any folder)")
    return p


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    # `--deepspeed path.json` (DeepSpeed's own spelling) and `--deepspeed_config path.json`
    fixed = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--deepspeed" and i + 1 < len(argv) and argv[i + 1].endswith(".json"):
            fixed += ["--deepspeed_config", argv[i + 1]]
            i += 2
            continue
        if a.startswith("--deepspeed=") and a.endswith(".json"):
            fixed += ["--deepspeed_config", a.split("=", 1)[1]]
            i += 1
            continue
        fixed.append(a)
        i += 1
    args = build_parser().parse_args(fixed)
    args.config = args.config or DEFAULT_CONFIG
    if args.resume is None and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        args.resume = "auto"  # torchrun restarted the group after a failure: continue, do not redo
    return args


# ------------------------------------------------------------------------------------------------
# Validation and planning: everything that can be wrong is found here, before any process group.

@dataclass(frozen=True)
class Plan:
    """Everything a run needs, found and checked before any process group exists; never written
    after :func:`make_plan` (what changes while training lives in :class:`Progress`)."""
    args: argparse.Namespace            # the parsed flags (``config`` resolved to a file)
    config_name: str                    # the config file's stem: runs/<config_name> by default
    tc: TwoCircuitConfig                # the "twocircuit" section, flag overrides applied
    ds_config: dict                     # the DeepSpeed section (batch sizes filled in)
    pp: int                             # pipeline stages
    dp: int                             # data-parallel replicas of the fast circuit
    z: int                              # anchor replicas (each of pp ranks)
    anchor_ranks: int                   # ranks of the launch held by the anchor circuit
    model_folder: str
    spec: Any                           # models.layers.ModelSpec
    parts: Any                          # layer boundaries of the stages
    train_docs: list
    heldout_docs: list
    data_fingerprint: str               # data.fingerprint of the corpus (names and contents)
    mb: int                             # micro-batch size per rank
    gas: int                            # micro-batches per step
    optimizer: tuple                    # (torch.optim class name, its keyword arguments)
    ckpt_policy: Any                    # faults.CheckpointPolicy
    fault: Any                          # faults.Fault to inject, or None
    output_dir: str


@dataclass
class Progress:
    """What changes while the fast circuit trains (for the lost-peer report and checkpoints)."""
    census: Any = None                  # faults.PeerCensus answering on the launcher's store
    step_now: int | None = None         # steps done so far
    phase: str | None = None            # what the run was doing, when not a training step
    committed_steps: list = field(default_factory=list)


def _batch_setting(ds: dict, key: str, flag_value, default: int, path: str) -> int:
    v = flag_value if flag_value is not None else ds.get(key, default)
    if v == "auto" or v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"{path}: {key} must be a positive integer, got {v!r}")
    return v


def make_plan(args, world_size: int) -> Plan:
    from .data import load_documents, split_documents
    from .models.layers import ModelSpec
    from .models.presets import resolve_model

    args.config = resolve_config(args.config)
    ds = load_ds_config(args.config)
    config_name = os.path.splitext(os.path.basename(args.config))[0]
    tc = TwoCircuitConfig.from_dict(ds.pop("twocircuit", {}))
    anchor = tc.anchor
    if args.anchor_store:
        anchor = dataclasses.replace(anchor, store=args.anchor_store)
    if (args.anchor_replicas is not None and args.anchor_replicas > 0) or args.anchor_only:
        anchor = dataclasses.replace(anchor, enabled=True)
    tc = dataclasses.replace(tc, anchor=anchor)
    if args.lora_r is not None:
        if args.lora_r < 0:
            raise ConfigError(f"--lora-r must be >= 0 (0: full fine-tuning), got {args.lora_r}")
        tc = dataclasses.replace(tc, lora=dataclasses.replace(tc.lora, r=args.lora_r))
    if args.pace_mbit is not None and not args.pace_mbit >= 0:
        raise ConfigError(f"--pace-mbit must be >= 0 Mbit/s (0: no pacing), got {args.pace_mbit}")
    z = args.anchor_replicas if args.anchor_replicas is not None else (
        tc.anchor.replicas if tc.anchor.enabled else 0)
    if z < 0:
        raise ConfigError(f"--anchor-replicas must be >= 0, got {z}")
    pp = args.pp or (2 if world_size >= 2 else 1)
    if args.anchor_only:
        if world_size % pp:
            raise ConfigError(f"--anchor-only: {world_size} processes are not a multiple of --pp {pp}")
        z, anchor_ranks, dp = world_size // pp, world_size, args.dp or 1
    else:
        anchor_ranks = z * pp
        fast = world_size - anchor_ranks
        if fast < pp or fast % pp:
            raise ConfigError(f"{world_size} processes cannot hold pp={pp} fast stages"
                              + (f" plus {z} anchor replica(s) of {pp} ranks" if z else "")
                              + f": the fast ranks ({fast}) must be a positive multiple of --pp")
        dp = args.dp or fast // pp
        if dp * pp != fast:
            raise ConfigError(f"--dp {dp} x --pp {pp} = {dp * pp} but {fast} fast ranks were launched "
                              f"({world_size} processes{f', {anchor_ranks} anchor ranks' if z else ''})")
    check_deepspeed_section(ds, pp, args.config)

    model_folder = resolve_model(args.model)
    spec = ModelSpec(model_folder)
    parts = spec.parts(pp, tc.partition)  # raises on more stages than layers
    if tc.lora.enabled:  # layers: embedding 0, decoders 1..L, then norm and head
        empty = [i for i in range(pp) if not (parts[i] <= spec.num_layers and parts[i + 1] > 1)]
        if empty:
            raise ConfigError(f"--lora-r / twocircuit.lora: stage {empty[0]} of --pp {pp} holds no decoder layer, "
                              "so it would have nothing to train; use fewer stages or "
                              "twocircuit.partition = 'type' (decoders spread evenly)")
    if tc.mode == "lowrank" and pp > 1:
        rank = sum(int(n) for n, _ in tc.codec.groups)
        if rank > spec.hidden:
            raise ConfigError(f"twocircuit.codec.groups: {rank} coefficients per token, but the boundary of "
                              f"--model {args.model} is {spec.hidden} wide; use at most {spec.hidden} "
                              f"(e.g. \"groups\": [[{spec.hidden}, 4]]) or a larger model")
    if args.seq_len < 2:
        raise ConfigError(f"--seq-len must be >= 2, got {args.seq_len}")
    if spec.max_positions and args.seq_len > spec.max_positions:
        raise ConfigError(f"--seq-len {args.seq_len} is above the model's limit "
                          f"(max_position_embeddings = {spec.max_positions})")
    window = getattr(spec.config, "sliding_window", None)
    if window and getattr(spec.config, "use_sliding_window", True) and args.seq_len > window:
        raise ConfigError(f"--seq-len {args.seq_len} exceeds the model's sliding window ({window}); "
                          "sliding-window attention across a pipeline is not supported")
    if args.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {args.steps}")
    if not args.peer_timeout > 0:
        raise ConfigError(f"--peer-timeout must be > 0 seconds, got {args.peer_timeout}")
    from .faults import FAULT_ENV, CheckpointPolicy, parse_fault
    ckpt_policy = CheckpointPolicy(args.save_interval, args.save_interval_minutes, args.keep_checkpoints)
    fault = parse_fault(os.environ.get(FAULT_ENV))

    docs = load_documents(args.data)
    train_docs, heldout_docs = split_documents(docs)
    data_fingerprint = docs.fingerprint
    if not train_docs:
        raise ConfigError(f"--data {args.data!r}: no training documents left after the held-out split")

    mb = _batch_setting(ds, "train_micro_batch_size_per_gpu", args.micro_batch_size, 2, args.config)
    gas = _batch_setting(ds, "gradient_accumulation_steps", args.grad_accum, 4, args.config)
    tbs = ds.get("train_batch_size", "auto")
    if tbs not in ("auto", None) and args.micro_batch_size is None and args.grad_accum is None \
            and tbs != mb * gas * dp:
        raise ConfigError(f"{args.config}: train_batch_size = {tbs} but train_micro_batch_size_per_gpu "
                          f"({mb}) x gradient_accumulation_steps ({gas}) x dp ({dp}) = {mb * gas * dp}; "
                          f"set it to \"auto\"")
    ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"] = mb, gas
    ds["train_batch_size"] = mb * gas * dp
    ds.setdefault("steps_per_print", 10 ** 9)
    ds.setdefault("wall_clock_breakdown", False)

    opt = ds.pop("optimizer", {"type": "AdamW", "params": {"lr": 1e-4}})
    otype = str(opt.get("type", "AdamW"))
    if otype.lower() not in OPTIMIZERS:
        raise ConfigError(f"{args.config}: optimizer.type = {otype!r}; allowed: "
                          f"{', '.join(sorted(OPTIMIZERS.values()))}")
    params = {k: v for k, v in (opt.get("params") or {}).items() if k not in ("torch_adam", "adam_w_mode")}
    if args.lr is not None:
        params["lr"] = args.lr
    optimizer = (OPTIMIZERS[otype.lower()], params)
    # what the DP backend cannot run with (its own rules, dp/<backend>.py)
    tc.dp.check_deepspeed(ds, pp=pp, where=args.config, tied_embeddings=tc.tied_embeddings,
                          model_tied=spec.tied)
    return Plan(args=args, config_name=config_name, tc=tc, ds_config=ds, pp=pp, dp=dp, z=z,
                anchor_ranks=anchor_ranks, model_folder=model_folder, spec=spec, parts=parts,
                train_docs=train_docs, heldout_docs=heldout_docs, data_fingerprint=data_fingerprint, mb=mb, gas=gas, optimizer=optimizer,
                ckpt_policy=ckpt_policy, fault=fault,
                output_dir=args.output_dir or os.path.join("runs", config_name))


# ------------------------------------------------------------------------------------------------

def _optimizer(plan, params):
    import torch
    name, kw = plan.optimizer
    cls = getattr(torch.optim, name)
    if name in ("Adam", "AdamW") and torch.cuda.is_available():
        kw = {**kw, "fused": True}
    return cls(params, **kw)


def _evaluate(engine, plan, seqs, masked: bool) -> tuple[float, float | None, int]:
    """(mean held-out loss, its standard error, sequences scored) over the first
    ``--eval-sequences`` held-out windows (at most the held-out set). Each ``eval_batch`` call
    scores one global batch (its loss is averaged over the DP replicas); the standard error is
    that of the mean of those batch losses."""
    import statistics

    import torch.distributed as dist
    from tqdm import tqdm

    from .data import MicroBatchStream
    per_call = plan.mb * plan.gas * plan.dp
    calls = max(1, min(plan.args.eval_sequences, len(seqs)) // per_call)
    it = MicroBatchStream(seqs, plan.mb, plan.gas, plan.dp, engine.dp_rank)
    bar = tqdm(range(calls), desc=f"held-out loss ({'through the codec' if masked else 'dense'}, "
               f"{calls * per_call} sequences)", unit="batch", leave=False, dynamic_ncols=True,
               disable=dist.is_initialized() and dist.get_rank() != 0)
    losses = [float(engine.eval_batch(it, dense=not masked)) for _ in bar]
    se = statistics.stdev(losses) / math.sqrt(len(losses)) if len(losses) > 1 else None
    return statistics.fmean(losses), se, calls * per_call


def _record_eval(evals: dict, key: str, result) -> int:
    """Store (loss, standard error) under ``key`` and ``key_se``; return the sequences scored."""
    evals[key], evals[key + "_se"], scored = result
    return scored


def log0(is_rank0: bool, msg: str) -> None:
    if is_rank0:
        from tqdm import tqdm
        tqdm.write(f"[ds_twocircuit] {msg}")   # above a running progress bar, not inside it
        sys.stdout.flush()


def _replicas_identical(engine, plan) -> bool | None:
    """Whether all DP replicas of every stage hold bitwise-identical weights (a digest per
    replica; no weights cross the wire)."""
    import torch
    import torch.distributed as dist
    from .adapters.dist import from_comm, group_agrees, to_comm, weights_digest
    if plan.dp == 1:
        return None
    same = group_agrees(weights_digest(engine.module.named_parameters()), engine.grid.get_data_parallel_group(),
                        plan.dp)
    flag = to_comm(torch.tensor([1.0 if same else 0.0]))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(from_comm(flag).item() == 1.0)


def _allreduce_wire(world, extra: dict | None = None):
    """Sum every rank's byte counters (all kinds, plus any ``extra`` per-rank counts) over the
    circuit's world, in one collective."""
    from . import wire
    totals = sum_over_ranks({**wire.totals(), **(extra or {})}, world)
    return {k: int(v) for k, v in totals.items()}


def sum_over_ranks(values: dict, world) -> dict:
    """Every rank's ``values`` (floats) summed over the circuit's world, in one collective."""
    import torch
    import torch.distributed as dist
    from .adapters.dist import from_comm, to_comm
    keys = sorted(values)
    vec = to_comm(torch.tensor([values[k] for k in keys], dtype=torch.float64))
    if world.size > 1:
        dist.all_reduce(vec)
    return dict(zip(keys, from_comm(vec).tolist()))


def run(argv=None) -> int:
    args = parse_args(argv)
    from .adapters.dist import launcher_env, prepare_runtime
    grank, gsize, _ = launcher_env()
    try:
        plan = make_plan(args, gsize)
    except ConfigError as e:
        if grank == 0 or os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr)
        return 2
    from .adapters.dist import CHILD_ENV, supervise
    anchor_role = args.anchor_only or grank >= gsize - plan.anchor_ranks
    if anchor_role and not os.environ.get(CHILD_ENV):
        return supervise(sys.argv[1:] if argv is None else list(argv))
    prepare_runtime()
    try:
        if args.pace_mbit is not None:
            pacing.configure(args.pace_mbit)
        from .adapters.dist import comm_backend
        if pacing.current() is not None and comm_backend() != "gloo":   # else from the environment
            raise ValueError(f"the software throttle (--pace-mbit / ${pacing.ENV}) paces gloo's sends "
                             f"from a thread; this run uses {comm_backend()}: cap real or emulated links "
                             "instead (launch/mesh.py), or run on CPU")
    except ValueError as e:  # a bad $DS_TWOCIRCUIT_PACE_MBIT, or NCCL
        if grank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    from .adapters.dist import init_world
    world = init_world(plan.anchor_ranks, timeout_s=plan.args.peer_timeout)
    progress = Progress()
    from .adapters.dist import shutdown_world
    try:
        if world.role == "anchor":
            from .adapters.anchor_circuit import run_anchor
            rc = run_anchor(plan, world)
        else:
            try:
                rc = run_fast(plan, world, progress)
            finally:
                if progress.census is not None:
                    progress.census.stop()
        shutdown_world()
        return rc
    except ConfigError as e:  # found after start-up (e.g. --resume): every rank finds the same
        if world.rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        shutdown_world()
        return 2
    except Exception as e:
        from .faults import lost_peer_reason
        reason = lost_peer_reason(e)
        if reason is None or world.role != "fast":
            raise
        _report_lost_peer(plan, world, reason, argv, progress)


def _report_lost_peer(plan, world, reason: str, argv, progress: Progress) -> None:
    """One line instead of a traceback wall: who stopped, where, what is saved, how to go on.
    Then leave at once (exit code 3): tearing down a process group with a dead peer can hang."""
    from .adapters.dist import census_store
    from .faults import EXIT_PEER_LOST, PeerCensus, newest_committed, resume_command
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # the launcher may be stopping us already
    dp = plan.dp

    def who(r):
        return f"rank {r} (stage {r // dp}, replica {r % dp})"
    try:
        store = census_store(world.store_prefix)
    except Exception:
        store = None
    missing = PeerCensus(store, world.rank, world.size).missing(min(5.0, plan.args.peer_timeout)) \
        if store is not None else None
    alive = sorted(set(range(world.size)) - set(missing or []))
    if missing and alive and alive[0] != world.rank:
        os._exit(EXIT_PEER_LOST)                     # the lowest surviving rank speaks for all
    step = progress.step_now                        # steps done when it stopped
    where = (progress.phase or f"at step {step}") if step is not None else "during start-up"
    if missing:
        lost = ", ".join(who(r) for r in missing) + " stopped or cannot be reached"
    elif missing is None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and world.global_rank:
        lost = f"{who(0)}, which hosts the launcher's store, stopped or cannot be reached"
    else:
        lost = "a peer stopped or cannot be reached"
    newest = newest_committed(os.path.join(plan.output_dir, "checkpoint"))
    saved = (f"Last committed checkpoint: {newest[1]} (step {newest[0]}"
             + (f"; {step - newest[0]} step(s) to redo)" if step is not None else ")")
             if newest else "No committed checkpoint yet (--save-interval / --save-interval-minutes)")
    cmd = resume_command(sys.argv[1:] if argv is None else list(argv))
    print(f"\n[ds_twocircuit] {who(world.rank)} stopped {where}: {lost} ({reason}). {saved}. "
          f"Resume: {cmd}", file=sys.stderr, flush=True)
    if store is not None and world.global_rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        time.sleep(min(5.0, plan.args.peer_timeout) + 1.0)   # this process hosts the store: let the
        #                                                      other survivors finish their census
    os._exit(EXIT_PEER_LOST)


def build_fast_engine(plan):
    """The local pipeline stage, its optimizer (spectral correction when the anchor is on), the
    MaskedPipelineEngine and its DP backend."""
    import torch
    from deepspeed.runtime.config import DeepSpeedConfig
    from .adapters.comm import dp_comm
    from .adapters.pipeline_engine import MaskedPipelineEngine
    from .dp.registry import get_backend
    from .adapters.pipe_module import build_pipeline

    tc = plan.tc
    torch.manual_seed(plan.args.seed)
    module = build_pipeline(plan.spec, plan.pp, tc.partition, tc.tied_embeddings, lora=tc.lora,
                            seed=plan.args.seed)
    trainable = [p for p in module.parameters() if p.requires_grad]
    optimizer = _optimizer(plan, trainable)
    if tc.anchor.enabled:
        from .adapters.anchor_circuit import attach_correction
        attach_correction(optimizer, module, plan)  # hooks on the optimizer the engine steps
    mpu = module.mpu()
    engine = MaskedPipelineEngine(args=None, model=module, optimizer=optimizer, model_parameters=trainable,
                                  mpu=mpu, config=copy.deepcopy(plan.ds_config),
                                  config_class=DeepSpeedConfig(copy.deepcopy(plan.ds_config), mpu))
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    dp_group = engine.grid.get_data_parallel_group()
    dp_backend = get_backend(tc.dp.backend)(named, dp_comm(dp_group, plan.dp), tc.dp)
    engine.pipeline_enable_backward_allreduce = False  # the backend does the DP sync
    engine.setup_twocircuit(tc, tc.mask_seed if tc.mask_seed is not None else plan.args.seed, dp_backend)
    return engine, dp_backend


def _open_metrics(path: str, start_step: int):
    """metrics.jsonl for appending from ``start_step``: records of steps a resumed run redoes
    (written after the checkpoint it resumes from) are dropped, so every step appears once."""
    kept = []
    if start_step > 0 and os.path.isfile(path):
        with open(path) as f:
            for line in f:
                try:
                    if json.loads(line)["step"] < start_step:
                        kept.append(line if line.endswith("\n") else line + "\n")
                except (ValueError, KeyError, TypeError):
                    break                       # a line cut short by the crash: the rest is redone
    f = open(path, "w")
    f.writelines(kept)
    f.flush()
    return f


class StepLog:
    """metrics.jsonl and the progress bar (rank 0), plus per-rank DP comm totals."""

    def __init__(self, plan, engine, link, is_rank0: bool, start_step: int):
        from tqdm import tqdm
        self.plan, self.engine, self.link, self.is_rank0 = plan, engine, link, is_rank0
        self.tokens_per_step = plan.mb * plan.gas * plan.dp * plan.args.seq_len
        self.losses: list[float] = []
        self.dp_comm = {"comm_s": 0.0, "hidden_comm_s": 0.0}
        self.f = _open_metrics(os.path.join(plan.output_dir, "metrics.jsonl"), start_step) if is_rank0 else None
        self.bar = tqdm(total=plan.args.steps, initial=start_step, unit="step", disable=not is_rank0,
                        desc=f"{plan.config_name} pp{plan.pp}xdp{plan.dp}", dynamic_ncols=True)

    def record(self, step, loss, dt, wire_delta, dp_s):
        self.losses.append(loss)
        for k in self.dp_comm:
            self.dp_comm[k] += float(self.engine.step_stats.get(k, 0.0))
        if not self.is_rank0:
            return
        rec = {"step": step, "loss": loss, "time": round(time.time(), 3),
               "tokens": self.tokens_per_step * (step + 1), "step_s": round(dt, 4),
               "tokens_per_s": round(self.tokens_per_step / dt, 2),
               "mask_rate": round(1.0 - self.engine.keep_fraction(step, self.plan.spec.hidden), 6),
               "lr": self.engine.get_lr()[0], "dp_s": round(dp_s, 5), "wire_bytes_rank0": wire_delta}
        rec.update({f"dp.{k}": v for k, v in self.engine.step_stats.items() if k != "step"})
        if self.link is not None:
            rec.update(self.link.step_stats())
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()
        self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{self.tokens_per_step / dt:.0f}")
        self.bar.update(1)

    def close(self):
        self.bar.close()
        if self.f is not None:
            self.f.close()


def run_fast(plan, world, progress: Progress | None = None) -> int:
    import torch
    from transformers import AutoTokenizer

    from . import wire
    from .data import MicroBatchStream, PackedSequences, heldout_sequences

    progress = progress if progress is not None else Progress()
    args, tc = plan.args, plan.tc
    is_rank0 = world.rank == 0
    out_dir = plan.output_dir
    if is_rank0:
        os.makedirs(out_dir, exist_ok=True)
    from .adapters.dist import census_store
    from .faults import PeerCensus
    try:
        progress.census = PeerCensus(census_store(world.store_prefix), world.rank, world.size).start_answering()
    except Exception as e:  # the launcher's store is not at MASTER_ADDR:MASTER_PORT: no census
        progress.census = None
        log0(is_rank0, f"no store census of peers after a fault ({type(e).__name__}: {e}); a fault "
                       "will be reported without naming the lost rank")
    engine, dp_backend = build_fast_engine(plan)

    tok = AutoTokenizer.from_pretrained(plan.model_folder)
    train_seqs = PackedSequences(plan.train_docs, tok, args.seq_len, seed=args.seed, name=f"--data {args.data}")
    held_seqs = heldout_sequences(plan.heldout_docs, tok, args.seq_len,
                                  name=f"--data {args.data} (held-out)") if plan.heldout_docs else None
    data_info = {"spec": args.data, "fingerprint": plan.data_fingerprint,
                 "documents": len(plan.train_docs) + len(plan.heldout_docs),
                 "train_documents": len(plan.train_docs), "heldout_documents": len(plan.heldout_docs),
                 "train_tokens": train_seqs.tokens, "heldout_tokens": held_seqs.tokens if held_seqs else 0}
    evaluate = held_seqs is not None and args.eval_sequences > 0

    ckpt_dir = os.path.join(out_dir, "checkpoint")
    start_step = 0
    resume = _agree_auto_resume(ckpt_dir, world) if args.resume == "auto" else args.resume
    if args.resume == "auto":
        log0(is_rank0, f"--resume auto: {'continuing from ' + resume if resume else 'no committed checkpoint in ' + ckpt_dir + ', starting fresh'}")
    if not resume:
        _set_aside_old_checkpoints(ckpt_dir, world)
    if resume:
        from .adapters.checkpoint import load_training_state
        start_step = load_training_state(engine, resume)
        if start_step >= args.steps:
            raise ConfigError(f"--resume: the checkpoint is at step {start_step}, nothing to do for "
                              f"--steps {args.steps}")
    link = None
    if tc.anchor.enabled:
        from .adapters.anchor_circuit import AnchorLink
        link = AnchorLink(engine, plan, world)
    stream = MicroBatchStream(train_seqs, plan.mb, plan.gas, plan.dp, engine.dp_rank, start_step=start_step)

    evals, scored = {}, 0
    if evaluate:
        scored = _record_eval(evals, "heldout_loss_first", _evaluate(engine, plan, held_seqs, masked=False))
        if tc.mode != "dense":
            _record_eval(evals, "heldout_loss_masked_first", _evaluate(engine, plan, held_seqs, masked=True))

    log = StepLog(plan, engine, link, is_rank0, start_step)
    policy = plan.ckpt_policy
    from .faults import Stopped, maybe_inject

    def on_sigterm(_sig, _frame):
        raise Stopped("stopped by the launcher (SIGTERM), most likely because another rank failed")
    signal.signal(signal.SIGTERM, on_sigterm)
    t_start = time.perf_counter()
    for step in range(start_step, args.steps):
        progress.step_now, progress.phase = step, None
        maybe_inject(plan.fault, "kill", world.rank, step)
        maybe_inject(plan.fault, "stop", world.rank, step)
        t0 = time.perf_counter()
        before, dp_before = wire.totals(), engine.timing["dp_s"]
        if link is not None:
            link.maybe_publish(step)
            link.poll(step)
        loss = float(engine.train_batch(stream))
        if not math.isfinite(loss):
            raise FloatingPointError(f"step {step}: training loss is {loss}")
        after = wire.totals()
        dt = time.perf_counter() - t0
        log.record(step, loss, dt, {k: after[k] - before[k] for k in after if after[k] != before[k]},
                   engine.timing["dp_s"] - dp_before)
        if policy.needs_calibration and step == start_step + 1:   # the first step carries warm-up
            slowest = _max_over_ranks(dt)
            every = policy.calibrate(slowest)
            log0(is_rank0, f"checkpointing every {every} steps (~{policy.every_minutes:g} min at "
                           f"{slowest:.1f} s/step) to {ckpt_dir}, keeping {policy.keep}")
        progress.step_now = step + 1
        if policy.due(step + 1, args.steps):
            _checkpoint(engine, plan, ckpt_dir, progress)
    log.close()
    wall = time.perf_counter() - t_start

    if args.save_checkpoint or args.save_interval:
        # before the final DP flush: a run resumed from here continues exactly like this one would
        _checkpoint(engine, plan, ckpt_dir, progress)
    progress.phase = "after the last step (final sync, evaluation or saving the model)"
    dp_before_final = wire.totals()["dp"]
    if dp_backend.finalize():  # finish in-flight DiLoCo syncs; average the drifted fragments once
        log0(is_rank0, f"{tc.dp.backend}: in-flight syncs finished and drifted weights averaged "
                       "once (the saved model is the replicas' average)")
    dp_final_local = wire.totals()["dp"] - dp_before_final
    replicas_identical = _replicas_identical(engine, plan)
    anchor_stats = link.finish() if link is not None else None
    if evaluate:
        scored = _record_eval(evals, "heldout_loss", _evaluate(engine, plan, held_seqs, masked=False))
        if tc.mode != "dense":
            _record_eval(evals, "heldout_loss_masked", _evaluate(engine, plan, held_seqs, masked=True))

    # start-up: what this rank received from its DP group's first replica (one-off, outside our
    # counters; nothing when the replicas loaded the same weights, see MaskedPipelineEngine)
    dp_init_local = engine.start_broadcast_bytes
    first_replica = engine.grid.get_data_parallel_id() == 0
    counts = {"dp_final_sync": dp_final_local, "dp_init": dp_init_local,
              "trainable": sum(p.numel() for p in engine.module.parameters() if p.requires_grad) if first_replica else 0,
              "parameters": sum(p.numel() for p in engine.module.parameters()) if first_replica else 0}
    hf_dir = None
    if not args.no_save_model:   # each stage writes its own shard: no weight crosses a link
        from .adapters.export import export_hf_folder
        hf_dir = export_hf_folder(engine, plan, world, os.path.join(out_dir, "hf"))
    totals = _allreduce_wire(world, counts)
    dp_final_bytes = totals.pop("dp_final_sync")
    dp_init_bytes = totals.pop("dp_init")
    params = {"trainable": totals.pop("trainable"), "total": totals.pop("parameters")}
    timing = {k: float(v) for k, v in engine.timing.items()}
    timing.update({f"dp_{k}": v for k, v in log.dp_comm.items()})
    timing = sum_over_ranks(timing, world)
    if is_rank0:
        summary = _summary(plan, engine, log, totals, timing, evals, wall, start_step, replicas_identical,
                           anchor_stats, dp_final_bytes, dp_init_bytes)
        summary["data"] = {**data_info, "heldout_scored_tokens": scored * args.seq_len}
        summary["parameters"] = params  # (LoRA: the adapters train, and only they cross the DP link)
        if hf_dir is not None:
            summary["hf_folder"] = hf_dir
        with open(os.path.join(out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print_summary(summary, out_dir)
    if progress.census is not None:
        progress.census.stop()          # before the last barrier: no store request after it
    torch.distributed.barrier()
    return 0


def _max_over_ranks(x: float) -> float:
    """The largest ``x`` over the fast circuit's ranks (one float64 all-reduce): every rank then
    takes the same decision."""
    import torch
    import torch.distributed as dist
    from .adapters.dist import from_comm, to_comm
    t = to_comm(torch.tensor([x], dtype=torch.float64))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(from_comm(t)[0])


def _agree_auto_resume(ckpt_dir: str, world) -> str | None:
    """``--resume auto``: the newest committed checkpoint any rank sees (the commit marker is
    written by rank 0; without a shared filesystem only rank 0's node has it)."""
    from .faults import newest_committed
    newest = newest_committed(ckpt_dir)
    step = int(_max_over_ranks(float(newest[0]) if newest else -1.0))
    return os.path.join(ckpt_dir, f"global_step{step}") if step >= 0 else None


def _set_aside_old_checkpoints(ckpt_dir: str, world) -> None:
    """A fresh run must never be resumed from an earlier run's checkpoints in the same folder:
    they are moved (not deleted) to ``<output_dir>/checkpoint.previous``. Rank 0 first, then the
    first rank of every other node (whose disk may not be shared; on a shared one there is nothing
    left to do by then)."""
    import torch.distributed as dist
    from .faults import committed_checkpoints

    def set_aside():
        if not os.path.isdir(ckpt_dir):
            return
        old = ckpt_dir + ".previous"
        try:
            if committed_checkpoints(ckpt_dir):
                shutil.rmtree(old, ignore_errors=True)
                os.replace(ckpt_dir, old)
                log0(True, f"a fresh run: the earlier checkpoints in {ckpt_dir} were moved to {old}")
            else:
                shutil.rmtree(ckpt_dir, ignore_errors=True)   # only uncommitted leftovers
        except OSError as e:
            raise ConfigError(f"{ckpt_dir}: cannot set the earlier checkpoints aside ({e}); move them "
                              "yourself or pass --resume auto to continue from them") from e
    if world.rank == 0:
        set_aside()
    dist.barrier()
    if world.rank != 0 and os.environ.get("LOCAL_RANK", "0") == "0":
        set_aside()
    dist.barrier()


def _checkpoint(engine, plan, ckpt_dir: str, progress: Progress) -> None:
    """Write and commit a checkpoint, then prune to the newest ``--keep-checkpoints``."""
    from .adapters.checkpoint import save_training_state
    from .faults import committed_checkpoints, prune
    progress.phase = f"while writing the checkpoint of step {engine.global_steps}"
    save_training_state(engine, ckpt_dir, plan.fault)
    progress.phase = None
    progress.committed_steps.append(engine.global_steps)
    if os.environ.get("LOCAL_RANK", "0") == "0":       # one pruner per node (shared or local disk)
        seen = {s for s, _ in committed_checkpoints(ckpt_dir)} | set(progress.committed_steps)
        prune(ckpt_dir, plan.ckpt_policy.keep, sorted(seen))


def _summary(plan, engine, log, totals, timing, evals, wall, start_step, replicas_identical, anchor_stats,
             dp_final_bytes=0, dp_init_bytes=0):
    from . import wire
    args, tc = plan.args, plan.tc
    steps_run = args.steps - start_step
    tokens = log.tokens_per_step * steps_run
    wire_bytes = {k: totals[k] for k in ("pp_activations", "pp_gradients", "pp_codec_state", "pp_handshake",
                                          "pp_tied", "dp", "anchor", "export")}
    return {
        "config": {"file": args.config, "twocircuit": tc.to_dict(), "model": args.model,
                   "model_folder": plan.model_folder, "data": args.data, "seq_len": args.seq_len,
                   "micro_batch_size": plan.mb, "gradient_accumulation_steps": plan.gas,
                   "optimizer": {"type": plan.optimizer[0], **plan.optimizer[1]}, "seed": args.seed,
                   "mask_seed": engine.mask_seed},
        "pace_mbit": pacing.current().mbit if pacing.current() is not None else None,
        "steps": steps_run, "first_step": start_step, "tokens": tokens, "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 3),
        "loss_first": log.losses[0], "loss_last": log.losses[-1],
        "mesh": {"dp": plan.dp, "pp": plan.pp, "anchor_replicas": plan.z, "parts": plan.parts},
        "dp_backend": tc.dp.backend,
        "dp_replicas_identical": replicas_identical,
        # included in wire_bytes.dp: the end-of-run sync that makes the replicas agree (DiLoCo)
        "dp_final_sync_bytes": dp_final_bytes,
        # not in wire_bytes.dp: DeepSpeed's start-up broadcast of the weights to the other replicas
        "dp_init_broadcast_bytes": dp_init_bytes,
        "dp_comm_s_all_ranks": {"total": round(timing["dp_comm_s"], 3), "hidden": round(timing["dp_hidden_comm_s"], 3)},
        "anchor": anchor_stats,
        "mask_rate": tc.effective_mask_rate,
        "codec": ({"mode": tc.mode, "rank": engine.codec_out.rank, "bytes_per_token": engine.codec_out.bytes_per_token()}
                  if tc.mode == "lowrank" else {"mode": tc.mode}),
        "kept_channels": (plan.spec.hidden if tc.mode in ("dense", "lowrank")
                          else engine.schedule_p.keep(engine.global_steps - 1, plan.spec.hidden)),
        "hidden_size": plan.spec.hidden,
        "wire_bytes": wire_bytes,
        "bytes_per_token": round(sum(wire_bytes[k] for k in wire.TRAINING_KINDS) / tokens, 3),
        "eval_wire_bytes": totals["pp_eval"],
        "timing_s_all_ranks": {k: round(v, 3) for k, v in timing.items()},
        **{k: (round(v, 5) if v is not None else None) for k, v in evals.items()},
    }


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000.0
    return str(n)


def print_summary(s: dict, out_dir: str) -> None:
    wb = s["wire_bytes"]
    lines = [
        "",
        f"== ds-twocircuit: {os.path.basename(s['config']['file'])} on {s['config']['model']} "
        f"(pp={s['mesh']['pp']} x dp={s['mesh']['dp']}"
        + (f", anchor Z={s['mesh']['anchor_replicas']}" if s['mesh']['anchor_replicas'] else "") + ")",
        f"steps {s['steps']}, tokens {s['tokens']:,}, wall {s['wall_s']:.1f} s, {s['tokens_per_s']:.1f} tokens/s",
        f"train loss {s['loss_first']:.4f} -> {s['loss_last']:.4f}",
    ]
    if "heldout_loss" in s:
        se = f" (standard error {s['heldout_loss_se']:.4f})" if s.get("heldout_loss_se") else ""
        ho = f"held-out loss (dense inference) {s.get('heldout_loss_first', float('nan')):.4f} -> {s['heldout_loss']:.4f}{se}"
        if "heldout_loss_masked" in s:
            ho += f"; through the codec {s.get('heldout_loss_masked_first', float('nan')):.4f} -> {s['heldout_loss_masked']:.4f}"
        lines.append(ho)
    if "data" in s:
        d = s["data"]
        lines.append(f"data {d['spec']}: {d['train_tokens']:,} training tokens in {d['train_documents']} documents; "
                     f"held-out {d['heldout_scored_tokens']:,} tokens scored of {d['heldout_tokens']:,}; "
                     f"fingerprint {d['fingerprint'][:16]}")
    codec = s.get("codec") or {}
    lines += [
        (f"codec lowrank: rank {codec['rank']}, {codec['bytes_per_token']} bytes per token each way "
         f"(mean and basis shipped on refresh, counted as pp_codec_state)" if codec.get("mode") == "lowrank" else
         f"mask rate {s['mask_rate']} ({s['kept_channels']} of {s['hidden_size']} channels kept per token), "
         f"mode {s['config']['twocircuit']['mode']}"),
        "wire bytes: " + ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in wb.items()),
        f"bytes per token: {s['bytes_per_token']:.1f}",
        f"outputs: {out_dir}/summary.json, {out_dir}/metrics.jsonl"
        + (f", {s['hf_folder']} ("
           + ("PEFT adapter folder" if s["config"]["twocircuit"]["lora"]["r"] else "Hugging Face folder") + ")"
           if "hf_folder" in s else ""),
    ]
    print("\n".join(lines), flush=True)


def main() -> None:
    sys.exit(run())
