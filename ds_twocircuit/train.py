"""The training entry point behind ``launch/train.py``: flags, config, plan, world.

Validate everything (no process group yet: a bad flag or config fails identically on every rank)
-> start the circuit's world -> build the engine -> the :class:`~ds_twocircuit.trainer.Trainer`
runs it (data, evaluation, steps, checkpoints, summary, export). ``--engine pipeline`` (the default)
is DeepSpeed's pipeline, one process per stage and replica; ``--engine reference`` runs the same
config in one process (the whole model, the same codec objects at the same boundaries, DP replicas
and the anchor simulated in-process), which is what the quality studies run. A peer lost during
training ends in a one-line diagnosis (who, where, what is saved, how to resume).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
from dataclasses import dataclass
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
    p.add_argument("--lr", type=float, default=None, help="override the optimizer's lr (a DiLoCo sync's twocircuit.dp.inner_lr_scale multiplies it too)")
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
                        "(--max-restarts) 'auto' is implied. A resumed run reuses its folder's held-out "
                        "score of step 0 (on the same windows) instead of scoring again, and summary.json's "
                        "'run' counts the whole run's tokens and bytes since step 0")
    p.add_argument("--peer-timeout", type=float, default=300.0,
                   help="seconds a rank waits for a silent peer (hung process, black-holed link) before "
                        "it stops with a diagnosis (default 300)")
    p.add_argument("--pace-mbit", type=float, default=None,
                   help="software throttle: pace this run's pipeline and DP sends as if every link ran at "
                        "this rate (Mbit/s each direction), for hosts where launch/mesh.py cannot create "
                        "network namespaces; default: $DS_TWOCIRCUIT_PACE_MBIT, else no pacing")
    p.add_argument("--no-save-model", action="store_true", help="skip writing <output_dir>/hf")
    p.add_argument("--engine", choices=("pipeline", "reference"), default="pipeline",
                   help="pipeline (default): DeepSpeed's pipeline, one process per stage and replica; "
                        "reference: the same config in one process (the whole model, the codec at the "
                        "--pp stage boundaries, --dp replicas and the anchor simulated; for studies)")
    p.add_argument("--device", default="cpu",
                   help="--engine reference only: where its one process computes, cpu (default) or cuda[:N] "
                        "(the pipeline engine computes on the accelerator DeepSpeed's launcher assigns)")
    p.add_argument("--eval-every", type=int, default=0,
                   help="also score the held-out windows every N steps (summary.json heldout_curve; 0: "
                        "start and end only)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of the config file: a dotted path and a JSON value, e.g. "
                        "--set twocircuit.codec.groups=[[112,4]] --set optimizer.params.lr=3e-4 (repeatable)")
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

# DeepSpeed's schedulers and the absolute learning rates among their params (the others are
# ratios of the optimizer's lr, or steps); {key: DeepSpeed's default, None: no default}
SCHEDULER_LRS = {"WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None},
                 "WarmupDecayLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None},
                 "OneCycle": {"cycle_min_lr": None, "cycle_max_lr": None},
                 "LRRangeTest": {"lr_range_test_min_lr": None},
                 "WarmupCosineLR": {}}


def scale_scheduler_lrs(scheduler: dict, factor: float, where: str) -> dict:
    """``scheduler`` (the DeepSpeed section) with its absolute learning rates times ``factor``
    (``twocircuit.dp.inner_lr_scale``), so that the schedule sets the scaled lrs; a lr left to
    DeepSpeed's default must be written out, as the default would not be scaled."""
    import copy
    if not isinstance(scheduler, dict) or scheduler.get("type") not in SCHEDULER_LRS:
        got = scheduler.get("type") if isinstance(scheduler, dict) else scheduler
        raise ConfigError(f"{where}: scheduler.type = {got!r} with twocircuit.dp.inner_lr_scale: the scale "
                          f"applies to DeepSpeed's schedulers {', '.join(sorted(SCHEDULER_LRS))}")
    out = copy.deepcopy(scheduler)
    params = out.setdefault("params", {})
    for name, default in SCHEDULER_LRS[out["type"]].items():
        if name not in params and default is None:
            raise ConfigError(f"{where}: scheduler.params.{name} is not set; with twocircuit.dp.inner_lr_scale "
                              "write it out (DeepSpeed's default would not be scaled)")
        v = params.get(name, default)
        vals = v if isinstance(v, list) else [v]
        if any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in vals):
            raise ConfigError(f"{where}: scheduler.params.{name} must be a number or a list of numbers, got {v!r}")
        scaled = [float(x) * factor for x in vals]
        params[name] = scaled if isinstance(v, list) else scaled[0]
    return out


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
    spare_ranks: int = 0                # ranks left over after an elastic regroup (adapters.dist.sit_out)


def _batch_setting(ds: dict, key: str, flag_value, default: int, path: str) -> int:
    v = flag_value if flag_value is not None else ds.get(key, default)
    if v == "auto" or v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"{path}: {key} must be a positive integer, got {v!r}")
    return v


def _check_device(name: str) -> None:
    import torch
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r}: not a device; use cpu or cuda[:N]") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {name!r}: the reference engine computes on cpu or cuda[:N]")
    if dev.type == "cuda" and (not torch.cuda.is_available()
                               or (dev.index or 0) >= torch.cuda.device_count()):
        raise ConfigError(f"--device {name!r}: no such CUDA device here "
                          f"({torch.cuda.device_count() if torch.cuda.is_available() else 0} visible)")


def make_plan(args, world_size: int) -> Plan:
    from .data import load_documents, split_documents
    from .models.layers import ModelSpec
    from .models.presets import resolve_model

    from .config import apply_overrides
    args.config = resolve_config(args.config)
    from .adapters.dsconfig import deepspeed_knows
    ds = apply_overrides(load_ds_config(args.config), getattr(args, "overrides", []) or [], known=deepspeed_knows)
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
    reference = getattr(args, "engine", "pipeline") == "reference"
    if reference and world_size != 1:
        raise ConfigError(f"--engine reference runs in one process, but {world_size} were launched; start it "
                          "with python launch/train.py (--pp and --dp say what it simulates)")
    pp = args.pp or (2 if world_size >= 2 or reference else 1)
    spare_ranks = 0
    if reference:
        if args.anchor_only or args.anchor_replicas:
            raise ConfigError("--engine reference runs the anchor in-process: drop --anchor-only / --anchor-replicas")
        z, anchor_ranks, dp = 0, 0, args.dp or 1
        if dp < 1:
            raise ConfigError(f"--dp must be >= 1, got {dp}")
        _check_device(getattr(args, "device", "cpu"))
    elif getattr(args, "device", "cpu") != "cpu":
        raise ConfigError(f"--device {args.device}: only --engine reference takes a device; the pipeline engine "
                          "computes on the accelerator DeepSpeed's launcher assigns each rank")
    elif args.anchor_only:
        if world_size % pp:
            raise ConfigError(f"--anchor-only: {world_size} processes are not a multiple of --pp {pp}")
        z, anchor_ranks, dp = world_size // pp, world_size, args.dp or 1
    else:
        anchor_ranks = z * pp
        fast = world_size - anchor_ranks
        if fast > pp and fast % pp and not z and args.dp is None and os.environ.get("TORCHELASTIC_RUN_ID"):
            # torchrun regrouped on ranks that do not fill whole pipelines (a node lost a stage):
            # the replicas that are whole go on, the ranks left over sit out until the next regroup
            spare_ranks = fast % pp
            fast -= spare_ranks
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
    if pp > 1:
        from .codecs import get_codec
        get_codec(tc.mode).check_model(tc.codec, spec.hidden, f"--model {args.model}")
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
    if getattr(args, "eval_every", 0) < 0:
        raise ConfigError(f"--eval-every must be >= 0 (0: start and end only), got {args.eval_every}")
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
    if not isinstance(opt, dict) or set(opt) - {"type", "params"}:
        extra = sorted(set(opt) - {"type", "params"}) if isinstance(opt, dict) else opt
        raise ConfigError(f"{args.config}: optimizer has {extra!r}; allowed keys under optimizer: params, type")
    params = {k: v for k, v in (opt.get("params") or {}).items() if k not in ("torch_adam", "adam_w_mode")}
    if args.lr is not None:
        params["lr"] = args.lr
    import inspect
    import torch
    accepted = set(inspect.signature(getattr(torch.optim, OPTIMIZERS[otype.lower()])).parameters) - {"params"}
    unknown = sorted(set(params) - accepted)
    if unknown:   # a typo (e.g. from --set) would otherwise surface as a TypeError on every rank
        raise ConfigError(f"{args.config}: optimizer.params.{unknown[0]} is not an argument of "
                          f"torch.optim.{OPTIMIZERS[otype.lower()]}; allowed: {', '.join(sorted(accepted))}")
    factor = tc.dp.inner_lr_factor(dp)   # twocircuit.dp.inner_lr_scale (DiLoCo), 1 otherwise
    if factor != 1.0:
        default = inspect.signature(getattr(torch.optim, OPTIMIZERS[otype.lower()])).parameters["lr"].default
        lr = params.get("lr", default)      # torch's default lr is scaled too
        if isinstance(lr, bool) or not isinstance(lr, (int, float)):
            raise ConfigError(f"{args.config}: optimizer.params.lr must be a number with "
                              f"twocircuit.dp.inner_lr_scale, got {lr!r}")
        params["lr"] = float(lr) * factor
        if ds.get("scheduler"):
            ds["scheduler"] = scale_scheduler_lrs(ds["scheduler"], factor, args.config)
    optimizer = (OPTIMIZERS[otype.lower()], params)
    # what the DP backend cannot run with (its own rules, dp/<backend>.py)
    tc.dp.check_deepspeed(ds, pp=pp, where=args.config, tied_embeddings=tc.tied_embeddings,
                          model_tied=spec.tied)
    return Plan(args=args, config_name=config_name, tc=tc, ds_config=ds, pp=pp, dp=dp, z=z,
                anchor_ranks=anchor_ranks, model_folder=model_folder, spec=spec, parts=parts,
                train_docs=train_docs, heldout_docs=heldout_docs, data_fingerprint=data_fingerprint, mb=mb, gas=gas, optimizer=optimizer,
                ckpt_policy=ckpt_policy, fault=fault,
                output_dir=args.output_dir or os.path.join("runs", config_name),
                spare_ranks=spare_ranks)


# ------------------------------------------------------------------------------------------------

def run(argv=None) -> int:
    args = parse_args(argv)
    if args.engine == "reference":
        return run_reference(args)
    from .adapters.dist import launcher_env, prepare_runtime
    grank, gsize, _ = launcher_env()
    try:
        plan = make_plan(args, gsize)
    except ConfigError as e:
        if grank == 0 or os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr)
        return 2
    if plan.spare_ranks and grank >= gsize - plan.spare_ranks:
        from .adapters.dist import sit_out
        return sit_out(grank, gsize, plan.dp, plan.pp, plan.args.peer_timeout)
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
    world = init_world(plan.anchor_ranks, timeout_s=plan.args.peer_timeout, spare_ranks=plan.spare_ranks)
    from .trainer import Progress
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
        _release_spares(plan, world, rc)
        shutdown_world()
        return rc
    except ConfigError as e:  # found after start-up (e.g. --resume): every rank finds the same
        if world.rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        _release_spares(plan, world, 2)
        shutdown_world()
        return 2
    except Exception as e:
        from .faults import lost_peer_reason
        reason = lost_peer_reason(e)
        if reason is None or world.role != "fast":
            raise
        _report_lost_peer(plan, world, reason, argv, progress)


def _release_spares(plan, world, rc: int) -> None:
    if plan.spare_ranks and world.role == "fast" and world.rank == 0:
        from .adapters.dist import release_spares
        release_spares(rc)


def run_reference(args) -> int:
    """``--engine reference``: the Trainer on the single-process reference engine."""
    from . import wire
    from .engines.reference import ReferenceEngine
    from .trainer import Trainer
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        plan = make_plan(args, world_size)
        if args.pace_mbit:
            raise ConfigError("--pace-mbit paces real links; --engine reference has none")
        wire.reset()            # a study may run several in one process: each counts its own bytes
        Trainer(plan, ReferenceEngine(plan)).run()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def run_fast(plan, world, progress=None) -> int:
    """The fast circuit on this rank: the Trainer over the DeepSpeed pipeline engine."""
    import torch
    from .adapters.engine import PipelineEngine
    from .faults import PeerCensus
    from .trainer import Progress, Trainer, log0
    from .adapters.dist import census_store
    progress = progress if progress is not None else Progress()
    try:
        progress.census = PeerCensus(census_store(world.store_prefix), world.rank, world.size).start_answering()
    except Exception as e:  # the launcher's store is not at MASTER_ADDR:MASTER_PORT: no census
        progress.census = None
        log0(world.rank == 0, f"no store census of peers after a fault ({type(e).__name__}: {e}); a fault "
                              "will be reported without naming the lost rank")
    Trainer(plan, PipelineEngine(plan), world, progress).run()
    if progress.census is not None:
        progress.census.stop()          # before the last barrier: no store request after it
    torch.distributed.barrier()
    return 0


def _report_lost_peer(plan, world, reason: str, argv, progress) -> None:
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
    shrink = ""
    if dp > 1 and newest:   # a node that stays gone: go on with the replicas that are left
        shrink = (f" Should the node stay gone, resume the {dp - 1} replica(s) left with --dp {dp - 1} (the "
                  "replicas' state is merged; pipeline stages are not elastic: a replica that lost a stage "
                  "drops out as a whole).")
    print(f"\n[ds_twocircuit] {who(world.rank)} stopped {where}: {lost} ({reason}). {saved}.{shrink} "
          f"Resume: {cmd}", file=sys.stderr, flush=True)
    if store is not None and world.global_rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        time.sleep(min(5.0, plan.args.peer_timeout) + 1.0)   # this process hosts the store: let the
        #                                                      other survivors finish their census
    os._exit(EXIT_PEER_LOST)


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":   # the anchor rank's supervisor starts its worker as python -m ds_twocircuit.train
    main()
