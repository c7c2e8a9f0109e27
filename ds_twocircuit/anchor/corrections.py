"""Anchor corrections other than the paper's spectral filter.

:class:`DelayedErrorFeedback` -- a paired control variate (the "delayed error feedback" merger of
the paper's authors' public replication, ``notes/method.md`` section 8). At a snapshot step s the
fast stage keeps its own compressed gradient ``G_comp(theta_s, B_s)`` (local memory: nothing
crosses a link). When the anchor's dense gradient of the same weights and batch arrives,
``c = G_dense - G_comp`` is the compression's error on that batch; every later step uses
``G + lambda * EMA(c)``. Unlike the spectral filter, this adds the missing dense-gradient component
instead of reweighting the compressed gradient. The wire bytes are the anchor's existing ones.
Both sides of the pair must be on the same footing: the kept gradient is the one the optimizer saw
(after DeepSpeed's gradient clipping), so the anchor clips its dense gradient by the same rule
before publishing it (``adapters/anchor_circuit.run_anchor``); unclipped, the "error" carries the
clipping and is replayed every step.

Invariant: the correction only ever pairs gradients of the same weights and batch (a missing
pairing -- the kept gradient was dropped, or the anchor sent a step that was not a snapshot step --
is skipped, never guessed); between arrivals the correction is constant.

Same interface as :class:`~ds_twocircuit.anchor.spectral.SpectralCorrection` (attached to the
inner optimizer through its public hooks, fed by ``submit_anchor_gradients``), so the anchor
circuit drives either.
"""
from __future__ import annotations

import warnings
from typing import Mapping

import torch

from .spectral import SpectralCorrection


class DelayedErrorFeedback(SpectralCorrection):
    """``G_use = G + lam * EMA(G_dense(theta_s, B_s) - G_comp(theta_s, B_s))`` on the target matrices.

    Args:
        inner: the optimizer that takes the step.
        targets: name -> 2-D parameter (the matrices the anchor sends gradients for).
        every: snapshot cadence K: at steps with ``step % every == 0`` the compressed gradient is kept.
        lam: weight of the correction (1: the full measured error).
        beta: EMA decay of the corrections (0: the newest only).
        keep: kept compressed gradients at most (the oldest is dropped first).
    """

    def __init__(self, inner: torch.optim.Optimizer, targets: Mapping[str, torch.nn.Parameter], every: int,
                 lam: float = 1.0, beta: float = 0.5, keep: int = 4, seed: int = 0) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        if not lam >= 0.0:
            raise ValueError(f"lam must be >= 0, got {lam}")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {beta}")
        super().__init__(inner, targets, alpha=1.0, beta=beta, seed=seed, diagnostics=False)
        self.every, self.lam, self.keep = int(every), float(lam), int(keep)
        self._kept: dict[int, dict[str, torch.Tensor]] = {}
        self._corr: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def submit_anchor_gradients(self, grads: Mapping[str, torch.Tensor], source_step: int) -> None:
        source_step = int(source_step)
        comp = self._kept.pop(source_step, None)
        if comp is None:
            warnings.warn(f"delayed_ef: no kept compressed gradient for step {source_step} (not a snapshot "
                          "step of this run, or dropped); anchor gradient skipped", RuntimeWarning, stacklevel=2)
            return
        for name, g in grads.items():
            if name not in self.targets or name not in comp:
                continue
            if not bool(torch.isfinite(g).all()):
                raise ValueError(f"anchor gradient {name!r} (source step {source_step}) is not finite")
            c = g.detach().to(device=comp[name].device, dtype=torch.float32) - comp[name]
            old = self._corr.get(name)
            self._corr[name] = c if old is None else self.beta * old + (1.0 - self.beta) * c
        self.anchor_updates += 1
        prev = self.last_anchor_source_step
        self.last_anchor_source_step = source_step if prev is None else max(prev, source_step)

    @torch.no_grad()
    def _correct_gradients(self) -> None:
        step = self.current_step
        if step % self.every == 0:  # a snapshot step: keep this step's compressed gradient
            self._kept[step] = {n: p.grad.detach().float().clone() for n, p in self.targets.items()
                                if p.grad is not None}
            while len(self._kept) > self.keep:
                self._kept.pop(min(self._kept))
        num = den = 0.0
        for name, p in self.targets.items():
            c = self._corr.get(name)
            if c is None or p.grad is None:
                continue
            num += float(c.pow(2).sum()) * self.lam ** 2
            den += float(p.grad.float().pow(2).sum())
            p.grad.add_(c.to(p.grad.dtype), alpha=self.lam)
        self._last_stats = {
            "delayed_ef/anchor_updates": float(self.anchor_updates),
            "delayed_ef/correction_ratio": (num / den) ** 0.5 if den > 0 else 0.0,  # ||lam c|| / ||G||
            "delayed_ef/staleness": (float(step - self.last_anchor_source_step)
                                     if self.last_anchor_source_step is not None else -1.0),
        }

    STATE_KEYS = ("spectral", "delayed_ef")

    def _extra_state(self) -> dict:
        return {**super()._extra_state(),
                "delayed_ef": {"every": self.every, "lam": self.lam, "beta": self.beta,
                               "kept": self._kept, "corr": self._corr}}

    def _load_extra_state(self, extra: dict) -> None:
        super()._load_extra_state(extra)
        ef = extra.get("delayed_ef")
        if ef is not None:
            self._kept = {int(k): dict(v) for k, v in ef["kept"].items()}
            self._corr = dict(ef["corr"])


def build_correction(optimizer: torch.optim.Optimizer, targets: Mapping[str, torch.nn.Parameter], anchor, seed: int):
    """The correction ``anchor`` (a ``twocircuit.anchor`` section) configures, attached to
    ``optimizer`` through its public hooks: the paper's :class:`SpectralCorrection` or
    :class:`DelayedErrorFeedback`. Returns None when there is no 2-D target to correct."""
    if not targets:
        return None
    if anchor.correction == "delayed_ef":
        return DelayedErrorFeedback(optimizer, targets, every=anchor.every, lam=anchor.ef_lambda,
                                    beta=anchor.ef_beta, seed=seed)
    sc = anchor.spectral
    return SpectralCorrection(optimizer, targets, alpha=sc.alpha, tau=sc.tau, beta=sc.beta, tau_mode=sc.tau_mode,
                              svd=sc.svd, svd_rank=(sc.svd_rank or None), topk_diag=sc.topk_diag,
                              ema_init=sc.ema_init, anchor_mix=sc.anchor_mix, seed=seed)
