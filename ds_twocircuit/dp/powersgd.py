"""PowerSGD: rank-r gradient compression with error feedback and warm start.

Paper: Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019.  Follows PyTorch's ``powerSGD_hook`` (knob names,
dense warm-up, error feedback, warm-started Q); the two-circuit paper's "PowerSGD-64" is rank 64,
hence ``matrix_approximation_rank`` defaults to 64.

Each tensor is viewed as a matrix M (n x m; ndim > 2 reshaped to ``(shape[0], -1)``), and with
r = min(n, m, matrix_approximation_rank), one power iteration per call, in fp32:

    M += e                          (error feedback)
    P = M Q;  all-reduce P;  P = orthogonalize(P)
    Q = M^T P;  all-reduce Q;  Q /= world
    M_hat = P Q^T                   (the same on every rank: the compressed DP mean)
    e = M - M_hat                   (this rank's input minus what was applied)

Tensors that are 0-D/1-D or would not shrink at least ``min_compression_rate`` times
(n*m / (r*(n+m)) < min_compression_rate) are averaged uncompressed in one coalesced all-reduce.

Invariant (error feedback on): for every rank and every compressed tensor, the sum of the inputs
fed in minus the sum of the outputs handed back equals the error buffer, so nothing is lost, only
delayed.  Q starts from a Gaussian seeded by (random_seed, tensor key, round), identical on all
ranks; with ``warm_start`` it is reused (and re-orthogonalized) from the previous round.

Orthogonalization: Householder QR (``torch.linalg.qr``) in fp32, which is exact-rank safe (no
division by a zero norm); with ``orthogonalization_epsilon > 0`` Gram-Schmidt with that epsilon,
as PyTorch does.  No DeepSpeed import.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ds_twocircuit.configkit import check_choice, check_keys
from ds_twocircuit.dp.base import CoalescedMean, Collective, DPBackend, check_finite
from ds_twocircuit.dp.config import (DEFAULT_PREFIX, BackendConfig, boolean, float_in, int_in,
                                     nested, parse_fields, setting)
from ds_twocircuit.rng import derived_generator


@dataclass(frozen=True)
class PowerSGDConfig:
    """PowerSGD knobs, named as in PyTorch's ``PowerSGDState``: the ``powersgd`` object of backend
    ``powersgd``, and of DiLoCo's pseudo-gradients with ``compression: "powersgd"``::

        "powersgd": {
          "matrix_approximation_rank": int >= 1      [64]  the paper's "PowerSGD-64"
          "start_powerSGD_iter": int >= 0            [10]  dense all-reduce while step < this
          "min_compression_rate": float >= 0         [2.0] compress iff n*m / (r*(n+m)) >= this
          "use_error_feedback": bool                 [true]
          "warm_start": bool                         [true]
          "orthogonalization_epsilon": float >= 0    [0.0] 0: Householder QR; > 0: Gram-Schmidt
          "random_seed": int >= 0                    [0]   seeds the first Q (same on all ranks)
          "error_feedback_on_resize": "average" | "reset"  ["average"]  a resume on another DP
              width: the new replicas start from the old ones' mean residual, or from zero
        }
    """
    matrix_approximation_rank: int = setting(64, check=int_in(1))
    start_powerSGD_iter: int = setting(10, check=int_in(0))
    min_compression_rate: float = setting(2.0, check=float_in(0.0))
    use_error_feedback: bool = setting(True, check=boolean)
    warm_start: bool = setting(True, check=boolean)
    orthogonalization_epsilon: float = setting(0.0, check=float_in(0.0))
    random_seed: int = setting(0, check=int_in(0))
    error_feedback_on_resize: str = setting("average", check=lambda v, name: check_choice(v, ("average", "reset"), name))

    @classmethod
    def from_dict(cls, d: dict | None,
                  prefix: str = DEFAULT_PREFIX + ".powersgd") -> "PowerSGDConfig":
        d = {} if d is None else d
        check_keys(d, {f.name for f in dataclasses.fields(cls)}, prefix)
        return cls(**parse_fields(cls, d, prefix))


@dataclass(frozen=True)
class PowerSGDBackendConfig(BackendConfig):
    """``"dp": {"backend": "powersgd", "powersgd": {...}}`` (:class:`PowerSGDConfig`)."""
    backend: str = "powersgd"
    powersgd: PowerSGDConfig = setting(default_factory=PowerSGDConfig, check=nested(PowerSGDConfig))


def orthogonalize_(m: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Orthonormalize the columns of the fp32 matrix ``m`` (n x r, n >= r) in place."""
    if epsilon == 0:
        m.copy_(torch.linalg.qr(m)[0])
        return m
    for i in range(m.shape[1]):
        col = m[:, i:i + 1]
        col /= torch.linalg.vector_norm(col) + epsilon
        if i + 1 < m.shape[1]:
            rest = m[:, i + 1:]
            rest -= col @ (col.T @ rest)
    return m


def _as_matrix_shape(shape) -> tuple[int, int]:
    n = int(shape[0])
    return n, (int(torch.Size(shape).numel()) // n if n else 0)


class PowerSGDCompressor:
    """Compressed DP averaging of arbitrary tensor lists, keyed by name (state is per key).

    ``reduce_mean_(tensors, keys, comm)`` replaces each tensor in place by its compressed DP mean.
    ``start(...)`` / ``PowerSGDRound.finish()`` split that in two so the first all-reduce (the
    uncompressed part and P) can overlap other work; ``PowerSGDRound.launch_q()`` in between puts
    the second (Q) in flight too, otherwise it runs inside ``finish``. Every replica must call
    ``launch_q`` at the same point of its sequence of collectives.
    """

    def __init__(self, cfg: PowerSGDConfig | dict | None = None):
        self.cfg = cfg if isinstance(cfg, PowerSGDConfig) else PowerSGDConfig.from_dict(cfg)
        self.error: dict[str, torch.Tensor] = {}
        self.q: dict[str, torch.Tensor] = {}
        self.rounds = 0  # compressed rounds started; part of the seed when Q is drawn afresh
        self._numel_dense = self._numel_sent = 0

    def rank_for(self, shape) -> int:
        """The rank a tensor of ``shape`` is compressed to, or 0 if it is sent uncompressed."""
        if len(shape) < 2:
            return 0
        n, m = _as_matrix_shape(shape)
        r = min(n, m, self.cfg.matrix_approximation_rank)
        if r == 0 or n * m < self.cfg.min_compression_rate * r * (n + m):
            return 0
        return r

    def start(self, tensors, keys, comm: Collective, *, dense: bool = False,
              async_op: bool = False) -> "PowerSGDRound":
        return PowerSGDRound(self, list(tensors), list(keys), comm, dense, async_op)

    def reduce_mean_(self, tensors, keys, comm: Collective, *, dense: bool = False) -> None:
        self.start(tensors, keys, comm, dense=dense).finish()

    def restore_round(self, state: dict, tensors, comm: Collective) -> "PowerSGDRound":
        """Rebuild a round saved by ``PowerSGDRound.state()`` (its first all-reduce done, and its
        second if it was in flight)."""
        return PowerSGDRound(self, list(tensors), list(state["keys"]), comm, state["dense"],
                             False, restored=state)

    def _initial_q(self, key: str, m: int, r: int, device) -> torch.Tensor:
        g = derived_generator(self.cfg.random_seed, key, self.rounds)
        return torch.randn(m, r, generator=g, dtype=torch.float32).to(device)

    def pop_stats(self) -> dict:
        d, s = self._numel_dense, self._numel_sent
        self._numel_dense = self._numel_sent = 0
        return {"numel_dense": d, "numel_sent": s, "compression_rate": d / s if s else 1.0}

    def state_dict(self) -> dict:
        return {"error": {k: v.clone() for k, v in self.error.items()},
                "q": {k: v.clone() for k, v in self.q.items()}, "rounds": self.rounds}

    def load_state_dict(self, sd: dict, device=None) -> None:
        def mv(t):
            return t.clone() if device is None else t.to(device, copy=True)
        self.error = {k: mv(v) for k, v in sd["error"].items()}
        self.q = {k: mv(v) for k, v in sd["q"].items()}
        self.rounds = int(sd["rounds"])


def merge_compressor_states(states: list[dict], cfg: PowerSGDConfig | None = None) -> dict:
    """PowerSGDCompressor states of several replicas as one: error buffers averaged (the residual the
    replicas' mean still owes) or, with ``error_feedback_on_resize: "reset"``, zeroed; Q and the
    round counter from the first (the same on every replica)."""
    from ..replicas import mean_state
    if cfg is not None and cfg.error_feedback_on_resize == "reset":
        return {**states[0], "error": {k: torch.zeros_like(v) for k, v in states[0]["error"].items()}}
    return {**states[0], "error": {k: mean_state([s["error"][k] for s in states]) for k in states[0]["error"]}}


class PowerSGDRound:
    """One compressed averaging of a tensor list; launched in the constructor."""

    def __init__(self, comp: PowerSGDCompressor, tensors, keys, comm, dense, async_op,
                 restored=None):
        if len(tensors) != len(keys) or len(set(keys)) != len(keys):
            raise ValueError("tensors and keys must have equal length and keys must be unique")
        self.comp, self.tensors, self.keys, self.comm, self.dense = comp, tensors, keys, comm, dense
        ranks = [0 if dense else comp.rank_for(t.shape) for t in tensors]
        self.comp_idx = [i for i, r in enumerate(ranks) if r]
        self.ranks = [ranks[i] for i in self.comp_idx]
        unc = [tensors[i] for i, r in enumerate(ranks) if not r]
        self.qflat, self._q_pending = None, None
        if restored is not None:
            self.unc = CoalescedMean(unc, comm, flats=restored["u"])
            dev = tensors[0].device
            self.ms = [m.to(dev) for m in restored["m"]]
            self.pflat = restored["p"].to(dev)
            self._p_pending = None
            if restored.get("q") is not None:   # saved with its Q all-reduce done
                self.qflat = restored["q"].to(dev)
        else:
            numel = sum(t.numel() for t in tensors)
            comp._numel_dense += numel
            comp._numel_sent += numel - sum(tensors[i].numel() for i in self.comp_idx) + sum(
                r * sum(_as_matrix_shape(tensors[i].shape))
                for i, r in zip(self.comp_idx, self.ranks))
            self.unc = CoalescedMean(unc, comm, async_op=async_op)
            self.ms = self._matrices()
            self.pflat = self._compute_p()
            self._p_pending = comm.all_reduce_sum(self.pflat, async_op) if self.ms else None
        self.finished = False

    def _matrices(self) -> list[torch.Tensor]:
        comp, ms = self.comp, []
        for i in self.comp_idx:
            t, key = self.tensors[i], self.keys[i]
            m = t.detach().reshape(_as_matrix_shape(t.shape)).to(torch.float32, copy=True)
            if comp.cfg.use_error_feedback:
                e = comp.error.get(key)
                if e is None:
                    e = comp.error[key] = torch.zeros_like(m)
                elif e.shape != m.shape:
                    raise ValueError(f"PowerSGD error buffer for {key!r} has shape "
                                     f"{tuple(e.shape)}, tensor is {tuple(m.shape)}")
                m.add_(e)
            ms.append(m)
        return ms

    def _compute_p(self) -> torch.Tensor:
        comp = self.comp
        if not self.ms:
            return torch.empty(0)
        dev = self.ms[0].device
        pflat = torch.empty(sum(m.shape[0] * r for m, r in zip(self.ms, self.ranks)),
                            dtype=torch.float32, device=dev)
        for m, r, p, i in zip(self.ms, self.ranks, self._views(pflat, 0), self.comp_idx):
            key = self.keys[i]
            q = comp.q.get(key) if comp.cfg.warm_start else None
            if q is None or q.shape != (m.shape[1], r):
                q = comp._initial_q(key, m.shape[1], r, dev)
            else:
                q = q.clone()
            orthogonalize_(q, comp.cfg.orthogonalization_epsilon)
            torch.matmul(m, q, out=p)
        comp.rounds += 1
        return pflat

    def _views(self, flat, dim):
        out, off = [], 0
        for m, r in zip(self.ms, self.ranks):
            k = m.shape[dim] * r
            out.append(flat[off:off + k].view(m.shape[dim], r))
            off += k
        return out

    def wait_phase1(self) -> None:
        """Wait for the first all-reduce (uncompressed part and P) without finishing."""
        self.unc.wait_reduced()
        if self._p_pending is not None:
            self._p_pending.wait()

    def state(self) -> dict:
        """Serializable state after the first all-reduce, and after the second if it is in
        flight (see ``restore_round``)."""
        self.wait_phase1()
        if self._q_pending is not None:
            self._q_pending.wait()
            self._q_pending = None
        return {"keys": list(self.keys), "dense": self.dense,
                "u": [f.clone() for f in self.unc.flats],
                "m": [m.clone() for m in self.ms], "p": self.pflat.clone(),
                "q": None if self.qflat is None else self.qflat.clone()}

    @property
    def q_launched(self) -> bool:
        return self.qflat is not None

    def launch_q(self, async_op: bool = True) -> None:
        """Wait for the first all-reduce, orthogonalize the averaged P, and launch the Q
        all-reduce (Q = M^T P, from this round's M). The result does not depend on when this is
        called; only the time the collectives overlap does. A no-op once launched."""
        if self.q_launched or self.finished:
            return
        self.wait_phase1()
        if not self.ms:
            return
        comp = self.comp
        ps = self._views(self.pflat, 0)
        for p in ps:
            orthogonalize_(p, comp.cfg.orthogonalization_epsilon)
        self.qflat = torch.empty(sum(m.shape[1] * r for m, r in zip(self.ms, self.ranks)),
                                 dtype=torch.float32, device=self.pflat.device)
        for m, p, q in zip(self.ms, ps, self._views(self.qflat, 1)):
            torch.matmul(m.T, p, out=q)
        self._q_pending = self.comm.all_reduce_sum(self.qflat, async_op)

    def finish(self) -> None:
        if self.finished:
            return
        self.wait_phase1()
        self.unc.wait()
        if self.ms:
            comp, world = self.comp, self.comm.world_size
            self.launch_q(async_op=False)
            if self._q_pending is not None:
                self._q_pending.wait()
                self._q_pending = None
            qflat = self.qflat
            ps, qs = self._views(self.pflat, 0), self._views(qflat, 1)
            if world > 1:
                qflat.div_(world)
            for m, p, q, i in zip(self.ms, ps, qs, self.comp_idx):
                key, t = self.keys[i], self.tensors[i]
                m_hat = p @ q.T
                if comp.cfg.use_error_feedback:
                    comp.error[key] = m.sub_(m_hat)  # m is this round's private copy
                if comp.cfg.warm_start:
                    comp.q[key] = q.clone()
                t.copy_(m_hat.view_as(t))
        self.finished = True


class PowerSGD(DPBackend):
    """Per-step PowerSGD-compressed gradient averaging (dense while step < start_powerSGD_iter)."""

    backend_name = "powersgd"
    config_class = PowerSGDBackendConfig
    loop_bytes_dtype = None   # P and Q in fp32; the uncompressed tensors and the warm-up in the gradients' dtype

    def __init__(self, named_params, comm, cfg):
        super().__init__(named_params, comm, cfg)
        self.compressor = PowerSGDCompressor(self.cfg.powersgd)

    def reduce_gradients(self, step: int) -> None:
        grads = self._grads()
        check_finite(step, self.names, grads)
        dense = step < self.cfg.powersgd.start_powerSGD_iter
        self.compressor.reduce_mean_(grads, self.names, self.comm, dense=dense)
        self._step_stats.update(self.compressor.pop_stats(), dense=dense)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "compressor": self.compressor.state_dict()}

    @classmethod
    def merge_replica_states(cls, states: list[dict], cfg=None) -> dict:
        """The error-feedback buffers averaged (the residual the replicas' mean still owes; or reset,
        as ``cfg.powersgd.error_feedback_on_resize`` says); the warm-start Q and the round counter
        are the same on every replica."""
        return {**states[0], "compressor": merge_compressor_states([s["compressor"] for s in states],
                                                                   cfg.powersgd if cfg is not None else None)}

    def load_state_dict(self, sd: dict) -> None:
        super().load_state_dict(sd)
        dev = self.params[0].device if self.params else None
        self.compressor.load_state_dict(sd["compressor"], device=dev)
