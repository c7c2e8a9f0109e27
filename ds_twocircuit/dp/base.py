"""Common interface of the data-parallel (DP) synchronisation backends and the pieces they share.

A backend replaces DeepSpeed's own DP gradient all-reduce (switched off by the engine adapter via
``pipeline_enable_backward_allreduce = False``).  The adapter calls, on every optimizer step::

    backend.reduce_gradients(step)      # after backward, before optimizer.step()
    optimizer.step()
    backend.after_optimizer_step(step)  # may overwrite the live parameters (DiLoCo outer sync)

``step`` is the 0-based number of the optimizer step being taken.  It is the only clock the
backends use, so a resumed run must pass the same numbers.

Invariants kept by every backend here:
  * every collective is an all-reduce (or, for quantised pseudo-gradients, an all-gather, or an
    all-to-all and an all-gather) over the DP ``group`` and is counted in :mod:`ds_twocircuit.wire`
    as kind ``"dp"`` with the bytes this rank sends in a ring all-reduce (all-gather, all-to-all);
  * nothing non-finite is ever reduced: one fused finiteness check per step runs before the first
    collective and raises :class:`NonFiniteGradientError` (naming the step and the parameter), so a
    NaN/inf never reaches the other replicas.

Transport: a :class:`Communicator` (world size, rank, in-place sum all-reduce, all-gather). The adapters
implement it with ``torch.distributed`` (:class:`ds_twocircuit.adapters.comm.TorchComm`); nothing
here imports ``torch.distributed`` or DeepSpeed.
"""
from __future__ import annotations

import time

import torch

from ds_twocircuit import wire
from ds_twocircuit.dp.config import BackendConfig, OptionsConfig

# Cap on one coalesced all-reduce, in elements, so the flat copy stays bounded for big stages.
BUCKET_NUMEL = 1 << 26


class NonFiniteGradientError(FloatingPointError):
    """A gradient or pseudo-gradient holds NaN/inf; raised before any collective was issued."""

    def __init__(self, step: int, param_name: str, what: str = "gradient"):
        self.step, self.param_name, self.what = step, param_name, what
        super().__init__(f"non-finite {what} at step {step} in parameter {param_name!r}; "
                         "no collective was issued, so the other replicas are unaffected")


def check_finite(step: int, names, tensors, what: str = "gradient") -> None:
    """One fused check (a single host sync) over all ``tensors``; raise naming the first bad one."""
    if not tensors:
        return
    # One fused pass: a NaN/inf anywhere makes that tensor's norm non-finite (no per-element
    # boolean copies; a finite tensor whose norm overflows fp32 is absurd enough to refuse too).
    norms = torch._foreach_norm([t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
                                 for t in tensors])
    flags = torch.isfinite(torch.stack([n.to(norms[0].device) for n in norms]))
    if bool(flags.all()):
        return
    first = int((~flags).nonzero()[0, 0])
    raise NonFiniteGradientError(step, names[first], what)


class Pending:
    """Handle of one collective; ``wait()`` is idempotent and books the timing on ``owner.stats``
    as they are at the wait (a collective launched in one step and waited for in a later one counts
    in the later step's stats: the launch step's were already handed out)."""

    def __init__(self, owner=None, work=None, t_launch: float = 0.0):
        self._owner, self._work, self._t0 = owner, work, t_launch
        self._done_at = None
        self._fut = None
        if work is not None:
            self._fut = work.get_future().then(self._mark_done)

    def _mark_done(self, fut):  # runs on the comm thread when the collective completes
        self._done_at = time.perf_counter()

    @property
    def done(self) -> bool:
        return self._work is None

    def wait(self) -> None:
        if self._work is None:
            return
        t_wait = time.perf_counter()
        self._work.wait()  # raises if the collective failed
        self._fut.wait()   # the completion time has been recorded after this
        t_end = time.perf_counter()
        done = self._done_at if self._done_at is not None else t_end
        stats = self._owner.stats
        stats["comm_s"] += done - self._t0
        # Seconds of this collective that ran while the caller did something else.
        stats["hidden_comm_s"] += max(0.0, min(done, t_wait) - self._t0)
        self._work = self._fut = None


def _empty_stats() -> dict:
    return {"bytes_sent": 0, "collectives": 0, "comm_s": 0.0, "hidden_comm_s": 0.0}


class Communicator:
    """What a DP backend needs from the transport between replicas.

    ``world_size`` and ``rank`` (this replica's index), and ``all_reduce_sum(t, async_op)``: sum
    ``t`` in place over the replicas; return ``None`` when blocking, or a handle with ``wait()``
    and ``get_future()`` (the interface of a ``torch.distributed`` work object) when ``async_op``.
    """

    world_size: int = 1
    rank: int = 0

    def all_reduce_sum(self, t: torch.Tensor, async_op: bool = False):
        raise NotImplementedError

    def all_gather_into(self, out: torch.Tensor, t: torch.Tensor, async_op: bool = False):
        """Fill the flat ``out`` (``world_size * t.numel()`` elements) with every replica's ``t``
        in rank order; returns as :meth:`all_reduce_sum` does."""
        raise NotImplementedError(f"{type(self).__name__} has no all-gather")

    def all_to_all_into(self, out: torch.Tensor, t: torch.Tensor, async_op: bool = False):
        """``t`` and ``out`` hold ``world_size`` equal rows: row j of ``t`` goes to replica j, and
        row i of ``out`` is what replica i sent this one; returns as :meth:`all_reduce_sum` does."""
        raise NotImplementedError(f"{type(self).__name__} has no all-to-all")


class LocalComm(Communicator):
    """The world of one replica: nothing to reduce."""

    def all_reduce_sum(self, t: torch.Tensor, async_op: bool = False):
        return None

    def all_gather_into(self, out: torch.Tensor, t: torch.Tensor, async_op: bool = False):
        out.copy_(t.reshape(-1))
        return None

    def all_to_all_into(self, out: torch.Tensor, t: torch.Tensor, async_op: bool = False):
        out.copy_(t)
        return None


class Collective:
    """Sum all-reduce over the DP replicas with byte accounting; a no-op for one replica."""

    def __init__(self, comm: Communicator | None = None):
        self.comm = comm if comm is not None else LocalComm()
        self.world_size = self.comm.world_size
        self.stats = _empty_stats()

    def _issue(self, nbytes: int, call, async_op: bool) -> Pending:
        """Count ``nbytes`` as this rank's DP bytes and run ``call(async_op)`` (a no-op for one replica)."""
        wire.count("dp", nbytes, messages=1 if self.world_size > 1 else 0)
        if self.world_size == 1:
            return Pending()
        self.stats["bytes_sent"] += nbytes
        self.stats["collectives"] += 1
        t0 = time.perf_counter()
        if not async_op:
            call(False)
            self.stats["comm_s"] += time.perf_counter() - t0
            return Pending()
        return Pending(self, call(True), t0)

    def all_reduce_sum(self, t: torch.Tensor, async_op: bool = False) -> Pending:
        nbytes = wire.ring_allreduce_bytes(wire.tensor_bytes(t), self.world_size)
        return self._issue(nbytes, lambda a: self.comm.all_reduce_sum(t, async_op=a), async_op)

    def all_gather(self, t: torch.Tensor, async_op: bool = False) -> tuple[torch.Tensor, Pending]:
        """Every replica's ``t`` (flat) as rows of a ``(world_size, t.numel())`` tensor, rank order;
        counted as the bytes this rank sends in a ring all-gather."""
        out = torch.empty(self.world_size, t.numel(), dtype=t.dtype, device=t.device)
        if self.world_size == 1:
            out[0].copy_(t.reshape(-1))
        src = t.reshape(-1).contiguous()
        nbytes = wire.ring_allgather_bytes(wire.tensor_bytes(t), self.world_size)
        return out, self._issue(nbytes, lambda a: self.comm.all_gather_into(out.view(-1), src, async_op=a), async_op)

    def all_to_all(self, t: torch.Tensor, async_op: bool = False) -> tuple[torch.Tensor, Pending]:
        """``t``: ``(world_size, k)``, row j for replica j. Returns the ``(world_size, k)`` rows the
        replicas sent this one (rank order); counted as the ``world_size - 1`` rows this rank sends."""
        if t.dim() != 2 or t.shape[0] != self.world_size:
            raise ValueError(f"all_to_all needs a (world_size={self.world_size}, k) tensor, got {tuple(t.shape)}")
        src = t.contiguous()
        out = torch.empty_like(src)
        if self.world_size == 1:
            out.copy_(src)
        nbytes = wire.alltoall_bytes(wire.tensor_bytes(src), self.world_size)
        return out, self._issue(nbytes, lambda a: self.comm.all_to_all_into(out, src, async_op=a), async_op)

    def pop_stats(self) -> dict:
        s, self.stats = self.stats, _empty_stats()
        return s


HALF_DTYPES = (torch.bfloat16, torch.float16)


def final_average_bytes(numel: int, dtype: torch.dtype, world: int) -> int:
    """Bytes one replica sends in :meth:`DPBackend.finalize` to average ``numel`` weights held in
    ``dtype``: an all-gather of the half-precision values where that is cheaper than an fp32
    all-reduce (fewer than four replicas), else the fp32 all-reduce."""
    fp32 = wire.ring_allreduce_bytes(numel * 4, world)
    if dtype in HALF_DTYPES:
        return min(fp32, wire.ring_allgather_bytes(numel * 2, world))
    return fp32


def _gather_halves(tensors, world: int) -> bool:
    """Whether :meth:`DPBackend.finalize` all-gathers ``tensors`` as they are: one half-precision
    dtype, one device, and fewer bytes than the fp32 all-reduce."""
    kinds = {(t.dtype, t.device) for t in tensors}
    if len(kinds) != 1:
        return False
    dtype = next(iter(kinds))[0]
    n = 1 << 20
    return dtype in HALF_DTYPES and final_average_bytes(n, dtype, world) < final_average_bytes(n, torch.float32, world)


class GatheredMean:
    """Average ``tensors`` (one dtype and device) over the DP group in place: all-gather them as
    they are, in buckets of at most BUCKET_NUMEL elements, and sum every replica's copy in fp32 in
    rank order (the same arithmetic on the same values, so the same result on every replica)."""

    def __init__(self, tensors, comm: Collective):
        self.tensors, self.world = list(tensors), comm.world_size
        self.buckets = CoalescedMean._bucketize(self.tensors)
        self.rounds = []
        for b in self.buckets:
            flat = torch.cat([self.tensors[i].reshape(-1) for i in b])
            self.rounds.append(comm.all_gather(flat))

    def wait(self) -> None:
        for b, (rows, pending) in zip(self.buckets, self.rounds):
            pending.wait()
            acc = rows[0].to(torch.float32)
            for r in range(1, rows.shape[0]):
                acc += rows[r].to(torch.float32)
            acc.div_(self.world)
            with torch.no_grad():
                for i, chunk in zip(b, acc.split([self.tensors[i].numel() for i in b])):
                    self.tensors[i].copy_(chunk.view_as(self.tensors[i]))
        self.rounds = []


class CoalescedMean:
    """Average ``tensors`` over the DP group in place: one flat all-reduce per (dtype, device)
    bucket of at most BUCKET_NUMEL elements.  Launch in the constructor, finish in ``wait()``."""

    def __init__(self, tensors, comm: Collective, async_op: bool = False, flats=None):
        self.tensors, self.world = list(tensors), comm.world_size
        self.buckets = self._bucketize(self.tensors)
        if flats is not None:  # restored from state: already reduced
            self.flats = [f.to(self.tensors[b[0]].device) for f, b in zip(flats, self.buckets)]
            self.pendings = [Pending() for _ in self.flats]
        else:
            self.flats = [torch.cat([self.tensors[i].reshape(-1) for i in b]) for b in self.buckets]
            self.pendings = [comm.all_reduce_sum(f, async_op) for f in self.flats]
        self._copied = False

    @staticmethod
    def _bucketize(tensors):
        by_kind: dict = {}
        for i, t in enumerate(tensors):
            by_kind.setdefault((t.dtype, t.device), []).append(i)
        buckets = []
        for idx in by_kind.values():
            cur, n = [], 0
            for i in idx:
                if cur and n + tensors[i].numel() > BUCKET_NUMEL:
                    buckets.append(cur)
                    cur, n = [], 0
                cur.append(i)
                n += tensors[i].numel()
            buckets.append(cur)
        return buckets

    def wait_reduced(self) -> list[torch.Tensor]:
        """Wait for the collectives only; return the reduced (summed) flat buffers."""
        for p in self.pendings:
            p.wait()
        return self.flats

    def wait(self) -> None:
        self.wait_reduced()
        if self._copied:
            return
        for b, flat in zip(self.buckets, self.flats):
            if self.world > 1:
                flat.div_(self.world)
            for i, chunk in zip(b, flat.split([self.tensors[i].numel() for i in b])):
                self.tensors[i].copy_(chunk.view_as(self.tensors[i]))
        self._copied = True

    finish = wait  # same verb as PowerSGDRound


class DPBackend:
    """Base class; see the module docstring for the call protocol.

    ``named_params``: the parameters this rank holds (for a pipeline stage: that stage's only),
    in a fixed order that is the same on all DP ranks.  Parameters with ``requires_grad=False``
    are ignored (frozen weights stay identical on all replicas).  ``comm``: the
    :class:`Communicator` of the DP replicas (``None``: a world of one).  ``cfg``: this
    backend's settings, a ``config_class`` instance or the ``twocircuit.dp`` dict it is read from.
    """

    backend_name = "base"  # the registered name (set by @register_backend)
    # the backend's twocircuit.dp settings: a BackendConfig subclass holding only its own keys
    config_class: type[BackendConfig] = OptionsConfig
    # True when DP replicas hold different weights between syncs (each rank must checkpoint its
    # own module weights, not only DP rank 0's).
    replicas_may_differ = False
    # True when the backend splits its parameters into groups that must follow the pipeline's
    # stages (Streaming DiLoCo's fragments: each stage splits its own); a single process holding
    # every stage then passes the split of :meth:`stage_split` to the constructor
    splits_by_stage = False
    # What sets the bytes the training loop sends, for a run in another dtype: "grad" (the
    # gradients in their own dtype: a bf16 run sends half an fp32 run's), "fp32" (formed in fp32,
    # or fixed-width codes, whatever the training dtype), None (a mix of the two). The end-of-run
    # average (:meth:`finalize`) is the same for every backend: :func:`final_average_bytes`.
    # Benchmarks that run in fp32 read both to state their DP ratios against a bf16 all-reduce
    # (launch/bench_quality.py).
    loop_bytes_dtype: str | None = None

    def __init__(self, named_params, comm: Communicator | None, cfg):
        self.cfg = self.config_class.coerce(cfg, backend=self.backend_name)
        comm = comm if comm is not None else LocalComm()
        world_size, rank = comm.world_size, comm.rank
        if type(world_size) is not int or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
        self.world_size, self.rank = world_size, rank
        self.named_params = [(n, p) for n, p in named_params if p.requires_grad]
        self.names = [n for n, _ in self.named_params]
        self.params = [p for _, p in self.named_params]
        if len(set(self.names)) != len(self.names):
            raise ValueError("named_params holds duplicate names")
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("named_params holds the same parameter twice")
        self.comm = Collective(comm)
        self._step_stats: dict = {}

    # --- protocol ---------------------------------------------------------------------------
    def reduce_gradients(self, step: int) -> None:
        raise NotImplementedError

    def after_optimizer_step(self, step: int) -> bool:
        """Returns True when the live parameters were overwritten (fp32 masters need a refresh)."""
        return False

    def flush(self) -> bool:
        """Complete any in-flight synchronisation now (end of training).  True if params changed."""
        return False

    def finalize(self) -> bool:
        """End of training: finish in-flight syncs, then, for backends whose replicas drift
        between syncs, average the drifted parameters once, exactly (summed in fp32, no
        compression, no outer step), so that every replica holds and saves the same model.
        Returns True if the live parameters changed. The one averaging path of every backend:
        a backend says what drifted (:meth:`_drifted_groups`) and what to do after
        (:meth:`_after_final_average`).

        Weights held in bf16 or fp16 (a bf16 run's live parameters) are all-gathered as they are
        and summed in fp32 in rank order where that sends fewer bytes than an fp32 all-reduce
        (fewer than four replicas: half of it with two; :func:`final_average_bytes`): the mean the
        fp32 all-reduce gives, up to the order of its fp32 additions."""
        changed = self.flush()
        if not self.replicas_may_differ or self.world_size <= 1:
            return changed
        groups = self._drifted_groups()
        for g, idx in enumerate(groups):
            live = [self.params[i].detach() for i in idx]
            names = [self.names[i] for i in idx]
            if _gather_halves(live, self.world_size):
                check_finite(self._final_step(), names, live, what="final weight")
                GatheredMean(live, self.comm).wait()
            else:
                exact = [t.to(torch.float32) for t in live]  # the same tensor when already fp32
                check_finite(self._final_step(), names, exact, what="final weight")
                CoalescedMean(exact, self.comm).wait()
                with torch.no_grad():
                    for t, e in zip(live, exact):
                        if t is not e:
                            t.copy_(e)
            self._after_final_average(g, idx)
        return changed or bool(groups)

    def replicas_in_sync(self) -> bool:
        """Whether every replica holds the same weights right now (between syncs a backend whose
        replicas drift says no)."""
        return not self.replicas_may_differ or self.world_size <= 1

    def _drifted_groups(self) -> list[list[int]]:
        """Indices (into ``params``) of the parameters that may differ between replicas now, one
        list per all-reduce bucket group; default: all of them in one group."""
        return [list(range(len(self.params)))] if self.params else []

    def _after_final_average(self, group: int, idx: list[int]) -> None:
        """Hook: group number ``group`` of :meth:`_drifted_groups` (parameters ``idx``) now holds
        the replicas' exact average."""

    def _final_step(self) -> int:
        return -1

    def state_dict(self) -> dict:
        return {"backend": self.backend_name, "names": list(self.names)}

    @classmethod
    def stage_split(cls, stages: list[list[tuple[str, int]]], cfg) -> dict:
        """Constructor keyword arguments that make one process holding every pipeline stage (``stages``:
        each stage's trainable (name, numel) in order) group its parameters as the stages' own
        backends do (``splits_by_stage``); nothing for most backends."""
        return {}

    @classmethod
    def merge_replica_states(cls, states: list[dict], cfg=None) -> dict:
        """One state for every replica of a run resumed on another DP width, from the states the
        old replicas saved (``ds_twocircuit.replicas``: agreed state from the first, per-replica
        state averaged); ``cfg``: this run's backend config (its merge options). The base class holds
        nothing per replica."""
        return states[0]

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("backend") != self.backend_name:
            raise ValueError(f"state is for twocircuit.dp.backend {sd.get('backend')!r}, "
                             f"this backend is {self.backend_name!r}")
        if list(sd.get("names", [])) != self.names:
            saved = list(sd.get("names", []))
            hint = (f" (e.g. {saved[0]!r} saved, {self.names[0]!r} here: checkpoints written before the DP "
                    "backends keyed a pipeline stage's parameters by their Hugging Face names cannot be resumed)"
                    if saved and self.names and len(saved) == len(self.names) else "")
            raise ValueError("state was saved for a different parameter list "
                             f"({len(saved)} vs {len(self.names)} parameters){hint}")

    def pop_step_stats(self) -> dict:
        """Stats since the last call: bytes_sent, collectives, comm_s, hidden_comm_s, + extras."""
        s = self.comm.pop_stats()
        s.update(self._step_stats)
        self._step_stats = {}
        return s

    # --- helpers ----------------------------------------------------------------------------
    def _grads(self) -> list[torch.Tensor]:
        """p.grad for every parameter; a missing grad becomes zeros so all ranks reduce the same
        layout (DeepSpeed does the same in ``_get_gradients_for_reduction``)."""
        out = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(p.grad)
        return out
