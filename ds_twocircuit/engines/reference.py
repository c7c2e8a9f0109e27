"""The single-process reference engine: a pipeline run's mathematics in one process.

* **The model**: the whole Hugging Face model, with the run's boundary codec in its graph at every
  stage boundary of ``plan.parts`` (:class:`~ds_twocircuit.reference.BoundaryMasker`: the same codec
  objects and messages as the pipeline engine, bytes counted by the same meter, ``wire.py``).
* **DP replicas**: one model, optimizer, codec pairs and DP backend per replica, each stepping in its
  own thread, one at a time; the backends' collectives go through :class:`InProcessGroup`, which
  sums the replicas' tensors in rank order (with two replicas: exactly gloo's sum). Each replica computes
  what the pipeline's replica computes: loss / gas per micro-batch, the backend's reduction, global-norm
  clipping, the optimizer (with the anchor correction's hooks), the backend's after-step.
* **The anchor**: in-process (:class:`InProcessAnchor`): at every snapshot step s (``s % every == 0``)
  the dense gradient of replica 0's weights on replica 0's batch of step s (clipped by the fast step's
  rule for ``delayed_ef``, as the anchor circuit does), handed to every replica's correction at step
  s + every (``consume = scheduled``) or at once (``arrival``: no latency in one process).

What it does not simulate: DeepSpeed's handshake and tied-weight messages (``pp_handshake``,
``pp_tied``), the software throttle, bf16/fp16 engines. The equivalence tests compare it with the
pipeline engine on the same config files.
"""
from __future__ import annotations

import copy
import json
import os
import threading

import torch

from .. import wire
from ..configkit import ConfigError
from ..dp.base import Communicator
from ..models.layers import causal_lm_loss, hf_decoder_matrices, stage_of


# ------------------------------------------------------------------------------------------ DP in-process
class _DoneWork:
    """The handle of a collective that has already completed (``wait`` and ``get_future``)."""

    def wait(self):
        return True

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut


class InProcessGroup:
    """Replicas as threads of one process that take turns: exactly one replica computes at a time
    (each op then runs alone on the intra-op thread pool, so every result is reproducible), in rank
    order, and hands over the turn at each collective. ``comm(r)`` is replica r's communicator. An
    all-reduce collects every replica's tensor, the last one sums them in rank order and gives each
    the sum. A replica that fails breaks the group, so the others raise instead of waiting forever."""

    def __init__(self, size: int):
        self.size = int(size)
        self._cond = threading.Condition()
        self._turn = 0
        self._slots: list = [None] * self.size
        self._broken = False

    def comm(self, rank: int) -> "InProcessComm":
        return InProcessComm(self, rank)

    def _wait_turn(self, rank: int) -> None:
        while self._turn != rank and not self._broken:
            self._cond.wait()
        if self._broken:
            raise RuntimeError(f"replica {rank}: another simulated replica failed")

    def begin(self, rank: int) -> None:
        with self._cond:
            self._wait_turn(rank)

    def end(self, rank: int) -> None:
        with self._cond:
            waiting = [r for r, t in enumerate(self._slots) if t is not None]
            if waiting:   # they would wait for a collective this replica never issues
                self._broken = True
                self._cond.notify_all()
                raise RuntimeError(f"replica {rank} finished its step while replica(s) {waiting} wait in a "
                                   "collective: the replicas' DP backends issued different collectives")
            self._turn = rank + 1
            self._cond.notify_all()

    def reset(self) -> None:
        with self._cond:
            self._turn, self._broken, self._slots = 0, False, [None] * self.size

    def abort(self) -> None:
        with self._cond:
            self._broken = True
            self._cond.notify_all()

    def _exchange(self, rank: int, item, combine) -> None:
        """Put ``item`` in this replica's slot; the last replica in calls ``combine(slots)`` (every
        replica's item, rank order) and hands the turn back to replica 0."""
        with self._cond:
            self._slots[rank] = item
            if rank == self.size - 1:
                combine(self._slots)
                self._slots = [None] * self.size
                self._turn = 0
            else:
                self._turn = rank + 1
            self._cond.notify_all()
            self._wait_turn(rank)

    def all_reduce_sum(self, rank: int, t: torch.Tensor) -> None:
        def total(slots):                   # summed in rank order, written back to every replica's
            acc = slots[0].clone()
            for other in slots[1:]:
                acc += other
            for slot in slots:
                slot.copy_(acc)
        self._exchange(rank, t, total)

    def all_gather_into(self, rank: int, out: torch.Tensor, t: torch.Tensor) -> None:
        def gather(slots):                  # every replica gets all of them, rank order
            gathered = torch.cat([src.reshape(-1) for _, src in slots])
            for dst, _ in slots:
                dst.copy_(gathered)
        self._exchange(rank, (out, t), gather)

    def all_to_all_into(self, rank: int, out: torch.Tensor, t: torch.Tensor) -> None:
        def scatter(slots):                 # replica i's row j goes to replica j's row i
            for i, (_, src) in enumerate(slots):
                for j, (dst, _) in enumerate(slots):
                    dst[i].copy_(src[j])
        self._exchange(rank, (out, t), scatter)


class InProcessComm(Communicator):
    def __init__(self, group: InProcessGroup, rank: int):
        self.group, self.rank, self.world_size = group, rank, group.size

    def all_reduce_sum(self, t: torch.Tensor, async_op: bool = False):
        # completed at launch: the values a later wait() sees are the same as an asynchronous
        # collective's (the backends reduce flat copies, never live weights)
        self.group.all_reduce_sum(self.rank, t)
        return _DoneWork() if async_op else None

    def all_gather_into(self, out: torch.Tensor, t: torch.Tensor, async_op: bool = False):
        self.group.all_gather_into(self.rank, out, t)
        return _DoneWork() if async_op else None

    def all_to_all_into(self, out: torch.Tensor, t: torch.Tensor, async_op: bool = False):
        self.group.all_to_all_into(self.rank, out, t)
        return _DoneWork() if async_op else None


def run_replicas(group: InProcessGroup | None, fn, n: int) -> list:
    """``fn(r)`` for every replica r, taking turns (see :class:`InProcessGroup`); the first error is
    re-raised."""
    if n == 1:
        return [fn(0)]
    out, errors = [None] * n, [None] * n

    def work(r):
        try:
            group.begin(r)
            out[r] = fn(r)
            group.end(r)
        except BaseException as e:  # noqa: BLE001 -- re-raised below, after the others stopped
            errors[r] = e
            group.abort()
    threads = [threading.Thread(target=work, args=(r,), name=f"replica{r}") for r in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        group.reset()   # ready for the next step, whatever happened in this one
    first = next((e for e in errors if e is not None and not (isinstance(e, RuntimeError)
                                                              and "another simulated replica" in str(e))), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return out


# ------------------------------------------------------------------------------------------ replicas
class _Replica:
    def __init__(self, model, masker, optimizer, correction, backend):
        self.model, self.masker, self.optimizer, self.correction, self.backend = \
            model, masker, optimizer, correction, backend
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.stream = None


def _load_model(plan):
    from transformers import AutoModelForCausalLM
    from ..reference import untie_head
    model = AutoModelForCausalLM.from_pretrained(plan.model_folder, dtype=torch.float32, attn_implementation="sdpa")
    tc = plan.tc
    if plan.spec.tied:
        if tc.tied_embeddings == "untie":
            untie_head(model)
        elif tc.tied_embeddings == "freeze":
            model.get_input_embeddings().weight.requires_grad_(False)
    if tc.lora.enabled:
        from ..lora import add_lora
        add_lora(model, [(layer, f"model.layers.{i}.") for i, layer in enumerate(model.model.layers)],
                 tc.lora, plan.args.seed)
    return model


class ReferenceEngine:
    kind = "reference"

    def __init__(self, plan):
        from ..codecs import DENSE, build_codec, make_codec
        from ..dp.registry import get_backend
        from ..reference import BoundaryMasker
        from . import build_optimizer
        ds = plan.ds_config
        for section in ("bf16", "fp16"):
            if (ds.get(section) or {}).get("enabled"):
                raise ConfigError(f"{plan.args.config}: {section}.enabled: the single-process reference engine "
                                  "trains in fp32 only; use the pipeline engine (launch/train.py) for it")
        if ds.get("scheduler"):
            raise ConfigError(f"{plan.args.config}: scheduler: the single-process reference engine has no "
                              "learning-rate scheduler; remove it or use the pipeline engine")
        self.plan = plan
        tc = plan.tc
        self.mask_seed = tc.mask_seed if tc.mask_seed is not None else plan.args.seed
        self.clip = float(ds.get("gradient_clipping") or 0.0)
        torch.manual_seed(plan.args.seed)
        self.device = torch.device(getattr(plan.args, "device", "cpu") or "cpu")
        base = _load_model(plan).to(self.device)
        self.group = InProcessGroup(plan.dp) if plan.dp > 1 else None
        self.replicas: list[_Replica] = []
        # every copy before any hook: a deep copy would carry the first replica's boundary hooks
        models = [base] + [copy.deepcopy(base) for _ in range(plan.dp - 1)]
        reference_model = None
        if plan.pp > 1 and make_codec(tc).needs_reference:
            # the base model's frozen copy (taken before any checkpoint is loaded): every replica's
            # links code the drift from its activations (twocircuit.codec.reference = "base")
            reference_model = copy.deepcopy(base).eval().requires_grad_(False)
        for r, model in enumerate(models):
            masker = BoundaryMasker(model, plan.pp, lambda: make_codec(tc), seed=self.mask_seed,
                                    parts=plan.parts, gas=plan.gas,
                                    dense_factory=lambda: build_codec(DENSE, tc.wire_dtype),
                                    reference_model=reference_model)
            trainable = [p for p in model.parameters() if p.requires_grad]
            opt = build_optimizer(plan, trainable)
            correction = None
            if tc.anchor.enabled:
                from ..anchor.corrections import build_correction
                correction = build_correction(opt, hf_decoder_matrices(model), tc.anchor, plan.args.seed)
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            comm = self.group.comm(r) if self.group is not None else None
            backend_cls = get_backend(tc.dp.backend)
            kw = {}
            if backend_cls.splits_by_stage:   # group the parameters as each pipeline stage's backend does
                n_layers = int(model.config.num_hidden_layers)
                stages = [[(n, p.numel()) for n, p in named if stage_of(n, plan.parts, n_layers) == s]
                          for s in range(plan.pp)]
                kw = backend_cls.stage_split(stages, tc.dp)
            backend = backend_cls(named, comm, tc.dp, **kw)
            self.replicas.append(_Replica(model, masker, opt, correction, backend))
        self.global_steps = 0
        self.timing = {"codec_s": 0.0, "forward_s": 0.0, "backward_s": 0.0, "dp_s": 0.0}
        self.step_stats: dict = {}
        self.start_broadcast_bytes = 0
        from ..data import StreamOrigin
        self.data_origin = StreamOrigin()   # moves when a checkpoint of another DP width is resumed
        self.dp_rank = 0
        self._clean_every = tc.clean_every

    # -------------------------------------------------------------- what the trainer reads
    @property
    def codec(self):
        return self.replicas[0].masker.pair(0)[0] if self.plan.pp > 1 else self._unplaced_codec()

    def _unplaced_codec(self):
        """pp = 1 has no boundary: the config's codec, for what the summary reports about it."""
        from ..codecs import make_codec
        if not hasattr(self, "_codec_pp1"):
            self._codec_pp1 = make_codec(self.plan.tc)
        return self._codec_pp1

    def keep_fraction(self, step: int, hidden: int) -> float:
        return self.codec.keep(step, hidden) / hidden

    def lr(self) -> float:
        return self.replicas[0].optimizer.param_groups[0]["lr"]

    def parameter_counts(self) -> tuple[int, int]:
        params = list(self.replicas[0].model.parameters())
        return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)

    # -------------------------------------------------------------- training and evaluation
    def set_train_data(self, seqs, start_step: int) -> None:
        from ..data import MicroBatchStream
        p = self.plan
        self.train_seqs = seqs
        for r, rep in enumerate(self.replicas):
            rep.stream = MicroBatchStream(seqs, p.mb, p.gas, p.dp, r, start_step=start_step,
                                          origin=self.data_origin)

    def clean_step(self, step: int) -> bool:
        """``twocircuit.clean_every`` K: every K-th step trains through dense boundaries."""
        return bool(self._clean_every) and step % self._clean_every == self._clean_every - 1

    def train_batch(self) -> float:
        import time
        step, gas = self.global_steps, self.plan.gas
        clean = self.clean_step(step)

        def replica_step(r: int) -> tuple[float, dict]:
            rep = self.replicas[r]
            rep.model.train()
            rep.optimizer.zero_grad(set_to_none=True)
            rep.masker.dense = clean      # a clean step: dense boundaries, counted as the engine sends them
            total = 0.0
            for m in range(gas):
                x, y = (t.to(self.device) for t in next(rep.stream))
                rep.masker.set_message(step, r * gas + m)
                loss = causal_lm_loss(rep.model(input_ids=x).logits, y)
                (loss / gas).backward()
                total += float(loss.detach())
            rep.masker.dense = False
            t0 = time.perf_counter()
            rep.backend.reduce_gradients(step)
            dp_s = time.perf_counter() - t0
            if self.clip:
                torch.nn.utils.clip_grad_norm_(rep.params, self.clip)
            rep.optimizer.step()
            t0 = time.perf_counter()
            rep.backend.after_optimizer_step(step)
            dp_s += time.perf_counter() - t0
            return total / gas, {"dp_s": dp_s, **rep.backend.pop_step_stats()}
        results = run_replicas(self.group, replica_step, len(self.replicas))
        self.global_steps += 1
        self.timing["dp_s"] += max(r[1]["dp_s"] for r in results)
        self.step_stats = {k: v for k, v in results[0][1].items() if k != "dp_s"}
        for k in ("comm_s", "hidden_comm_s"):   # what every replica spent, as the pipeline's ranks sum it
            self.step_stats[k] = sum(r[1].get(k, 0.0) for r in results)
        self.step_stats["step"] = step
        return sum(r[0] for r in results) / len(results)

    @torch.no_grad()
    def eval_losses(self, seqs, calls: int, dense: bool, bar=None) -> list[float]:
        from ..data import MicroBatchStream
        from ..masks import EVAL_STEP_OFFSET
        p = self.plan
        streams = [MicroBatchStream(seqs, p.mb, p.gas, p.dp, r) for r in range(p.dp)]
        out = []
        for _ in range(calls):
            total = 0.0
            for r, rep in enumerate(self.replicas):
                rep.model.eval()
                rep.masker.dense = dense   # dense evaluation: uncoded, in the wire dtype, counted as pp_eval
                for m in range(p.gas):
                    x, y = (t.to(self.device) for t in next(streams[r]))
                    rep.masker.set_message(EVAL_STEP_OFFSET + self.global_steps, r * p.gas + m)
                    total += float(causal_lm_loss(rep.model(input_ids=x).logits, y))
                rep.masker.dense = False
            out.append(total / (p.dp * p.gas))
            if bar is not None:
                bar.update(1)
        return out

    def anchor_link(self, world):
        return InProcessAnchor(self)

    # -------------------------------------------------------------- state
    def _state(self) -> dict:
        return {"global_steps": self.global_steps, "rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
                "replicas": [{"model": rep.model.state_dict(), "optimizer": rep.optimizer.state_dict(),
                              "dp_backend": rep.backend.state_dict(),
                              "codecs": {b: (pair[0].state_dict(), pair[1].state_dict())
                                         for b, pair in rep.masker.pairs()}}
                             for rep in self.replicas],
                "anchor": getattr(self, "_anchor", None) and self._anchor.state_dict()}

    def save_checkpoint(self, ckpt_dir: str, fault=None) -> str:
        from ..faults import COMMITTED, STATE_DIR, maybe_inject
        from ..files import atomic_write, atomic_write_json
        tag = os.path.join(ckpt_dir, f"global_step{self.global_steps}")
        path = os.path.join(tag, STATE_DIR, "reference.pt")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        state = self._state()
        atomic_write(path, lambda f: torch.save(state, f), binary=True)
        maybe_inject(fault, "kill-in-checkpoint", 0, self.global_steps)
        atomic_write_json(os.path.join(tag, STATE_DIR, COMMITTED),
                          {"global_steps": self.global_steps, "pp": self.plan.pp, "dp": self.plan.dp,
                           "backend": self.plan.tc.dp.backend, "engine": self.kind, "micro_batch_size": self.plan.mb,
                           "origin": self.data_origin.to_dict(),
                           "consumed_micro_batches": self.data_origin.consumed(self.global_steps, self.plan.dp,
                                                                              self.plan.gas)})
        return tag

    def catch_up(self, ckpt_dir: str, step: int, world) -> None:
        """One process, one disk: nothing to fetch."""

    def load_checkpoint(self, path: str) -> int:
        from ..faults import COMMITTED, STATE_DIR, newest_committed
        tag = path
        if not os.path.isfile(os.path.join(tag, STATE_DIR, COMMITTED)):
            newest = newest_committed(path)
            if newest is None:
                raise ConfigError(f"--resume {path!r}: no committed checkpoint")
            tag = newest[1]
        file = os.path.join(tag, STATE_DIR, "reference.pt")
        if not os.path.isfile(file):
            raise ConfigError(f"--resume {path!r}: not a checkpoint of the reference engine ({file} missing)")
        state = torch.load(file, map_location="cpu", weights_only=False)
        meta = json.load(open(os.path.join(tag, STATE_DIR, COMMITTED)))
        from ..data import StreamOrigin
        from . import rescale_resumed_lr
        if meta.get("micro_batch_size", self.plan.mb) != self.plan.mb:
            raise ConfigError(f"--resume: checkpoint trained micro-batches of {meta['micro_batch_size']} sequences, "
                              f"this run {self.plan.mb}; resume with the same --micro-batch-size")
        for key, mine in (("engine", self.kind), ("pp", self.plan.pp), ("backend", self.plan.tc.dp.backend)):
            if meta.get(key, mine) != mine:
                raise ConfigError(f"--resume {path!r}: the checkpoint's {key} is {meta[key]!r}, this run's {mine!r}; "
                                  "resume with the same " + {"engine": "--engine", "pp": "--pp",
                                                             "backend": "twocircuit.dp.backend"}[key])
        replicas = state["replicas"]
        if len(replicas) != len(self.replicas):   # another DP width: every new replica loads the merge
            merged = self._merge(replicas)   # a copy each: load_state_dict may keep the tensors it is given
            replicas = [copy.deepcopy(merged) for _ in self.replicas]
        # the stream goes on at the first unseen sequence, whatever the new width or --grad-accum
        consumed = meta.get("consumed_micro_batches", meta["global_steps"] * len(state["replicas"]) * self.plan.gas)
        self.data_origin = StreamOrigin(meta["global_steps"], consumed)
        for rep, st in zip(self.replicas, replicas):
            rep.model.load_state_dict(st["model"])
            rep.optimizer.load_state_dict(st["optimizer"])
            rescale_resumed_lr(rep.optimizer, self.plan.tc.dp, len(state["replicas"]), len(self.replicas))
            rep.backend.load_state_dict(st["dp_backend"])
            for b, (s_send, s_recv) in st["codecs"].items():
                send, recv = rep.masker.pair(b)
                send.load_state_dict(s_send)
                recv.load_state_dict(s_recv)
        torch.set_rng_state(state["rng"])
        if self.device.type == "cuda" and state.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        self.global_steps = state["global_steps"]
        self._resumed_anchor = state.get("anchor")
        return self.global_steps

    def _merge(self, replicas: list[dict]) -> dict:
        """One replica's state from the old replicas' (as the pipeline's checkpoint loader merges a
        stage's rank files): weights and optimizer moments averaged, the DP backend's and the codecs'
        state by their own rules."""
        from ..codecs import get_codec
        from ..replicas import mean_state
        codec_cls = get_codec(self.plan.tc.mode)
        first = replicas[0]
        return {"model": mean_state([r["model"] for r in replicas]),
                "optimizer": mean_state([r["optimizer"] for r in replicas]),
                "dp_backend": type(self.replicas[0].backend).merge_replica_states(
                    [r["dp_backend"] for r in replicas], self.replicas[0].backend.cfg),
                "codecs": {b: tuple(codec_cls.merge_states([r["codecs"][b][end] for r in replicas]) for end in (0, 1))
                           for b in first["codecs"]}}

    def finalize(self) -> bool:
        results = run_replicas(self.group, lambda r: self.replicas[r].backend.finalize(), len(self.replicas))
        return any(results)

    def replicas_identical(self) -> bool | None:
        if len(self.replicas) == 1:
            return None
        first = self.replicas[0].model.state_dict()
        return all(all(torch.equal(first[k], v) for k, v in rep.model.state_dict().items())
                   for rep in self.replicas[1:])

    def export_hf(self, folder: str, world=None) -> str:
        """Replica 0's model as a Hugging Face folder (a PEFT adapter folder under LoRA)."""
        import shutil
        from ..export import copy_tokenizer
        model = self.replicas[0].model
        tmp = folder + ".partial"
        shutil.rmtree(tmp, ignore_errors=True)
        if self.plan.tc.lora.enabled:
            from ..lora import adapter_state, save_adapter_folder
            state = {}
            for i, layer in enumerate(model.model.layers):
                state.update(adapter_state(layer, f"model.layers.{i}."))
            save_adapter_folder(state, self.plan.tc.lora, self.plan.model_folder, tmp)
        else:
            self.replicas[0].masker.remove()
            try:
                model.save_pretrained(tmp)
            finally:
                self.replicas[0].masker.attach()
        copy_tokenizer(self.plan.model_folder, tmp)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
        return folder


# ------------------------------------------------------------------------------------------ the anchor
class InProcessAnchor:
    """The anchor circuit in one process (see the module docstring); the Trainer drives it like the
    pipeline's ``AnchorLink``: ``maybe_publish(step)`` before the step, ``poll(step)``, ``step_stats``,
    ``finish``. It keeps the pipeline's schedule when the anchor keeps up: Z anchor replicas
    (``anchor.replicas``) average the dense gradients of fast replicas z mod dp's batches; with one fast
    replica, snapshot s's gradients are used at s + every (``scheduled``) or at once (``arrival``);
    with several, the replicas agree through the anchor fence (``anchor/fence.py``): gradients read at
    one fence step are used at the next, every steps later, and each fence's vote is counted. Bytes:
    every replica counts the anchor gradients it reads (as each fast rank does from the store), and each
    snapshot counts its weights' bytes (the pipeline counts its files', a little more)."""

    FENCE_VOTE_BYTES = 8 * 4          # AnchorFence's default 8 slots of int32 flags

    def __init__(self, engine: ReferenceEngine):
        self.engine = engine
        a = engine.plan.tc.anchor
        self.every, self.scheduled, self.z = a.every, a.consume == "scheduled", max(1, a.replicas)
        self.clip = engine.clip if a.correction == "delayed_ef" else 0.0
        self.pending: dict[int, dict] = {}
        self.voted = None                 # (source step, gradients) agreed at the last fence (dp > 1)
        self.updates, self.staleness, self.last_source = 0, [], None
        resumed = getattr(engine, "_resumed_anchor", None)
        if resumed:
            self.pending, self.voted = resumed["pending"], resumed.get("voted")
            self.updates, self.staleness = resumed["updates"], list(resumed["staleness"])
            self.last_source = resumed.get("last_source")
        engine._anchor = self

    def state_dict(self) -> dict:
        return {"pending": self.pending, "voted": self.voted, "updates": self.updates,
                "staleness": list(self.staleness), "last_source": self.last_source}

    def maybe_publish(self, step: int) -> None:
        if step % self.every:
            return
        eng, p = self.engine, self.engine.plan
        rep = eng.replicas[0]             # the snapshot: the first replica's weights
        from ..data import MicroBatchStream
        saved = {n: (q.grad.clone() if q.grad is not None else None) for n, q in rep.model.named_parameters()}
        rep.model.zero_grad(set_to_none=True)
        rep.model.train()
        rep.masker.enabled = False
        try:
            for z in range(self.z):       # anchor replica z: fast replica z mod dp's micro-batches
                stream = MicroBatchStream(eng.train_seqs, p.mb, p.gas, p.dp, z % p.dp, start_step=step,
                                          origin=eng.data_origin)
                for _ in range(p.gas):
                    x, y = next(stream)
                    (causal_lm_loss(rep.model(input_ids=x).logits, y) / (p.gas * self.z)).backward()
        finally:
            rep.masker.enabled = True
        if self.clip:   # after the Z replicas' average, as the anchor circuit clips
            torch.nn.utils.clip_grad_norm_(rep.params, self.clip)
        targets = hf_decoder_matrices(rep.model)
        self.pending[step] = {n: t.grad.detach().clone() for n, t in targets.items() if t.grad is not None}
        for n, q in rep.model.named_parameters():
            q.grad = saved[n]
        # the snapshot crosses to the anchor circuit: its weights (the pipeline counts its files' bytes)
        wire.count("anchor", sum(wire.tensor_bytes(t) for t in rep.model.state_dict().values()))

    def _read(self, step: int):
        """The newest gradients a fast replica may read now (counted for every replica), or None."""
        latest = step - self.every if self.scheduled else step
        ready = [s for s in self.pending if s <= latest and (self.last_source is None or s > self.last_source)]
        if not ready:
            return None
        source = max(ready)
        grads = self.pending.pop(source)
        for older in [s for s in self.pending if s < source]:
            del self.pending[older]
        nbytes = sum(wire.tensor_bytes(g) for g in grads.values())
        for _ in self.engine.replicas:
            wire.count("anchor", nbytes)
        return source, grads

    def poll(self, step: int) -> None:
        replicas = self.engine.replicas
        use = None
        if len(replicas) == 1:
            use = self._read(step)
        elif step % self.every == 0:      # a fence step: use the last vote, read, vote
            use, self.voted = self.voted, None
            got = self._read(step)
            if got is not None:
                self.voted = got
            p = self.engine.plan
            for _ in range(p.pp * p.dp):  # every rank's vote, as AnchorLink counts it
                wire.count("anchor", wire.ring_allreduce_bytes(self.FENCE_VOTE_BYTES, p.dp))
        if use is not None:
            source, grads = use
            for rep in replicas:
                if rep.correction is not None:
                    rep.correction.submit_anchor_gradients(grads, source)
            self.updates += 1
            self.staleness.append(step - source)
            self.last_source = source
        for rep in replicas:
            if rep.correction is not None:
                rep.correction.current_step = step

    def step_stats(self) -> dict:
        s = {"anchor.updates": self.updates, "anchor.wait_s": 0.0}
        if self.staleness:
            s["anchor.staleness"] = self.staleness[-1]
        c = self.engine.replicas[0].correction
        if c is not None:
            s.update({k.replace("/", "."): v for k, v in c.last_stats().items()})
        return s

    def finish(self) -> dict:
        n = len(self.staleness)
        return {"updates": self.updates, "mean_staleness": (sum(self.staleness) / n) if n else None,
                "wait_s": 0.0, "publish_s": 0.0, "refresh_s": 0.0, "every": self.every, "store": None,
                "received_bytes_stage": None}
