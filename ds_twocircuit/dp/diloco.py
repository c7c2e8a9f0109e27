"""DiLoCo and Streaming DiLoCo: local inner steps, rare outer synchronisation.

Papers: Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models"
(2023); Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a Distributed
Free Lunch" (2025).  Design after torchft's ``local_sgd.DiLoCo`` (backup copy, fragments).

Invariant: **the backup copy is the last globally agreed weights** (per fragment, fp32, the same
on every replica).  Each replica runs inner steps on its own gradients (``reduce_gradients`` is a
no-op); when fragment f is due, this rank's pseudo-gradient ``delta = backup - local`` is averaged
over the DP group (plain all-reduce, PowerSGD-compressed with ``compression: "powersgd"``, or
quantised and all-gathered with ``compression: "quant"``, :mod:`ds_twocircuit.dp.quantmean`), the
outer optimizer (SGD with momentum ``outer_momentum``, Nesterov if ``nesterov``, lr ``outer_lr``;
the same update rule as ``torch.optim.SGD``) updates the backup, and the backup is written into the
live parameters.  Without overlap all replicas then hold identical weights for that fragment.

Schedule (``step`` = 0-based optimizer step, checked in ``after_optimizer_step(step)``): with
H = inner_steps, F = num_fragments, offset_f = round(f*H/F) (half up), fragment f syncs after step
``s`` iff ``s >= H-1+offset_f`` and ``(s - (H-1) - offset_f) % H == 0``.  So the first sync of
fragment 0 is after step H-1 (H local steps), every fragment syncs exactly every H steps, and with
1 < F <= H no two fragments (hence never the whole model) sync on the same step.  Plain DiLoCo is
F = 1: syncs after steps H-1, 2H-1, ...

Overlap (Streaming DiLoCo, ``overlap: true``): the all-reduce launched after step s runs in the
background (``async_op=True``) and is finished after step ``s + tau`` (tau = overlap_steps), before
that step's own launches.  The live fragment has meanwhile taken tau more local steps, so it is
merged instead of overwritten.  Two merge rules (``merge_rule``):

- ``"mix"`` (the paper's mixing rule, the default):
  ``local <- merge_alpha * local + (1 - merge_alpha) * backup_new``
  (merge_alpha = 0: replace by the global weights; the default 0.5 is the paper's).  It keeps
  ``merge_alpha`` of the tau local steps taken since the launch, and as much of this replica's
  drift from the others.
- ``"delayed"`` (the delayed outer update of DiLoCoX / PCCL, for tau steps): the outer update is
  applied on top of the local steps taken since the launch, trading this replica's own
  pseudo-gradient for the outer update: ``local <- local + delta_local - outer_lr * update``, i.e.
  ``backup_new + (local - local_at_launch)``.  All tau local steps are kept, and the drift
  between replicas is reset to what those steps added.

The backup is still exactly the outer-updated global fragment.  With PowerSGD compression the
first all-reduce (uncompressed part and P) is launched after step s and the second (Q) after step
``s + ceil(tau / 2)``, so both overlap inner steps when tau >= 2 (with tau = 1 the Q all-reduce
runs at finish time); when Q is launched changes no value, only what overlaps.

Checkpoints: ``state_dict()`` waits for in-flight all-reduces (no new collective is issued, so it
is safe on any subset of ranks) and stores their reduced results; the outer step and merge still
happen at their scheduled step after ``load_state_dict``, so a resumed run is bitwise identical to
an uninterrupted one.  The state is per rank (local error-feedback buffers); save one per DP rank.
No DeepSpeed import.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ds_twocircuit.configkit import ConfigError, key
from ds_twocircuit.dp.base import CoalescedMean, DPBackend, check_finite
from ds_twocircuit.dp.config import (BackendConfig, RunSettings, boolean, float_in, int_in, nested,
                                     setting)
from ds_twocircuit.dp.powersgd import PowerSGDCompressor, PowerSGDConfig
from ds_twocircuit.dp.quantmean import QuantConfig, quantized_mean

# after_optimizer_step rewrites the live (fp16) weights; DeepSpeed's fp16 optimizer would overwrite
# them from its fp32 masters on the next step, silently undoing every outer update
FP16_DILOCO = ("twocircuit.dp.backend = {backend!r} cannot run with fp16.enabled: DeepSpeed's fp16 "
               "optimizer keeps fp32 master weights that would overwrite each outer (DiLoCo) update on "
               "the next step; train in fp32 (or bf16 with torch_autocast), or use backend 'powersgd' / "
               "'allreduce' with fp16")


MERGE_RULES = ("mix", "delayed")


def _merge_rule(v, name):
    if v not in MERGE_RULES:
        raise ConfigError(f"{name} must be one of {', '.join(repr(r) for r in MERGE_RULES)}, got {v!r}")
    return v


def _compression(v, name):
    if v not in (None, "powersgd", "quant"):
        raise ConfigError(f"{name} must be null, \"powersgd\" or \"quant\", got {v!r}")
    return v


INNER_LR_SCALES = ("sqrt_replicas",)


def _inner_lr_scale(v, name):
    """A number > 0, or "sqrt_replicas" (sqrt of the DP width, resolved when the run starts)."""
    if isinstance(v, str):
        if v not in INNER_LR_SCALES:
            raise ConfigError(f"{name} must be a number > 0 or \"sqrt_replicas\", got {v!r}")
        return v
    return float_in(0.0, lo_open=True)(v, name)


def _where(where: str) -> str:
    return f"{where}: " if where else ""


@dataclass(frozen=True)
class DiLoCoConfig(BackendConfig):
    """``"dp": {"backend": "diloco", ...}``, defaults in brackets::

        "inner_steps": int >= 1 (H)          [10]
        "outer_lr": float > 0                [0.7]
        "outer_momentum": float in [0, 1)    [0.9]
        "nesterov": bool                     [true]
        "compression": null | "powersgd" | "quant"   [null]  of the pseudo-gradients
        "final_outer_lr": float > 0          [1.0]  the end-of-run exact average as an outer step:
                                             backup + final_outer_lr * (mean - backup) on each
                                             fragment that drifted since its last sync (1: the
                                             plain average; no momentum, no extra bytes)
        "inner_lr_scale": float > 0 | "sqrt_replicas"   [1.0]  multiplies the optimizer's lr
                                             (and a scheduler's lrs) on every replica;
                                             "sqrt_replicas": sqrt(N) on N DP replicas. The mean of
                                             N replicas' Adam updates on 1/N of the batch each moves
                                             about 1/sqrt(N) as far as one update on the whole
                                             batch where the gradient is mostly noise (docs/notes.md)
        "powersgd": {...}                    only with compression "powersgd" (PowerSGDConfig)
        "quant": {...}                       only with compression "quant" (QuantConfig: bits,
                                             block, error_feedback)
    """
    backend: str = "diloco"
    powersgd: PowerSGDConfig = setting(default_factory=PowerSGDConfig, check=nested(PowerSGDConfig))
    quant: QuantConfig = setting(default_factory=QuantConfig, check=nested(QuantConfig))
    inner_steps: int = setting(10, check=int_in(1))
    outer_lr: float = setting(0.7, check=float_in(0.0, lo_open=True))
    outer_momentum: float = setting(0.9, check=float_in(0.0, 1.0, hi_open=True))
    nesterov: bool = setting(True, check=boolean)
    compression: str | None = setting(None, check=_compression)
    final_outer_lr: float = setting(1.0, check=float_in(0.0, lo_open=True))
    inner_lr_scale: float | str = setting(1.0, check=_inner_lr_scale)

    def check_consistency(self, given: frozenset, prefix: str) -> None:
        for block in ("powersgd", "quant"):
            if block in given and self.compression != block:
                raise ConfigError(f"{key(prefix, block)} is set but {key(prefix, 'compression')} is "
                                  f"{self.compression!r}; set compression: \"{block}\" or remove the {block} block")

    def inner_lr_factor(self, replicas: int) -> float:
        """``inner_lr_scale`` on ``replicas`` DP replicas: the number, or sqrt(replicas)."""
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        if self.inner_lr_scale == "sqrt_replicas":
            return math.sqrt(replicas)
        return float(self.inner_lr_scale)

    def sync_schedule(self) -> tuple[int, int, int]:
        """The whole model every H steps, blocking."""
        return self.inner_steps, self.inner_steps, 0

    def check_run(self, run: RunSettings, where: str = "") -> None:
        """Replicas must stay apart between syncs and keep each outer update: ZeRO (any stage)
        re-syncs them every step; fp16's masters, and bf16's optimizer under a pipeline, overwrite
        the update."""
        w = _where(where)
        if run.zero_stage >= 1:
            raise ConfigError(f"{w}twocircuit.dp.backend = {self.backend!r} keeps replicas apart "
                              f"between syncs; zero_optimization.stage = {run.zero_stage} re-syncs "
                              "them every step. Use stage 0.")
        if run.fp16:
            raise ConfigError(w + FP16_DILOCO.format(backend=self.backend))
        if run.bf16 and run.pp > 1:
            raise ConfigError(f"{w}twocircuit.dp.backend = {self.backend!r} cannot run with "
                              "bf16.enabled under pipeline parallelism (DeepSpeed's BF16 optimizer "
                              "re-syncs replicas every step); use fp32 or fp16")


@dataclass(frozen=True)
class StreamingDiLoCoConfig(DiLoCoConfig):
    """``"dp": {"backend": "streaming_diloco", ...}``: DiLoCo's keys and, defaults in brackets::

        "num_fragments": int, 1 <= F <= H    [4]
        "overlap": bool                      [true]
        "overlap_steps": int, 1 <= tau < H   [1]    only with overlap
        "merge_rule": "mix" | "delayed"      ["mix"] only with overlap
        "merge_alpha": float in [0, 1]       [0.5]  only with overlap and merge_rule "mix"
    """
    backend: str = "streaming_diloco"
    num_fragments: int = setting(4, check=int_in(1))
    overlap: bool = setting(True, check=boolean)
    overlap_steps: int = setting(1, check=int_in(1))
    merge_alpha: float = setting(0.5, check=float_in(0.0, 1.0))
    merge_rule: str = setting("mix", check=_merge_rule)

    def check_consistency(self, given: frozenset, prefix: str) -> None:
        if self.num_fragments > self.inner_steps:
            raise ConfigError(f"{key(prefix, 'num_fragments')} must be <= "
                              f"{key(prefix, 'inner_steps')} ({self.inner_steps}) so that no two "
                              f"fragments sync on the same step; got {self.num_fragments}")
        super().check_consistency(given, prefix)
        if not self.overlap:
            for k in ("overlap_steps", "merge_alpha", "merge_rule"):
                if k in given:
                    raise ConfigError(f"{key(prefix, k)} only applies with "
                                      f"{key(prefix, 'overlap')}=true")
        if self.merge_rule != "mix" and "merge_alpha" in given:
            raise ConfigError(f"{key(prefix, 'merge_alpha')} only applies with "
                              f"{key(prefix, 'merge_rule')}=\"mix\" (it is {self.merge_rule!r})")
        elif self.overlap_steps >= self.inner_steps:
            raise ConfigError(f"{key(prefix, 'overlap_steps')} must be < "
                              f"{key(prefix, 'inner_steps')} ({self.inner_steps}) so a fragment's "
                              f"sync finishes before its next one starts; got {self.overlap_steps}")

    def sync_schedule(self) -> tuple[int, int, int]:
        """One of F fragments every H / F steps, behind ``overlap_steps`` steps when overlapping."""
        return (self.inner_steps, max(1, self.inner_steps // self.num_fragments),
                self.overlap_steps if self.overlap else 0)

    def check_run(self, run: RunSettings, where: str = "") -> None:
        """DiLoCo's rules, and: the two copies of a tied embedding on different pipeline stages
        would sync in different fragments (at different steps), so they would drift apart."""
        super().check_run(run, where)
        if run.model_tied and run.tied_embeddings == "sync" and run.pp > 1:
            raise ConfigError(f"{_where(where)}twocircuit.dp.backend = {self.backend!r} with "
                              "twocircuit.tied_embeddings = 'sync' would sync the two copies of the "
                              "tied embedding in different fragments (they drift apart); use 'untie' "
                              "or 'freeze'")


def split_fragments(numels, num_fragments: int) -> list[list[int]]:
    """Split indices 0..n-1 into ``num_fragments`` contiguous non-empty runs balanced by numel."""
    n = len(numels)
    if n == 0 and num_fragments >= 1:  # a stage without trainable parameters: nothing to sync
        return [[] for _ in range(num_fragments)]
    if not 1 <= num_fragments <= n:
        raise ValueError(f"twocircuit.dp.num_fragments must be in [1, {n}] (the number of "
                         f"trainable parameters of this stage), got {num_fragments}")
    prefix = [0]
    for k in numels:
        prefix.append(prefix[-1] + k)
    cuts, prev = [], 0
    for j in range(1, num_fragments):
        target = j * prefix[-1] / num_fragments
        lo, hi = prev + 1, n - (num_fragments - j)
        prev = min(range(lo, hi + 1), key=lambda c: (abs(prefix[c] - target), c))
        cuts.append(prev)
    bounds = [0, *cuts, n]
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


class _Sync:
    """One in-flight fragment sync: its pseudo-gradient buffers and the reduction round."""

    def __init__(self, fragment: int, launched: int, due: int, q_due: int, deltas, rnd):
        # q_due: with PowerSGD, the step after which the second (Q) all-reduce is launched
        self.fragment, self.launched, self.due, self.q_due, self.deltas, self.round = (
            fragment, launched, due, q_due, deltas, rnd)


class DiLoCo(DPBackend):
    """H local steps, then an outer Nesterov step on the DP-averaged pseudo-gradient."""

    backend_name = "diloco"
    config_class = DiLoCoConfig
    replicas_may_differ = True
    loop_bytes_dtype = "fp32"   # pseudo-gradients formed in fp32 (or 'quant''s fixed-width codes)

    def __init__(self, named_params, comm, cfg, fragments=None):
        super().__init__(named_params, comm, cfg)
        c = self.cfg
        self.inner_steps = c.inner_steps
        self._setup_streaming(c)
        if fragments is None:
            self.fragments = split_fragments([p.numel() for p in self.params], self.num_fragments)
        else:
            self.fragments = self._fragments_from_names(fragments)
        F, H = self.num_fragments, self.inner_steps
        self.offsets = [(2 * f * H + F) // (2 * F) for f in range(F)]
        self.backup = [p.detach().to(torch.float32, copy=True) for p in self.params]
        self.momentum = ([torch.zeros_like(b) for b in self.backup]
                         if c.outer_momentum > 0 else None)
        self.compressor = PowerSGDCompressor(c.powersgd) if c.compression == "powersgd" else None
        self.quant = c.quant if c.compression == "quant" else None
        # this replica's quantisation residuals (error feedback), one per parameter, fp32
        self.quant_errors = ([torch.zeros_like(b) for b in self.backup]
                             if self.quant is not None and self.quant.error_feedback else None)
        # "reduce_scatter": the residual of re-quantising the mean of the chunk this replica owns,
        # one per fragment (its chunks depend on the width: dropped when the width changes)
        self.quant_owner_errors = None
        if self.quant is not None and self.quant.collective == "reduce_scatter" and self.quant.error_feedback:
            dev = self.backup[0].device if self.backup else None
            self.quant_owner_errors = [
                torch.zeros(self.quant.chunk_numel(sum(self.backup[i].numel() for i in frag), self.world_size),
                            dtype=torch.float32, device=dev) for frag in self.fragments]
        self.pending: dict[int, _Sync] = {}
        self.last_step = -1
        # fragments whose live weights may differ between replicas (local steps since their last
        # sync, or a merge after an overlapped sync); finalize() syncs only these
        self.dirty = [False] * self.num_fragments

    def _setup_streaming(self, c) -> None:
        self.num_fragments, self.overlap, self.overlap_steps, self.merge_alpha = 1, False, 0, 0.0
        self.merge_rule = "mix"

    @property
    def _two_phase(self) -> bool:
        """Rounds of two collectives, the second launched at ``q_due`` (PowerSGD's P and Q; the
        quantised reduce-scatter's chunks and means)."""
        return self.compressor is not None or (self.quant is not None and self.quant.collective == "reduce_scatter")

    @property
    def _delayed(self) -> bool:
        return self.overlap and self.merge_rule == "delayed"

    def _q_due(self, launched: int) -> int:
        return launched + max(1, (self.overlap_steps + 1) // 2)

    def _fragments_from_names(self, fragments) -> list[list[int]]:
        pos = {n: i for i, n in enumerate(self.names)}
        out = [[pos[n] for n in frag if n in pos] for frag in fragments]
        flat = sorted(i for frag in out for i in frag)
        if len(out) != self.num_fragments or flat != list(range(len(self.names))) or not all(out):
            raise ValueError(f"fragments must be {self.num_fragments} non-empty lists "
                             "(twocircuit.dp.num_fragments) that partition the trainable "
                             "parameter names")
        return out

    # --- schedule ---------------------------------------------------------------------------
    def sync_schedule(self, step: int) -> list[int]:
        """Fragments whose sync is launched after optimizer step ``step``."""
        H = self.inner_steps
        return [f for f, o in enumerate(self.offsets)
                if step - (H - 1) - o >= 0 and (step - (H - 1) - o) % H == 0]

    # --- protocol ---------------------------------------------------------------------------
    def reduce_gradients(self, step: int) -> None:
        return None  # inner steps are local: p.grad is left untouched

    def after_optimizer_step(self, step: int) -> bool:
        if step <= self.last_step:
            raise ValueError(f"after_optimizer_step({step}) after step {self.last_step}: "
                             "steps must increase")
        self.last_step = step
        self.dirty = [True] * self.num_fragments  # this step's local update touched every fragment
        changed, done, launched = False, [], []
        for f in sorted(self.pending):
            if self.pending[f].due <= step:
                self._finish(self.pending.pop(f))
                changed = True
                done.append(f)
        if self._two_phase:  # the second collective of syncs still in flight
            for f in sorted(self.pending):
                if self.pending[f].q_due <= step:
                    self.pending[f].round.launch_q()
        for f in self.sync_schedule(step):
            sync = self._launch(f, step)
            launched.append(f)
            if self.overlap:
                self.pending[f] = sync
            else:
                self._finish(sync)
                changed = True
                done.append(f)
        if self.compressor is not None and (launched or done):
            self._step_stats.update(self.compressor.pop_stats())
        self._step_stats.update(synced_fragments=launched, completed_fragments=done)
        return changed

    def flush(self) -> bool:
        """Finish every in-flight sync now (end of training)."""
        done = sorted(self.pending)
        for f in done:
            self._finish(self.pending.pop(f))
        if done:
            self._step_stats.setdefault("completed_fragments", []).extend(done)
        return bool(done)

    # End of training (DPBackend.finalize, the one averaging path): the exact average covers
    # each fragment that took local steps since its last sync; fragments synced on the last step
    # cost nothing. Measured on SmolLM2 (docs/benchmarks/dp.md, held-out loss vs all-reduce after
    # 40 steps): exact average +1.9%; an outer Nesterov step here, which extrapolates past the
    # replicas, +7.5%; a PowerSGD-compressed average +2.7%. The exact average is a one-off cost
    # per run, like saving a checkpoint, and is reported apart (``dp_final_sync_bytes``).
    # ``final_outer_lr`` (default 1, the plain average) scales the averaged drift since each
    # fragment's backup, without momentum: with two replicas the averaged half-batch AdamW steps
    # move the model about 1/sqrt(2) as far as whole-batch ones (docs/benchmarks/fullstack_screen.md),
    # which the in-loop outer lr makes up for and a plain final average does not. Measured at 1.5:
    # no gain on deepspeed-cpp (41 steps), a cost on sympy (250k tokens), hence the default.
    def _drifted_groups(self) -> list[list[int]]:
        self._final = [f for f in range(self.num_fragments) if self.dirty[f]]
        if self._final:
            self._step_stats["final_synced_fragments"] = list(self._final)
        return [list(self.fragments[f]) for f in self._final]

    def _after_final_average(self, group: int, idx: list[int]) -> None:
        lr = self.cfg.final_outer_lr
        with torch.no_grad():
            for i in idx:
                p = self.params[i]
                if lr != 1.0:   # backup + lr * (mean - backup): the same on every replica (both are)
                    p.copy_(torch.lerp(self.backup[i], p.detach().to(torch.float32), lr))
                self.backup[i].copy_(p.detach())  # the outer state restarts from the average
        self.dirty[self._final[group]] = False

    def replicas_in_sync(self) -> bool:
        return self.world_size <= 1 or not (any(self.dirty) or self.pending)

    def _final_step(self) -> int:
        return self.last_step

    def reset_backup(self) -> None:
        """Restart the outer optimizer from the live parameters (e.g. after loading plain model
        weights without backend state): backup := params, momentum and PowerSGD state cleared.
        All replicas must hold identical parameters when this is called."""
        if self.pending:
            raise RuntimeError("reset_backup() with syncs in flight; call flush() first")
        for b, p in zip(self.backup, self.params):
            b.copy_(p.detach())
        for m in self.momentum or []:
            m.zero_()
        if self.compressor is not None:
            self.compressor = PowerSGDCompressor(self.cfg.powersgd)
        for e in [*(self.quant_errors or []), *(self.quant_owner_errors or [])]:
            e.zero_()

    # --- the algorithm ----------------------------------------------------------------------
    def _launch(self, f: int, step: int) -> _Sync:
        idx = self.fragments[f]
        names = [self.names[i] for i in idx]
        deltas = [self.backup[i] - self.params[i].detach().to(torch.float32) for i in idx]
        check_finite(step, names, deltas, what="pseudo-gradient")
        if self.compressor is not None:
            dense = step < self.cfg.powersgd.start_powerSGD_iter
            rnd = self.compressor.start(deltas, names, self.comm, dense=dense,
                                        async_op=self.overlap)
        elif self.quant is not None:
            errors = [self.quant_errors[i] for i in idx] if self.quant_errors is not None else None
            owner = self.quant_owner_errors[f] if self.quant_owner_errors is not None else None
            rnd = quantized_mean(deltas, self.comm, self.quant, errors=errors, owner_error=owner,
                                 async_op=self.overlap)
        else:
            rnd = CoalescedMean(deltas, self.comm, async_op=self.overlap)
        return _Sync(f, step, step + self.overlap_steps, self._q_due(step), deltas, rnd)

    def _finish(self, sync: _Sync) -> None:
        delayed = self._delayed
        # the delayed rule needs this replica's own pseudo-gradient, which finish() overwrites
        local = [d.clone() for d in sync.deltas] if delayed else None
        sync.round.finish()  # deltas now hold the DP-averaged pseudo-gradient
        c, mu = self.cfg, self.cfg.outer_momentum
        with torch.no_grad():
            for k, (i, g) in enumerate(zip(self.fragments[sync.fragment], sync.deltas)):
                b = self.backup[i]
                if self.momentum is not None:
                    buf = self.momentum[i].mul_(mu).add_(g)
                    g = g.add(buf, alpha=mu) if c.nesterov else buf
                b.sub_(g, alpha=c.outer_lr)
                p = self.params[i]
                if delayed:   # backup_new + (local - local_at_launch)
                    p.copy_(p.to(torch.float32).add_(local[k]).sub_(g, alpha=c.outer_lr))
                elif self.overlap and self.merge_alpha > 0:
                    p.copy_(torch.lerp(b, p.to(torch.float32), self.merge_alpha))
                else:
                    p.copy_(b)
        # replicas agree on this fragment iff it was overwritten by the backup
        self.dirty[sync.fragment] = self.overlap and (delayed or self.merge_alpha > 0)

    # --- checkpointing ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        pending = []
        for f in sorted(self.pending):
            s = self.pending[f]
            if self.compressor is not None:
                rnd = s.round.state()
            elif self.quant is not None:
                rnd = s.round.wait_reduced().clone()     # every replica's payload
            else:
                rnd = [t.clone() for t in s.round.wait_reduced()]
            pending.append({"fragment": f, "launched": s.launched, "due": s.due, "round": rnd,
                            # the delayed merge rule's own pseudo-gradient (finish overwrites it)
                            "local": [d.clone() for d in s.deltas] if self._delayed else None})
        return {
            **super().state_dict(),
            "backup": [b.clone() for b in self.backup],
            "momentum": None if self.momentum is None else [m.clone() for m in self.momentum],
            "compressor": None if self.compressor is None else self.compressor.state_dict(),
            "quant_errors": None if self.quant_errors is None else [e.clone() for e in self.quant_errors],
            "quant_owner_errors": (None if self.quant_owner_errors is None
                                   else [e.clone() for e in self.quant_owner_errors]),
            "fragments": [[self.names[i] for i in frag] for frag in self.fragments],
            "inner_steps": self.inner_steps, "last_step": self.last_step, "pending": pending,
            "dirty": list(self.dirty),
        }

    @classmethod
    def merge_replica_states(cls, states: list[dict], cfg=None) -> dict:
        """Backups, outer momentum and the schedule are agreed (from the first replica). Syncs in
        flight are dropped: the merged local weights (the replicas' average, which the checkpoint
        loader takes) already hold their progress, and the next sync of those fragments sends it
        again. The error-feedback buffers hold the residual of each fragment's last completed round
        (a round writes its buffer when it finishes, not when it is launched), still owed: averaged
        (or reset: ``cfg.powersgd.error_feedback_on_resize``).
        Every fragment counts as drifted (the end-of-run average stays exact)."""
        first = states[0]
        comp = None
        if first["compressor"] is not None:
            from .powersgd import merge_compressor_states
            comp = merge_compressor_states([s["compressor"] for s in states], cfg.powersgd if cfg is not None else None)
        errors = None
        if first.get("quant_errors") is not None:   # each replica's residual is still owed: averaged
            errors = [torch.stack([s["quant_errors"][i] for s in states]).mean(0)
                      for i in range(len(first["quant_errors"]))]
        # the owners' residuals belong to the old width's chunks: dropped
        return {**first, "compressor": comp, "quant_errors": errors, "quant_owner_errors": None, "pending": [],
                "dirty": [True] * len(first["fragments"])}

    def load_state_dict(self, sd: dict) -> None:
        super().load_state_dict(sd)
        frags = [[self.names[i] for i in frag] for frag in self.fragments]
        if sd["pending"] and (sd["fragments"] != frags or sd["inner_steps"] != self.inner_steps):
            raise ValueError("cannot resume in-flight syncs with a different fragment split or "
                             "twocircuit.dp.inner_steps")
        if (sd["momentum"] is None) != (self.momentum is None):
            raise ValueError("state and config disagree on twocircuit.dp.outer_momentum > 0")
        if (sd["compressor"] is None) != (self.compressor is None):
            raise ValueError("state and config disagree on twocircuit.dp.compression")
        for b, t in zip(self.backup, sd["backup"]):
            b.copy_(t)
        if self.momentum is not None:
            for m, t in zip(self.momentum, sd["momentum"]):
                m.copy_(t)
        if self.compressor is not None:
            dev = self.backup[0].device if self.backup else None
            self.compressor.load_state_dict(sd["compressor"], device=dev)
        if (sd.get("quant_errors") is None) != (self.quant_errors is None):
            raise ValueError("state and config disagree on twocircuit.dp.compression \"quant\" with "
                             "quant.error_feedback")
        for e, t in zip(self.quant_errors or [], sd.get("quant_errors") or []):
            e.copy_(t)
        owners = sd.get("quant_owner_errors")
        if owners is not None and self.quant_owner_errors is None:
            raise ValueError("state and config disagree on twocircuit.dp.quant.collective \"reduce_scatter\" "
                             "with quant.error_feedback")
        for k, e in enumerate(self.quant_owner_errors or []):
            if owners is None:       # saved at another width (merged) or before: nothing owed here
                e.zero_()
            elif owners[k].numel() != e.numel():
                raise ValueError(f"state holds owner residuals of {owners[k].numel()} values for fragment {k}, "
                                 f"this width's chunks have {e.numel()}")
            else:
                e.copy_(owners[k])
        self.last_step = int(sd["last_step"])
        self.dirty = [bool(d) for d in sd.get("dirty", [self.last_step >= 0] * self.num_fragments)]
        self.pending = {}
        for rec in sd["pending"]:
            f = rec["fragment"]
            deltas = [torch.zeros_like(self.backup[i]) for i in self.fragments[f]]
            if self._delayed:
                if rec.get("local") is None:
                    raise ValueError("cannot resume an in-flight sync with twocircuit.dp.merge_rule "
                                     "\"delayed\" from a checkpoint saved without it")
                for d, t in zip(deltas, rec["local"]):
                    d.copy_(t)
            if self.compressor is not None:
                rnd = self.compressor.restore_round(rec["round"], deltas, self.comm)
            elif self.quant is not None:
                rnd = quantized_mean(deltas, self.comm, self.quant, gathered=rec["round"])
            else:
                rnd = CoalescedMean(deltas, self.comm, flats=rec["round"])
            self.pending[f] = _Sync(f, rec["launched"], rec["due"], self._q_due(rec["launched"]),
                                    deltas, rnd)


class StreamingDiLoCo(DiLoCo):
    """DiLoCo over F staggered fragments, optionally overlapping each sync with tau inner steps.

    ``fragments``: optional explicit split, a list of F lists of parameter names (e.g. to keep
    tied weights of different pipeline stages in the same fragment); default: contiguous runs by
    parameter order, balanced by numel.
    """

    backend_name = "streaming_diloco"
    config_class = StreamingDiLoCoConfig
    splits_by_stage = True

    @classmethod
    def stage_split(cls, stages, cfg) -> dict:
        """Fragment f is the union of every stage's fragment f, each stage split as its own backend
        splits it (contiguous runs balanced by numel), so every parameter syncs on the steps it
        syncs on in the pipeline."""
        frags = [[] for _ in range(cfg.num_fragments)]
        for named in stages:
            for f, idx in enumerate(split_fragments([n for _, n in named], cfg.num_fragments)):
                frags[f] += [named[i][0] for i in idx]
        return {"fragments": frags}

    def _setup_streaming(self, c) -> None:
        self.num_fragments, self.overlap = c.num_fragments, c.overlap
        self.overlap_steps = c.overlap_steps if c.overlap else 0
        self.merge_alpha = c.merge_alpha if c.overlap else 0.0
        self.merge_rule = c.merge_rule if c.overlap else "mix"
