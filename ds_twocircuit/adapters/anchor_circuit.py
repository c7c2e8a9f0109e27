"""The anchor circuit and its link to the fast circuit (method notes, sections 2-3).

Fast side (:class:`AnchorLink`): every K steps the fast circuit writes a snapshot of its weights
(DeepSpeed's per-layer files, the same the DeepSpeed checkpoint holds) plus the identity of the
batch it trains on at that step, commits it atomically to a :class:`SnapshotStore`, and at every
step picks up, without waiting (unless ``anchor.max_wait_s`` allows it), the newest anchor
gradients of its own stage and hands them to the correction (spectral or delayed_ef).

Anchor side (:func:`run_anchor`): Z unmasked pipeline replicas in their own process-group world
(a DeepSpeed pipeline topology must span its whole world), same partitioning as the fast circuit,
running an :class:`AnchorPipelineEngine` that never steps an optimizer: load the newest committed
snapshot, recompute its batch (the data pipeline is a pure function of the step), run a dense
forward/backward, average over the Z replicas and publish each stage's gradients of the 2-D
decoder matrices.

Invariant: the fast circuit never blocks on the anchor (by default; ``anchor.max_wait_s`` > 0 bounds a
wait for the scheduled gradients, which makes runs reproducible while the anchor keeps up). It only
reads committed files; a slow, crashed or absent anchor just means no new anchor state (training
goes on with the last one, and the log says so). The launched anchor rank is a supervisor that runs the real worker as a child
and always exits 0, so a crashed or killed anchor never makes the launcher tear down the fast
circuit.
"""
from __future__ import annotations

import os
import time
import uuid
import warnings

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import schedule

from .. import wire
from ..files import atomic_write_text
from .dist import from_comm, to_comm
from .pipeline_engine import MaskedPipelineEngine
from ..anchor.fence import AnchorFence
from ..anchor.store import SnapshotStore

DONE = "FAST_DONE"
RUN = "RUN"
UP = "ANCHOR_UP"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


class AnchorPipelineEngine(MaskedPipelineEngine):
    """Dense forward/backward only: gradients are averaged over the Z replicas and left in
    ``p.grad``; the optimizer is never stepped and the engine's step counter never moves."""

    def _exec_optimizer_step(self, lr_kwargs=None):
        pass

    _INSTRUCTION_MAP = {**MaskedPipelineEngine._INSTRUCTION_MAP, schedule.OptimizerStep: _exec_optimizer_step}


def layer_file_index(name: str) -> int:
    """Layer index of a DeepSpeed pipeline layer file ``layer_{idx:02d}-model_states.pt`` (two digits
    at least: ``layer_07-...``, ``layer_123-...``)."""
    if not (name.startswith("layer_") and name.endswith("-model_states.pt")):
        raise ValueError(f"not a pipeline layer file: {name!r}")
    return int(name[len("layer_"):name.index("-")])


def decoder_matrices(module) -> dict[str, torch.nn.Parameter]:
    """The 2-D weights of the decoder layers of a pipeline stage (attention and MLP projections; not
    norms, biases, embeddings or the head) by their Hugging Face names, as the single-process engine
    names them (the correction seeds its randomized SVD by name)."""
    from ..models.layers import DecoderPipe
    out = {}
    for m in module.modules():
        if isinstance(m, DecoderPipe):
            for pname, p in m.layer.named_parameters():
                if p.dim() == 2 and p.requires_grad:
                    out[f"model.layers.{m.layer_idx}.{pname}"] = p
    return out


def store_root(plan) -> str:
    return plan.tc.anchor.store or os.path.join(plan.output_dir, "anchor_store")


def attach_correction(optimizer, module, plan):
    """Attach the configured anchor correction to the fast circuit's optimizer (through its
    public step and state-dict hooks) for this stage's 2-D decoder matrices. The engine keeps
    ``optimizer`` itself; returns the correction (None without 2-D targets)."""
    from ..anchor.corrections import build_correction
    return build_correction(optimizer, decoder_matrices(module), plan.tc.anchor, plan.args.seed)


def pick_snapshot(store: SnapshotStore, run_id, last_step: int, bad: set, reader_id: str, in_order: bool = False):
    """The anchor root's choice: a *lease* on the newest committed snapshot of run ``run_id`` newer
    than ``last_step`` (``in_order``: the oldest such) and not known bad, or None. The lease keeps retention from deleting the
    snapshot while every anchor rank loads it; release it after. ``bad`` holds (tag, committed_at)
    pairs, so a tag committed again (e.g. after a resume) is a new snapshot, not a skipped one."""
    after = last_step
    while True:
        lease = store.acquire_latest_snapshot(reader_id, oldest_after=after if in_order else None)
        if lease is None:
            return None
        info = lease.info
        if in_order and (info.tag, info.committed_at) in bad:   # never servable: the next one, not a stall
            lease.release()
            after = info.step
            continue
        if ((info.batch_id or {}).get("run") != run_id or info.step <= last_step
                or (info.tag, info.committed_at) in bad):
            lease.release()
            return None
        return lease


def commit_snapshot_safely(store: SnapshotStore, tag: str, step: int, batch: dict, files: dict) -> bool:
    """Commit a snapshot; any store error (a size mismatch from a lagging network filesystem, a
    full disk) only costs this snapshot: the fast circuit goes on, the log says why."""
    try:
        store.commit_snapshot(tag, step, batch, files=files)
        return True
    except Exception as e:  # noqa: BLE001 -- nothing of the anchor may stop the fast circuit
        warnings.warn(f"anchor: snapshot {tag} not published ({type(e).__name__}: {e}); training goes on "
                      "and the next snapshot is tried", RuntimeWarning, stacklevel=2)
        return False


class AnchorLink:
    """Fast-circuit side: publish snapshots, consume anchor gradients, never wait (beyond
    ``anchor.max_wait_s``)."""

    def __init__(self, engine, plan, world, origin=None):
        from ..data import StreamOrigin
        self.engine, self.plan, self.world = engine, plan, world
        self.origin = origin or StreamOrigin()   # the training stream's (after a resume on another DP width)
        self.every = plan.tc.anchor.every
        self.store = SnapshotStore(store_root(plan), keep=plan.tc.anchor.keep)
        self.opt = getattr(engine.optimizer, "twocircuit_correction", None)  # attach_correction's
        self.stage = engine.stage_id
        self.dp_rank = engine.grid.get_data_parallel_id()
        self.dp_group = engine.grid.get_data_parallel_group()
        self.updates = 0
        self.staleness: list[int] = []
        self.wait_s = 0.0
        self.publish_s = 0.0
        self.refresh_s = 0.0
        self.received_bytes = 0
        self.last_arrival_step = None
        self._warned_absent = False
        self.fence = AnchorFence(self.every)
        self._vote = None  # (handle, flags) of the vote in flight (DP > 1)
        box = [None]
        if world.rank == 0:
            self.store.discard_after(engine.global_steps - 1)  # snapshots of a run we replace
            try:
                os.remove(os.path.join(self.store.root, DONE))
            except FileNotFoundError:
                pass
            box = [uuid.uuid4().hex[:12]]
            atomic_write_text(os.path.join(self.store.root, RUN), box[0])
            wait = plan.tc.anchor.startup_wait_s
            if wait < 0:
                wait = 120.0 if plan.anchor_ranks else 0.0
            self._wait_for_anchor(box[0], wait)
        dist.broadcast_object_list(box, src=0)
        self.run_id = box[0]  # snapshots and gradients of another run in the same store are ignored

    def _wait_for_anchor(self, run_id: str, timeout_s: float) -> None:
        """Start-up only (never during training): let an anchor launched alongside come up."""
        if timeout_s <= 0:
            return
        t0 = time.time()
        while time.time() - t0 < timeout_s:
            if _read(os.path.join(self.store.root, UP)) == run_id:
                print(f"[ds_twocircuit] anchor circuit ready after {time.time() - t0:.1f} s", flush=True)
                return
            time.sleep(0.1)
        print(f"[ds_twocircuit] anchor circuit not up after {timeout_s:.0f} s; training without it until "
              "it delivers", flush=True)

    # -- snapshots --------------------------------------------------------------------------
    def maybe_publish(self, step: int) -> None:
        if step % self.every:
            return
        t0 = time.perf_counter()
        tag = f"step{step:08d}"
        box = [True]
        if self.world.rank == 0:
            try:  # e.g. a live lease still holds an older version of this tag
                self.store.prepare_snapshot(tag)
            except Exception as e:  # noqa: BLE001
                warnings.warn(f"anchor: snapshot {tag} skipped ({type(e).__name__}: {e})", RuntimeWarning)
                box = [False]
        dist.broadcast_object_list(box, src=0)  # every rank skips together (no half-written tag)
        if not box[0]:
            self.publish_s += time.perf_counter() - t0
            return
        folder = os.path.join(self.store.snapshots_dir, tag)
        self.engine.module.save_state_dict(folder, checkpoint_engine=self.engine.checkpoint_engine)
        mine = {}
        if self.dp_rank == 0:
            for f in os.listdir(folder):
                if f.startswith("layer_") and f.endswith("-model_states.pt"):
                    idx = layer_file_index(f)
                    if self.engine.module._local_start <= idx < self.engine.module._local_stop:
                        mine[f] = os.path.getsize(os.path.join(folder, f))
        parts = [None] * self.world.size if self.world.rank == 0 else None
        dist.gather_object(mine, parts, dst=0)
        if self.world.rank == 0:
            files = {}
            for p in parts:
                files.update(p)
            batch = {"run": self.run_id, "step": step, "dp": self.plan.dp, "gas": self.plan.gas, "micro_batch_size": self.plan.mb,
                     "origin": self.origin.to_dict(),
                     "seq_len": self.plan.args.seq_len, "seed": self.plan.args.seed, "data": self.plan.args.data}
            commit_snapshot_safely(self.store, tag, step, batch, files)
        self.publish_s += time.perf_counter() - t0

    # -- anchor gradients -------------------------------------------------------------------
    def poll(self, step: int) -> None:
        """Hand new anchor gradients of this stage to the optimizer, if any arrived. With DP > 1
        all replicas of a stage submit the same gradients at the same step, agreed through
        :class:`~ds_twocircuit.anchor.fence.AnchorFence` (every replica reads the store itself; an
        asynchronous vote every ``every`` steps; never a wait on the DP link)."""
        if self.opt is None:
            return
        t0 = time.perf_counter()
        latest = step - self.every if self.plan.tc.anchor.consume == "scheduled" else None
        if self.plan.dp > 1:
            source_step, grads = self._fence_step(step, latest)
        else:
            got = self._read_store(self.opt.last_anchor_source_step, latest)
            source_step, grads = (got.source_step, got.grads) if got is not None else (None, None)
        self.wait_s += time.perf_counter() - t0
        if grads is not None:
            t1 = time.perf_counter()
            self.opt.submit_anchor_gradients(grads, source_step)
            self.refresh_s += time.perf_counter() - t1
            self.updates += 1
            self.staleness.append(step - source_step)
            self.last_arrival_step = step
        elif step >= 3 * self.every and self.last_arrival_step is None and not self._warned_absent \
                and self.world.rank == 0:
            self._warned_absent = True
            print(f"[ds_twocircuit] step {step}: no anchor gradients yet (anchor slow, crashed or absent); "
                  "training continues without anchor priors", flush=True)
        self.opt.current_step = step

    def _read_store(self, after_step, max_step):
        """The newest gradients of this stage and run in the store (counted as anchor bytes: they
        crossed from the anchor to this rank), or None. Never blocks, unless ``anchor.max_wait_s``
        allows waiting that long for the scheduled snapshot's gradients (the newest snapshot step at
        or before ``max_step``) when they are not there yet."""
        def read():
            got = self.store.poll_anchor_gradients(self.stage, after_step=after_step, max_step=max_step)
            return got if got is not None and (got.batch_id or {}).get("run") == self.run_id else None
        got = read()
        wait = self.plan.tc.anchor.max_wait_s
        if wait > 0 and max_step is not None and max_step >= 0:
            due = (max_step // self.every) * self.every          # the snapshot scheduled for now
            deadline = time.time() + wait
            while (got is None or got.source_step < due) and (after_step is None or after_step < due) \
                    and time.time() < deadline:
                time.sleep(0.02)
                got = read() or got
        if got is None:
            return None
        wire.count("anchor", got.nbytes)
        self.received_bytes += got.nbytes
        return got

    def _fence_step(self, step: int, latest):
        if not self.fence.due(step):
            return None, None
        last = self.opt.last_anchor_source_step
        use = None
        if self._vote is not None:  # issued `every` steps ago: long complete, the wait is ~0
            handle, flags = self._vote
            handle.wait()
            self._vote = None
            use = self.fence.resolve(from_comm(flags), last)
        if use is not None:
            last = use[0]
        newest = [s for s in (last, self.fence.newest_held()) if s is not None]
        got = self._read_store(max(newest) if newest else None, latest)
        if got is not None:
            self.fence.offer(got.source_step, got.grads, last)
        flags = to_comm(self.fence.vote(step))
        self._vote = (dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self.dp_group, async_op=True), flags)
        wire.count("anchor", wire.ring_allreduce_bytes(wire.tensor_bytes(flags), self.plan.dp))
        return use if use is not None else (None, None)

    def step_stats(self) -> dict:
        s = {"anchor.updates": self.updates, "anchor.wait_s": round(self.wait_s, 6)}
        if self.staleness:
            s["anchor.staleness"] = self.staleness[-1]
        if self.opt is not None:
            s.update({k.replace("/", "."): v for k, v in self.opt.last_stats().items()})
        return s

    def finish(self) -> dict:
        if self._vote is not None:  # the last vote: complete it, nobody uses it
            self._vote[0].wait()
            self._vote = None
        if self.world.rank == 0:
            atomic_write_text(os.path.join(self.store.root, DONE), self.run_id)
        vec = torch.tensor([self.updates, sum(self.staleness), len(self.staleness), self.wait_s,
                            self.publish_s, self.refresh_s], dtype=torch.float64)
        # stats of the stage with the fewest updates (stages consume independently)
        mins, maxs = to_comm(vec[:1].clone()), to_comm(vec[3:].clone())
        dist.all_reduce(mins, op=dist.ReduceOp.MIN)
        dist.all_reduce(maxs, op=dist.ReduceOp.MAX)
        mins, vec[3:] = from_comm(mins), from_comm(maxs)
        n = len(self.staleness)
        return {"updates": int(mins[0]), "mean_staleness": (sum(self.staleness) / n) if n else None,
                "wait_s": round(float(vec[3]), 6), "publish_s": round(float(vec[4]), 3),
                "refresh_s": round(float(vec[5]), 3), "every": self.every, "store": str(self.store.root),
                "received_bytes_stage": self.received_bytes}


# ------------------------------------------------------------------------------------------------
# Anchor side

def run_anchor(plan, world) -> int:
    """The anchor worker: Z unmasked replicas of the pipeline, same partitioning."""
    from deepspeed.runtime.utils import clip_grad_norm_
    from transformers import AutoTokenizer

    from ..data import MicroBatchStream, PackedSequences, StreamOrigin
    from .engine import PipelineEngine

    args, tc = plan.args, plan.tc
    z_rank_world = world.rank
    engine = PipelineEngine(plan, role="anchor").ds   # built as the fast circuit's, dense and never stepped
    targets = decoder_matrices(engine.module)
    names = sorted(targets)
    # delayed_ef pairs this gradient with the fast step's own, which DeepSpeed clipped before the
    # optimizer saw it: clip this one by the same rule (DeepSpeed's clip_grad_norm_, the global norm
    # over every stage of the replica), or the pair's difference carries the clipping (measured:
    # docs/benchmarks/quality_stdlib.md). The spectral filter keeps the paper's unclipped anchor gradients.
    clip_like_fast = (engine.gradient_clipping() if tc.anchor.correction == "delayed_ef" else 0.0) or 0.0
    store = SnapshotStore(store_root(plan), keep=tc.anchor.keep)
    tok = AutoTokenizer.from_pretrained(plan.model_folder)
    seqs = PackedSequences(plan.train_docs, tok, args.seq_len, seed=args.seed)
    z = engine.grid.get_data_parallel_id()
    stage = engine.stage_id
    poll_s = float(os.environ.get("DS_TWOCIRCUIT_ANCHOR_POLL_S", "0.2"))
    idle_timeout = float(os.environ.get("DS_TWOCIRCUIT_ANCHOR_IDLE_S", "900"))
    last_step, processed, bad = -1, 0, set()
    reader_id = f"anchor-{uuid.uuid4().hex[:8]}"
    current_run, run_of = None, {}
    last_activity = time.time()
    is_root = z_rank_world == 0
    if is_root:
        print(f"[ds_twocircuit] anchor circuit up: Z={plan.z} x pp={plan.pp}, store {store.root}", flush=True)
    while True:
        decision = [None]
        lease = None
        if is_root:
            run_id = _read(os.path.join(store.root, RUN))
            if run_id != current_run:  # the fast circuit (re)started: a new timeline
                current_run, last_step = run_id, -1
                bad.clear()
                if run_id is not None:
                    atomic_write_text(os.path.join(store.root, UP), run_id)
            done = run_id is not None and _read(os.path.join(store.root, DONE)) == run_id
            # the fast circuit waits for each scheduled snapshot (anchor.max_wait_s): serve them all, in
            # order; else the newest (the least stale), skipping what the anchor could not keep up with
            lease = (pick_snapshot(store, run_id, last_step, bad, reader_id, in_order=tc.anchor.max_wait_s > 0)
                     if run_id is not None else None)
            if lease is not None:
                info = lease.info
                decision = [("work", info.tag, info.step, run_id, info.committed_at, info.batch_id)]
            elif done:
                decision = [("stop",)]
            elif time.time() - last_activity > idle_timeout:
                decision = [("idle",)]
            else:
                decision = [("wait",)]
        dist.broadcast_object_list(decision, src=0)
        kind = decision[0][0]
        if kind == "stop":
            break
        if kind == "idle":
            if is_root:
                print(f"[ds_twocircuit] anchor: no new snapshot for {idle_timeout:.0f} s; stopping", flush=True)
            break
        if kind == "wait":
            time.sleep(poll_s)
            continue
        _, tag, step, run_id, committed_at, batch_id = decision[0]
        run_of[tag] = run_id
        folder = os.path.join(store.snapshots_dir, tag)
        ok = to_comm(torch.tensor([1.0]))
        try:
            engine.module.load_state_dir(folder, checkpoint_engine=engine.checkpoint_engine, strict=True)
        except Exception as e:  # a file vanished (pruned) or is corrupt: skip this snapshot
            warnings.warn(f"anchor: snapshot {tag} unreadable on stage {stage} ({type(e).__name__}: {e}); skipped")
            ok.zero_()
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if lease is not None:  # every rank has read the files: retention may have them now
            lease.release()
        if from_comm(ok).item() == 0:
            bad.add((tag, committed_at))
            continue
        for p in engine.module.parameters():
            p.grad = None
        # the snapshot's own batch: the fast circuit's width and stream origin when it was taken
        batch_id = batch_id or {}
        fast_dp = int(batch_id.get("dp", plan.dp))
        stream = MicroBatchStream(seqs, plan.mb, plan.gas, fast_dp, z % fast_dp, start_step=step,
                                  origin=StreamOrigin.from_dict(batch_id.get("origin")))
        loss = float(engine.train_batch(stream))
        if clip_like_fast:  # all ranks: the norm is summed over the stages of a replica
            clip_grad_norm_(parameters=engine.module.parameters(), max_norm=clip_like_fast, mpu=engine.mpu)
        if engine.grid.get_data_parallel_id() == 0:
            grads = {n: targets[n].grad.detach().clone() for n in names if targets[n].grad is not None}
            store.publish_anchor_gradients(stage, step, grads, batch_id={"run": run_of[tag], "step": step,
                                                                         "loss": loss})
        last_step, processed = step, processed + 1
        last_activity = time.time()
        if is_root:
            print(f"[ds_twocircuit] anchor: gradients for snapshot step {step} published (dense loss {loss:.4f})",
                  flush=True)
    if is_root:
        import json
        with open(os.path.join(store.root, "anchor_summary.json"), "w") as f:
            json.dump({"processed": processed, "last_step": last_step, "wire_bytes": wire.totals()}, f, indent=2)
    dist.barrier()
    return 0
