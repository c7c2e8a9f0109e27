"""The one training loop: a :class:`Trainer` over an engine.

Phases, in order (``Trainer.run``)::

    data        tokenise the corpus once; the training stream and the held-out windows
    resume      --resume: the engine restores its checkpoint (a fresh run sets old ones aside)
    evaluate    held-out loss at the start, dense and through the codec
    train       per step: anchor publish/poll -> engine.train_batch -> metrics.jsonl -> checkpoint
                (and a held-out point every --eval-every steps)
    finish      final DP sync, replica check, anchor statistics, held-out loss at the end
    export      the adapted model as a Hugging Face folder (what crosses a link for it is counted)
    summarise   every rank's byte counters summed; summary.json and the printed summary

Two engines implement what the loop asks of them (``ds_twocircuit.engines``): the DeepSpeed pipeline
(one process per stage and replica, what ``launch/train.py`` runs) and the single-process reference
(the whole model in one process, the same codec objects at the same boundaries, DP replicas and the
anchor simulated in-process; what the quality studies run). The loop, the data, the evaluation, the
byte accounting and the summary are the same code for both.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from . import pacing, wire
from .configkit import ConfigError


# ------------------------------------------------------------------------------------------ world
@dataclass
class LocalWorld:
    """The world of the single-process reference engine: one rank, no process group. The pipeline's
    world (``adapters.dist.World``) has the same three collectives over its ranks."""
    role: str = "fast"
    rank: int = 0
    size: int = 1
    global_rank: int = 0
    global_size: int = 1
    local_rank: int = 0
    backend: str = "none"
    store_prefix: str = ""

    def sum(self, values: dict) -> dict:
        return {k: float(values[k]) for k in sorted(values)}

    def max(self, x: float) -> float:
        return float(x)

    def barrier(self) -> None:
        pass


def log0(is_rank0: bool, msg: str) -> None:
    if is_rank0:
        from tqdm import tqdm
        tqdm.write(f"[ds_twocircuit] {msg}")   # above a running progress bar, not inside it
        sys.stdout.flush()


@dataclass
class Progress:
    """What changes while the fast circuit trains (for the lost-peer report and checkpoints)."""
    census: Any = None                  # faults.PeerCensus answering on the launcher's store
    step_now: int | None = None         # steps done so far
    phase: str | None = None            # what the run was doing, when not a training step
    committed_steps: list = field(default_factory=list)


# ------------------------------------------------------------------------------------------ metrics
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
    from .files import atomic_write_text
    atomic_write_text(path, "".join(kept))   # a crash now cannot lose the steps already recorded
    return open(path, "a")


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
               "lr": self.engine.lr(), "dp_s": round(dp_s, 5), "wire_bytes_rank0": wire_delta}
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


# ------------------------------------------------------------------------------------------ checkpoints
class CheckpointManager:
    """Committed checkpoints in ``<output_dir>/checkpoint``: the engine writes the state, this class
    decides when (``faults.CheckpointPolicy``), agrees on what to resume from, prunes to the newest
    ``--keep-checkpoints`` and never lets a fresh run resume from an earlier run's files."""

    def __init__(self, plan, engine, world, progress: Progress):
        self.plan, self.engine, self.world, self.progress = plan, engine, world, progress
        self.dir = os.path.join(plan.output_dir, "checkpoint")
        self.policy = plan.ckpt_policy

    def resume_path(self) -> str | None:
        """The checkpoint ``--resume`` names (``auto``: the newest committed one any rank sees)."""
        args = self.plan.args
        if args.resume != "auto":
            return args.resume
        from .faults import newest_committed
        newest = newest_committed(self.dir)
        step = int(self.world.max(float(newest[0]) if newest else -1.0))
        path = os.path.join(self.dir, f"global_step{step}") if step >= 0 else None
        log0(self.world.rank == 0, f"--resume auto: {'continuing from ' + path if path else 'no committed checkpoint in ' + self.dir + ', starting fresh'}")
        if path is not None:   # a node without the shared folder fetches what it lacks from its peers
            self.engine.catch_up(self.dir, step, self.world)
        return path

    def set_aside_old(self) -> None:
        """A fresh run must never be resumed from an earlier run's checkpoints in the same folder:
        they are moved (not deleted) to ``<output_dir>/checkpoint.previous``. Rank 0 first, then the
        first rank of every other node (whose disk may not be shared; on a shared one there is
        nothing left to do by then)."""
        from .faults import committed_checkpoints
        ckpt_dir = self.dir

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
        if self.world.rank == 0:
            set_aside()
        self.world.barrier()
        if self.world.rank != 0 and os.environ.get("LOCAL_RANK", "0") == "0":
            set_aside()
        self.world.barrier()

    def save(self, run: "RunTotals | None" = None, launch_tokens: int = 0) -> None:
        """Write and commit a checkpoint (with the whole run's traffic so far, ``run_totals.json``),
        then prune to the newest ``--keep-checkpoints``."""
        from .faults import committed_checkpoints, prune
        self.progress.phase = f"while writing the checkpoint of step {self.engine.global_steps}"
        tag = self.engine.save_checkpoint(self.dir, self.plan.fault)
        if run is not None:
            run.write(tag, self.engine.global_steps, launch_tokens, wire.totals())
        self.progress.phase = None
        self.progress.committed_steps.append(self.engine.global_steps)
        if os.environ.get("LOCAL_RANK", "0") == "0":       # one pruner per node (shared or local disk)
            seen = {s for s, _ in committed_checkpoints(self.dir)} | set(self.progress.committed_steps)
            prune(self.dir, self.policy.keep, sorted(seen))


class RunTotals:
    """The whole run's tokens and traffic across resumes. Each checkpoint carries the mesh's totals up
    to its step (``run_totals.json`` in its folder, written by rank 0 after summing every rank's
    counters); a resumed launch adds its own, so ``summary.json``'s ``run`` counts every byte since
    step 0 while ``wire_bytes`` and ``tokens`` stay this launch's. Unknown (``None``) for a resume
    from a checkpoint without the file (written before it existed, or lost with its node)."""

    FILE = "run_totals.json"

    def __init__(self, world):
        self.world = world
        self.prior = {"steps": 0, "tokens": 0, "wire_bytes": {}}   # what the launches before this one did
        self.known = True

    def load(self, resume: str, start_step: int) -> None:
        """Rank 0 reads the resumed checkpoint's totals (a tag folder, or the checkpoint folder)."""
        if self.world.rank != 0:
            return
        for path in (os.path.join(resume, self.FILE), os.path.join(resume, f"global_step{start_step}", self.FILE)):
            if os.path.isfile(path):
                with open(path) as f:
                    prior = json.load(f)
                if prior.get("steps") == start_step:
                    self.prior = prior
                    return
        self.known = False

    def _add(self, steps: int, launch_tokens: int, mesh: dict) -> dict:
        wb = {k: int(self.prior["wire_bytes"].get(k, 0)) + int(mesh.get(k, 0)) for k in wire.KINDS}
        return {"steps": steps, "tokens": int(self.prior["tokens"]) + int(launch_tokens), "wire_bytes": wb}

    def write(self, tag: str, steps: int, launch_tokens: int, local: dict) -> None:
        """At a checkpoint (every rank: the counters are summed over the mesh)."""
        mesh = self.world.sum(local)
        if self.world.rank == 0 and self.known:
            from .files import atomic_write_text
            atomic_write_text(os.path.join(tag, self.FILE), json.dumps(self._add(steps, launch_tokens, mesh)))

    def summary(self, steps: int, launch_tokens: int, mesh: dict) -> dict | None:
        """``summary.json``'s ``run``: the whole run's tokens, bytes by kind and training bytes per token."""
        if not self.known:
            return None
        run = self._add(steps, launch_tokens, mesh)
        run["wire_bytes"].pop("pp_eval")
        run["bytes_per_token"] = round(sum(run["wire_bytes"][k] for k in wire.TRAINING_KINDS) / max(run["tokens"], 1), 3)
        return run


# ------------------------------------------------------------------------------------------ the trainer
class Trainer:
    """Drives one engine through the phases of the module docstring. ``world``: the circuit's world
    (``adapters.dist.World``, or :class:`LocalWorld` for the reference engine)."""

    def __init__(self, plan, engine, world=None, progress: Progress | None = None):
        self.plan, self.engine = plan, engine
        self.world = world if world is not None else LocalWorld()
        self.progress = progress if progress is not None else Progress()
        self.is_rank0 = self.world.rank == 0
        self.args, self.tc = plan.args, plan.tc
        self.evals: dict = {}
        self.curve: list[dict] = []    # held-out points: step, loss, se (and through the codec)
        self.scored = 0

    # -------------------------------------------------------------- data
    def setup_data(self) -> None:
        from transformers import AutoTokenizer
        from .data import PackedSequences, heldout_sequences
        plan, args = self.plan, self.args
        tok = AutoTokenizer.from_pretrained(plan.model_folder)
        self.train_seqs = PackedSequences(plan.train_docs, tok, args.seq_len, seed=args.seed,
                                          name=f"--data {args.data}")
        self.held_seqs = heldout_sequences(plan.heldout_docs, tok, args.seq_len,
                                           name=f"--data {args.data} (held-out)") if plan.heldout_docs else None
        self.data_info = {"spec": args.data, "fingerprint": plan.data_fingerprint,
                          "documents": len(plan.train_docs) + len(plan.heldout_docs),
                          "train_documents": len(plan.train_docs), "heldout_documents": len(plan.heldout_docs),
                          "train_tokens": self.train_seqs.tokens,
                          "heldout_tokens": self.held_seqs.tokens if self.held_seqs else 0}
        self.evaluating = self.held_seqs is not None and args.eval_sequences > 0

    # -------------------------------------------------------------- evaluation
    def _eval_calls(self) -> tuple[int, int]:
        """(engine calls, sequences per call) of one held-out evaluation."""
        per_call = self.plan.mb * self.plan.gas * self.plan.dp
        return max(1, min(self.args.eval_sequences, len(self.held_seqs)) // per_call), per_call

    def held_out(self, coded: bool) -> tuple[float, float | None, int]:
        """(mean held-out loss, its standard error, sequences scored) over the first
        ``--eval-sequences`` held-out windows (at most the held-out set). Each engine call scores one
        global batch (its loss averaged over the DP replicas); the standard error is that of the mean
        of those batch losses."""
        from tqdm import tqdm
        calls, per_call = self._eval_calls()
        bar = tqdm(total=calls, desc=f"held-out loss ({'through the codec' if coded else 'dense'}, "
                   f"{calls * per_call} sequences)", unit="batch", leave=False, dynamic_ncols=True,
                   disable=not self.is_rank0)
        losses = self.engine.eval_losses(self.held_seqs, calls, dense=not coded, bar=bar)
        bar.close()
        se = statistics.stdev(losses) / math.sqrt(len(losses)) if len(losses) > 1 else None
        return statistics.fmean(losses), se, calls * per_call

    def evaluate(self, step: int, key: str | None = None, after_final_sync: bool = False) -> dict:
        """Score the held-out windows dense (and through the codec unless the boundaries are dense);
        record the point on the curve and, with ``key``, as ``key`` / ``key_masked`` (+ ``_se``)."""
        point = {"step": step}
        point["loss"], point["se"], self.scored = self.held_out(coded=False)
        point["sequences"], point["seq_len"], point["data"] = self.scored, self.args.seq_len, self.plan.data_fingerprint
        if after_final_sync:    # the replicas' end-of-run average, not the weights a checkpoint holds
            point["after_final_sync"] = True
        if not self.engine.codec.identity:
            point["loss_coded"], point["se_coded"], _ = self.held_out(coded=True)
        self.curve.append(point)
        if self.is_rank0:   # heldout.jsonl: the curve survives a resume (summary.json heldout_curve)
            with open(os.path.join(self.plan.output_dir, "heldout.jsonl"), "a") as f:
                f.write(json.dumps(point) + "\n")
        if key is not None:
            self.evals[key], self.evals[key + "_se"] = point["loss"], point["se"]
            if "loss_coded" in point:
                masked = key.replace("heldout_loss", "heldout_loss_masked")
                self.evals[masked], self.evals[masked + "_se"] = point["loss_coded"], point["se_coded"]
        return point

    def _restore_curve(self, start_step: int) -> None:
        """The held-out points a resumed run already has (up to ``start_step``, from
        ``heldout.jsonl``); a fresh run starts the file anew. Whether the score of ``start_step`` itself
        is kept is decided by :meth:`_start_score` (then the file is rewritten)."""
        path = os.path.join(self.plan.output_dir, "heldout.jsonl")
        kept = []
        if start_step > 0 and os.path.isfile(path):
            with open(path) as f:
                for line in f:
                    try:
                        point = json.loads(line)
                    except ValueError:
                        break                        # a line cut short by a crash
                    if point.get("step", start_step + 1) <= start_step:
                        kept.append(point)
        self.curve = kept

    def _start_score(self, start_step: int) -> None:
        """The held-out score at the start of a launch: a fresh run scores the base model; a resumed one
        reuses the folder's (see :meth:`_first_from_curve`) and keeps an earlier launch's score of
        ``start_step`` where that scored the checkpoint's weights (not the end-of-run average of
        drifted DiLoCo replicas), else scores the resumed weights. Rewrites ``heldout.jsonl``."""
        reuse = self.evaluating and self._first_from_curve(start_step)
        self.curve = [p for p in self.curve if p["step"] < start_step
                      or (reuse and not p.get("after_final_sync"))]
        if self.is_rank0:
            from .files import atomic_write_text
            atomic_write_text(os.path.join(self.plan.output_dir, "heldout.jsonl"),
                              "".join(json.dumps(p) + "\n" for p in self.curve))
        if self.evaluating and not reuse:
            self.evaluate(start_step, "heldout_loss_first")

    def _first_from_curve(self, start_step: int) -> bool:
        """A resumed run whose output folder already holds the score of step 0 (``heldout.jsonl``)
        reports that as ``heldout_loss_first`` (the model before training, the same windows) instead
        of scoring the resumed weights again: every resume of a long study would otherwise redo an
        evaluation (minutes). Only a point scored on as many windows of the same length of the same
        data as this run scores (else the resumed weights are scored, as before). Rank 0's
        folder decides for every rank (an evaluation runs on all of them; another node may not share
        the folder)."""
        first = (next((p for p in self.curve if p.get("step") == 0), None)
                 if start_step > 0 and self.is_rank0 else None)
        calls, per_call = self._eval_calls()
        ok = first is not None and (first.get("sequences"), first.get("seq_len"), first.get("data")) == \
            (calls * per_call, self.args.seq_len, self.plan.data_fingerprint)
        if not self.world.max(1.0 if ok else 0.0):
            return False
        if not self.is_rank0:
            return True
        self.evals["heldout_loss_first"], self.evals["heldout_loss_first_se"] = first["loss"], first["se"]
        if "loss_coded" in first:
            self.evals["heldout_loss_masked_first"] = first["loss_coded"]
            self.evals["heldout_loss_masked_first_se"] = first["se_coded"]
        return True

    # -------------------------------------------------------------- run
    def run(self) -> dict | None:
        """All phases; returns the summary on rank 0 (None elsewhere)."""
        import signal
        from .faults import Stopped, maybe_inject
        plan, args, engine = self.plan, self.args, self.engine
        if self.is_rank0:
            os.makedirs(plan.output_dir, exist_ok=True)
        self.setup_data()
        ckpts = CheckpointManager(plan, engine, self.world, self.progress)
        start_step = 0
        resume = ckpts.resume_path() if args.resume else None
        self.run_totals = RunTotals(self.world)
        if not resume:
            ckpts.set_aside_old()
        else:
            start_step = engine.load_checkpoint(resume)
            self.run_totals.load(resume, start_step)
            if start_step >= args.steps:
                raise ConfigError(f"--resume: the checkpoint is at step {start_step}, nothing to do for "
                                  f"--steps {args.steps}")
        engine.set_train_data(self.train_seqs, start_step)
        self._restore_curve(start_step)
        link = engine.anchor_link(self.world) if self.tc.anchor.enabled else None
        self._start_score(start_step)

        log = StepLog(plan, engine, link, self.is_rank0, start_step)
        policy = plan.ckpt_policy
        eval_every = getattr(args, "eval_every", 0) or 0

        def on_sigterm(_sig, _frame):
            raise Stopped("stopped by the launcher (SIGTERM), most likely because another rank failed")
        signal.signal(signal.SIGTERM, on_sigterm)
        t_start = time.perf_counter()
        for step in range(start_step, args.steps):
            self.progress.step_now, self.progress.phase = step, None
            maybe_inject(plan.fault, "kill", self.world.rank, step)
            maybe_inject(plan.fault, "stop", self.world.rank, step)
            t0 = time.perf_counter()
            before, dp_before = wire.totals(), engine.timing["dp_s"]
            if link is not None:
                link.maybe_publish(step)
                link.poll(step)
            loss = float(engine.train_batch())
            if not math.isfinite(loss):
                raise FloatingPointError(f"step {step}: training loss is {loss}")
            after = wire.totals()
            dt = time.perf_counter() - t0
            log.record(step, loss, dt, {k: after[k] - before[k] for k in after if after[k] != before[k]},
                       engine.timing["dp_s"] - dp_before)
            if policy.needs_calibration and step == start_step + 1:   # the first step carries warm-up
                slowest = self.world.max(dt)
                every = policy.calibrate(slowest)
                log0(self.is_rank0, f"checkpointing every {every} steps (~{policy.every_minutes:g} min at "
                                    f"{slowest:.1f} s/step) to {ckpts.dir}, keeping {policy.keep}")
            self.progress.step_now = step + 1
            if policy.due(step + 1, args.steps):
                ckpts.save(self.run_totals, log.tokens_per_step * (step + 1 - start_step))
            if self.evaluating and eval_every and (step + 1) % eval_every == 0 and step + 1 < args.steps:
                self.evaluate(step + 1)
        log.close()
        wall = time.perf_counter() - t_start

        if args.save_checkpoint or args.save_interval:
            # before the final DP flush: a run resumed from here continues exactly like this one would
            ckpts.save(self.run_totals, log.tokens_per_step * (args.steps - start_step))
        return self.finish(log, link, wall, start_step)

    def finish(self, log, link, wall: float, start_step: int) -> dict | None:
        plan, args, engine = self.plan, self.args, self.engine
        self.progress.phase = "after the last step (final sync, evaluation or saving the model)"
        dp_before_final = wire.totals()["dp"]
        averaged = engine.finalize()
        if averaged:  # finish in-flight DiLoCo syncs; average the drifted fragments once
            log0(self.is_rank0, f"{self.tc.dp.backend}: in-flight syncs finished and drifted weights averaged "
                                "once (the saved model is the replicas' average)")
        dp_final_local = wire.totals()["dp"] - dp_before_final
        replicas_identical = engine.replicas_identical()
        anchor_stats = link.finish() if link is not None else None
        if self.evaluating:
            self.evaluate(args.steps, "heldout_loss", after_final_sync=bool(averaged))

        # the model first: whatever its export sends is counted (each stage writes its own shard)
        folder = None if args.no_save_model else engine.export_hf(os.path.join(plan.output_dir, "hf"), self.world)
        trainable, total = engine.parameter_counts()
        # dp_init: what this rank received in a start-up weight broadcast from its DP group's first
        # replica (one-off, outside the training counters; nothing when the replicas loaded the same weights)
        counts = {"dp_final_sync": dp_final_local, "dp_init": engine.start_broadcast_bytes,
                  "trainable": trainable, "parameters": total}
        totals = {k: int(v) for k, v in self.world.sum({**wire.totals(), **counts}).items()}
        dp_final_bytes = totals.pop("dp_final_sync")
        dp_init_bytes = totals.pop("dp_init")
        params = {"trainable": totals.pop("trainable"), "total": totals.pop("parameters")}
        timing = {k: float(v) for k, v in engine.timing.items()}
        timing.update({f"dp_{k}": v for k, v in log.dp_comm.items()})
        timing = self.world.sum(timing)
        summary = None
        if self.is_rank0:
            summary = self.summary(log, totals, timing, wall, start_step, replicas_identical, anchor_stats,
                                   dp_final_bytes, dp_init_bytes)
            summary["data"] = {**self.data_info, "heldout_scored_tokens": self.scored * args.seq_len}
            summary["parameters"] = params  # (LoRA: the adapters train, and only they cross the DP link)
        if self.is_rank0:
            if folder is not None:
                summary["hf_folder"] = folder
            from .files import atomic_write_text
            atomic_write_text(os.path.join(plan.output_dir, "summary.json"), json.dumps(summary, indent=2))
            print_summary(summary, plan.output_dir)
        return summary

    def summary(self, log, totals, timing, wall, start_step, replicas_identical, anchor_stats,
                dp_final_bytes=0, dp_init_bytes=0) -> dict:
        plan, args, tc, engine = self.plan, self.args, self.tc, self.engine
        steps_run = args.steps - start_step
        tokens = log.tokens_per_step * steps_run
        wire_bytes = {k: totals[k] for k in wire.KINDS if k != "pp_eval"}
        return {
            "config": {"file": args.config, "twocircuit": tc.to_dict(), "model": args.model,
                       "model_folder": plan.model_folder, "data": args.data, "seq_len": args.seq_len,
                       "micro_batch_size": plan.mb, "gradient_accumulation_steps": plan.gas,
                       "optimizer": {"type": plan.optimizer[0], **plan.optimizer[1]}, "seed": args.seed,
                       "mask_seed": engine.mask_seed, "device": str(getattr(engine, "device", "accelerator"))},
            "engine": engine.kind,
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
            "dp_comm_s_all_ranks": {"total": round(timing["dp_comm_s"], 3),
                                    "hidden": round(timing["dp_hidden_comm_s"], 3)},
            "anchor": anchor_stats,
            "mask_rate": tc.effective_mask_rate,
            "codec": engine.codec.describe(),
            "kept_channels": engine.codec.keep(max(engine.global_steps - 1, 0), plan.spec.hidden),
            "hidden_size": plan.spec.hidden,
            "wire_bytes": wire_bytes,
            # the whole run since step 0 (this launch and the ones it resumed from; None: unknown)
            "run": self.run_totals.summary(args.steps, tokens, totals),
            # training traffic only: the export is a one-off at the end, shown under wire_bytes.export
            "bytes_per_token": round(sum(wire_bytes[k] for k in wire.TRAINING_KINDS) / tokens, 3),
            "eval_wire_bytes": totals["pp_eval"],
            "timing_s_all_ranks": {k: round(v, 3) for k, v in timing.items()},
            "heldout_curve": [{k: (round(v, 5) if isinstance(v, float) else v) for k, v in p.items()}
                              for p in self.curve],
            **{k: (round(v, 5) if v is not None else None) for k, v in self.evals.items()},
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
        + (f", anchor Z={s['mesh']['anchor_replicas']}" if s['mesh']['anchor_replicas'] else "")
        + (", single-process reference engine" if s.get("engine") == "reference" else "") + ")",
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
        (f"codec {codec['mode']}: rank {codec['rank']}, {codec['bytes_per_token']} bytes per token each way "
         f"(state shipped on refresh, counted as pp_codec_state)" if "rank" in codec else
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
