"""Spectral correction of masked gradients by anchor priors.

Paper: "Communication-Efficient LLM Adaptation over Decentralized GPU Meshes" (Ramasinghe et al.,
arXiv 2609.14339), section "spectral correction optimizer"; see also docs notes method.md, s. 3.

For every 2-D decoder weight matrix W with masked gradient G_mask (``p.grad`` at step time)::

    M      <- EMA of the anchor gradients of W            (only when a new anchor gradient arrives)
    U,S,V  <- thin SVD of M                                (recomputed only when M changes)
    d_i    =  s_i / (s_i + tau_eff)                        (tau_eff = tau, or tau * s_max)
    G_filt =  U diag(d) (U^T G_mask V) diag(d) V^T
    G_use  =  alpha * G_mask + (1 - alpha) * G_filt        (handed to the inner optimizer)

Invariants this module keeps:

* The anchor state (EMA, SVD, counters) is separate from the inner optimizer's moments, and it
  changes only in :meth:`SpectralCorrection.submit_anchor_gradients`; ``step`` never refreshes it.
  Replicas that submit the same anchor gradients at the same step hold identical anchor state, so
  the (linear) filter commutes with a dense mean all-reduce of G_mask.
* Before a matrix has received its first anchor gradient its gradient passes through untouched,
  and with ``alpha == 1`` the filter is skipped entirely: both are bitwise no-ops.
* It attaches to the inner optimizer through the optimizer's public hooks
  (``register_step_pre_hook``: correct the gradients; ``register_step_post_hook``: count the step;
  ``register_state_dict_post_hook`` / ``register_load_state_dict_pre_hook``: its state). The
  optimizer DeepSpeed, an lr scheduler and a checkpoint see is the inner optimizer itself; its
  ``state_dict()`` holds one extra key, ``"spectral"``, loading it restores both, and a resumed run
  continues bitwise identically.

Order of one fast step (method.md s. 3): masked forward/backward -> DP sync ->
``submit_anchor_gradients`` if a new anchor gradient arrived -> ``inner.step()`` (the pre-step
hook corrects, then the inner optimizer steps).

Cost per matrix (n x m, kept rank r): the projections cost O(n m r) and never form an n x n or
m x m matrix; the SVD runs in fp32 whatever the gradient dtype, and the gradient handed to the inner
optimizer keeps the parameter's dtype (it is written in place into ``p.grad``).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch

from ds_twocircuit.rng import derived_generator

TAU_MODES = ("absolute", "relative")
SVD_MODES = ("full", "randomized")
EMA_INITS = ("bias_corrected", "first", "zero")
_STATE_FORMAT = 1


# --------------------------------------------------------------------------------------------
# Pure functions (the whole algorithm; the optimizer class below only keeps state around them)
# --------------------------------------------------------------------------------------------

def filter_strengths(singular_values: torch.Tensor, tau: float, tau_mode: str = "absolute") -> torch.Tensor:
    """Soft filter ``d_i = s_i / (s_i + tau_eff)``; ``tau_eff = tau`` or ``tau * s_max``.

    A direction with ``s_i + tau_eff == 0`` (a zero EMA with tau_eff = 0) gets d = 0.
    """
    if tau_mode not in TAU_MODES:
        raise ValueError(f"tau_mode must be one of {TAU_MODES}, got {tau_mode!r}")
    s = singular_values
    if tau_mode == "relative":
        s_max = s.max() if s.numel() else s.new_zeros(())
        tau_eff = tau * s_max
    else:
        tau_eff = torch.as_tensor(tau, dtype=s.dtype, device=s.device)
    denom = s + tau_eff
    return torch.where(denom > 0, s / torch.where(denom > 0, denom, torch.ones_like(denom)), torch.zeros_like(s))


def spectral_filter(grad: torch.Tensor, U: torch.Tensor, d: torch.Tensor, V: torch.Tensor,
                    core: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``U diag(d) (U^T grad V) diag(d) V^T`` in O(n m r) (grad: n x m, U: n x r, V: m x r).
    ``core``: ``U^T grad V`` when the caller already has it (it is not modified)."""
    if core is None:
        core = (U.T @ grad) @ V
    return (U @ (core * d[:, None] * d[None, :])) @ V.T


def thin_svd(matrix: torch.Tensor, rank: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact thin SVD in fp32, optionally truncated to ``rank``; returns (U n x r, S r, V m x r)."""
    U, S, Vh = torch.linalg.svd(matrix.float(), full_matrices=False)
    if rank is not None:
        U, S, Vh = U[:, :rank], S[:rank], Vh[:rank]
    return U.contiguous(), S.contiguous(), Vh.T.contiguous()


def randomized_svd(matrix: torch.Tensor, rank: int, oversample: int = 8, niter: int = 2,
                   generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Randomized range finder + SVD of the projection (Halko, Martinsson, Tropp 2011, alg. 4.4).

    The Gaussian test matrix is drawn on the CPU from ``generator`` (never the global RNG, so the
    training RNG stream is untouched and the result does not depend on the device type). With
    ``rank + oversample >= min(n, m)`` the sketch spans the whole range and the result equals the
    exact thin SVD up to rounding. Returns (U n x r, S r, V m x r) in fp32.
    """
    M = matrix.float()
    n, m = M.shape
    q = min(rank + oversample, n, m)
    omega = torch.randn(m, q, generator=generator, dtype=torch.float32).to(M.device)
    Q, _ = torch.linalg.qr(M @ omega)
    for _ in range(niter):
        Z, _ = torch.linalg.qr(M.T @ Q)
        Q, _ = torch.linalg.qr(M @ Z)
    Ub, S, Vh = torch.linalg.svd(Q.T @ M, full_matrices=False)
    r = min(rank, q)
    return (Q @ Ub[:, :r]).contiguous(), S[:r].contiguous(), Vh[:r].T.contiguous()


# --------------------------------------------------------------------------------------------
# Optimizer wrapper
# --------------------------------------------------------------------------------------------

@dataclass
class _AnchorState:
    """Anchor state of one matrix: the raw EMA and the SVD of its effective (corrected) value."""
    ema: torch.Tensor                 # fp32, n x m; replaced (never mutated) on each arrival
    arrivals: int
    source_step: int
    U: torch.Tensor                   # fp32, n x r
    S: torch.Tensor                   # fp32, r (descending)
    V: torch.Tensor                   # fp32, m x r
    numerical_rank: int = -1          # singular values above fp32 noise (set on refresh)

    def __post_init__(self) -> None:
        self.numerical_rank = _numerical_rank(self.S, (self.U.shape[0], self.V.shape[0]))


class SpectralCorrection:
    """Attaches to an optimizer and replaces the gradient of each target matrix by ``G_use``
    right before every ``inner.step()``.

    Hand ``inner`` itself to DeepSpeed (client optimizer), to an lr scheduler and to checkpoints:
    the correction runs in ``inner``'s step pre-hook and its state rides in ``inner``'s state dict
    (key ``"spectral"``). ``detach()`` removes the hooks. ``step()``, ``state_dict()`` and
    ``load_state_dict()`` here are shorthands for ``inner``'s.

    Args:
        inner: the optimizer that takes the step (AdamW in the paper).
        targets: name -> 2-D parameter that gets anchor priors (decoder attention / MLP matrices).
            The names key the anchor gradients and the ``"spectral"`` part of the state dict.
            Every target must be a parameter of ``inner`` (checked at every step: DeepSpeed's
            BF16/ZeRO wrappers swap params for flat fp32 copies, which this filter cannot serve).
        alpha: weight of the raw masked gradient; 1 is an exact no-op, 0 is filter-only.
        tau: filter threshold; ``tau_mode`` says whether it is absolute or relative to s_max.
        beta: EMA decay of the anchor gradients.
        svd: ``"full"`` (exact thin SVD, optionally truncated to ``svd_rank``) or ``"randomized"``
            (needs ``svd_rank``; ``svd_oversample`` extra columns, ``svd_niter`` power iterations).
        topk_diag: k of the alignment diagnostic ``||U_k^T G V_k||_F^2 / ||G||_F^2``.
        ema_init: how the EMA starts. ``"bias_corrected"`` (default): Adam-style,
            ``M_t / (1 - beta^t)`` with ``M_0 = 0``, so the first arrival gives M = G_anchor and
            later arrivals an unbiased weighted mean; ``"first"``: M = G_anchor on the first
            arrival, then the plain EMA; ``"zero"``: the plain EMA from M_0 = 0 (M = (1 - beta)
            G_anchor after the first arrival, which with an absolute tau filters harder).
        seed: seed of the randomized SVD's test matrices (mixed with the matrix name and its
            arrival count, so refreshes are reproducible after a resume).
        diagnostics: compute the per-step statistics of :meth:`last_stats`.

    Current step: ``current_step`` counts ``step()`` calls and is saved in the state dict; it is
    the index of the step being taken (the number of steps completed before it, like DeepSpeed's
    ``engine.global_steps`` before the step). ``step(step=n)`` or assigning ``current_step`` sets
    it, e.g. from ``engine.global_steps`` when DeepSpeed skips steps. Staleness of an anchor is
    ``current_step - source_step``.
    """

    def __init__(self, inner: torch.optim.Optimizer, targets: Mapping[str, torch.nn.Parameter], alpha: float = 0.3,
                 tau: float = 1e-3, beta: float = 0.95, tau_mode: str = "absolute", svd: str = "full",
                 svd_rank: Optional[int] = None, svd_oversample: int = 8, svd_niter: int = 2, topk_diag: int = 16,
                 ema_init: str = "bias_corrected", seed: int = 0, diagnostics: bool = True,
                 anchor_mix: float = 0.0) -> None:
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"inner must be a torch.optim.Optimizer, got {type(inner).__name__}")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        if not (tau >= 0.0 and math.isfinite(tau)):
            raise ValueError(f"tau must be finite and >= 0, got {tau}")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {beta}")
        if tau_mode not in TAU_MODES:
            raise ValueError(f"tau_mode must be one of {TAU_MODES}, got {tau_mode!r}")
        if svd not in SVD_MODES:
            raise ValueError(f"svd must be one of {SVD_MODES}, got {svd!r}")
        if svd_rank is not None and svd_rank < 1:
            raise ValueError(f"svd_rank must be >= 1 or None, got {svd_rank}")
        if svd == "randomized" and svd_rank is None:
            raise ValueError("svd='randomized' needs svd_rank")
        if svd_oversample < 0 or svd_niter < 0:
            raise ValueError("svd_oversample and svd_niter must be >= 0")
        if topk_diag < 1:
            raise ValueError(f"topk_diag must be >= 1, got {topk_diag}")
        if ema_init not in EMA_INITS:
            raise ValueError(f"ema_init must be one of {EMA_INITS}, got {ema_init!r}")
        if not (anchor_mix >= 0.0 and math.isfinite(anchor_mix)):
            raise ValueError(f"anchor_mix must be finite and >= 0, got {anchor_mix}")
        if not targets:
            raise ValueError("targets is empty")
        seen: dict[int, str] = {}
        for name, p in targets.items():
            if p.dim() != 2:
                raise ValueError(f"target {name!r} must be a 2-D matrix, got shape {tuple(p.shape)}")
            if id(p) in seen:
                raise ValueError(f"targets {seen[id(p)]!r} and {name!r} are the same parameter")
            seen[id(p)] = name

        self.inner = inner
        self.targets: dict[str, torch.nn.Parameter] = dict(targets)
        self.alpha = float(alpha)
        self.tau = float(tau)
        self.beta = float(beta)
        self.tau_mode = tau_mode
        self.svd = svd
        self.svd_rank = svd_rank
        self.svd_oversample = int(svd_oversample)
        self.svd_niter = int(svd_niter)
        self.topk_diag = int(topk_diag)
        self.ema_init = ema_init
        self.seed = int(seed)
        self.diagnostics = bool(diagnostics)
        self.anchor_mix = float(anchor_mix)
        self._reset_anchor_state()
        self._check_targets_in_param_groups()
        if getattr(inner, "twocircuit_correction", None) is not None:
            raise ValueError(f"{type(inner).__name__} already has a correction attached; detach() it first")
        self._handles = [inner.register_step_pre_hook(self._before_step),
                         inner.register_step_post_hook(self._after_step),
                         inner.register_state_dict_post_hook(self._add_state),
                         inner.register_load_state_dict_pre_hook(self._take_state)]
        inner.twocircuit_correction = self  # how an adapter finds it from the engine's optimizer

    def detach(self) -> None:
        """Remove the hooks: ``inner`` steps and saves as if never attached."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if getattr(self.inner, "twocircuit_correction", None) is self:
            del self.inner.twocircuit_correction

    # --- the inner optimizer's objects (read-only views) ---------------------------------------
    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    # --- anchor state -------------------------------------------------------------------------
    def _reset_anchor_state(self) -> None:
        self._anchor: dict[str, _AnchorState] = {}
        self.current_step = 0
        self.anchor_updates = 0          # submit_anchor_gradients calls that carried gradients
        self.svd_refreshes = 0           # per-matrix SVD computations
        self.last_anchor_source_step: Optional[int] = None
        self._last_stats: dict[str, float] = {}

    @property
    def has_anchor(self) -> bool:
        return bool(self._anchor)

    def anchor_subspace(self, name: str) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(U, S, V) of target ``name``'s EMA, or None before its first anchor gradient."""
        st = self._anchor.get(name)
        return None if st is None else (st.U, st.S, st.V)

    def filter_strengths(self, name: str) -> Optional[torch.Tensor]:
        st = self._anchor.get(name)
        return None if st is None else filter_strengths(st.S, self.tau, self.tau_mode)

    @torch.no_grad()
    def submit_anchor_gradients(self, grads: Mapping[str, torch.Tensor], source_step: int) -> None:
        """Fold one anchor gradient per named matrix into its EMA and refresh its SVD.

        ``grads`` may cover a subset of the targets (e.g. one pipeline stage's); unknown names,
        wrong shapes, non-finite values and a ``source_step`` not newer than the matrix's last one
        raise ``ValueError`` before any state changes. Tensors may live on any device / dtype.
        """
        source_step = int(source_step)
        if not grads:
            return
        for name, g in grads.items():
            if name not in self.targets:
                raise ValueError(f"anchor gradient for unknown target {name!r}")
            p = self.targets[name]
            if tuple(g.shape) != tuple(p.shape):
                raise ValueError(f"anchor gradient {name!r} has shape {tuple(g.shape)}, parameter has {tuple(p.shape)}")
            st = self._anchor.get(name)
            if st is not None and source_step <= st.source_step:
                raise ValueError(f"anchor gradient {name!r} from step {source_step} is not newer than the "
                                 f"last one (step {st.source_step})")
            if not bool(torch.isfinite(g).all()):
                raise ValueError(f"anchor gradient {name!r} (source step {source_step}) is not finite")

        for name, g in grads.items():
            p = self.targets[name]
            g32 = g.detach().to(device=p.device, dtype=torch.float32)
            old = self._anchor.get(name)
            arrivals = 1 if old is None else old.arrivals + 1
            if old is None:
                ema = g32.clone() if self.ema_init == "first" else (1.0 - self.beta) * g32
            else:
                ema = self.beta * old.ema + (1.0 - self.beta) * g32   # new tensor: old state dicts stay valid
            U, S, V = self._decompose(name, self._effective_ema(ema, arrivals), arrivals)
            self._anchor[name] = _AnchorState(ema=ema, arrivals=arrivals, source_step=source_step, U=U, S=S, V=V)
        self.anchor_updates += 1
        prev = self.last_anchor_source_step
        self.last_anchor_source_step = source_step if prev is None else max(prev, source_step)

    def _effective_ema(self, ema: torch.Tensor, arrivals: int) -> torch.Tensor:
        if self.ema_init == "bias_corrected":
            return ema / (1.0 - self.beta ** arrivals)
        return ema

    def _decompose(self, name: str, matrix: torch.Tensor, arrivals: int):
        self.svd_refreshes += 1
        if self.svd == "full":
            return thin_svd(matrix, self.svd_rank)
        gen = derived_generator(self.seed, name, arrivals)
        return randomized_svd(matrix, self.svd_rank, self.svd_oversample, self.svd_niter, gen)

    # --- the step -------------------------------------------------------------------------------
    def _check_targets_in_param_groups(self) -> None:
        owned = {id(p) for group in self.inner.param_groups for p in group["params"]}
        missing = [name for name, p in self.targets.items() if id(p) not in owned]
        if missing:
            raise RuntimeError(
                f"SpectralCorrection targets {missing[:4]}{'...' if len(missing) > 4 else ''} are not parameters of "
                "the inner optimizer. DeepSpeed's BF16_Optimizer / ZeRO / fp16 wrappers replace them with flat fp32 "
                "copies; use ZeRO stage 0 with fp32 (or torch_autocast) parameters.")

    def step(self, closure: Optional[Callable[[], float]] = None, *, step: Optional[int] = None):
        """``inner.step()`` (the hooks correct the target gradients first), after running
        ``closure`` (which computes the gradients) if given.

        ``step``: index of this step (sets ``current_step``); after the step ``current_step`` is
        one higher.
        """
        if step is not None:
            self.current_step = int(step)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.inner.step()
        return loss

    def _before_step(self, optimizer, args, kwargs) -> None:   # inner's step pre-hook
        with torch.no_grad():
            self._check_targets_in_param_groups()
            self._correct_gradients()

    def _after_step(self, optimizer, args, kwargs) -> None:    # inner's step post-hook
        self.current_step += 1

    def _correct_gradients(self) -> None:
        rows: list[torch.Tensor] = []      # per matrix: ||G||^2, ||U_k^T G V_k||^2, ||G_use - G||, #(d > 0.5)
        active = 0
        for name, p in self.targets.items():
            st = self._anchor.get(name)
            g = p.grad
            if st is None or g is None:
                continue            # pass-through: no anchor for this matrix yet, or no gradient
            if g.is_sparse:
                raise RuntimeError(f"target {name!r} has a sparse gradient")
            active += 1
            G = g.float()           # the grad itself when fp32: read it before writing back
            d = filter_strengths(st.S, self.tau, self.tau_mode)
            k = min(self.topk_diag, st.numerical_rank)
            if self.alpha == 1.0 and self.anchor_mix == 0.0:
                if self.diagnostics:
                    core_k = (st.U[:, :k].T @ G) @ st.V[:, :k]
                    rows.append(self._diagnostic_row(G, core_k, None, d))
                continue
            core = (st.U.T @ G) @ st.V
            G_filt = spectral_filter(G, st.U, d, st.V, core=core)
            G_use = G_filt.mul_(1.0 - self.alpha).add_(G, alpha=self.alpha)
            if self.anchor_mix > 0.0:
                # the anchor prior itself: the (stale) dense-gradient EMA, scaled to the masked
                # gradient's norm, added with weight anchor_mix (an extension; 0 is the paper)
                E = self._effective_ema(st.ema, st.arrivals)
                scale = self.anchor_mix * torch.linalg.norm(G) / torch.linalg.norm(E).clamp_min(1e-30)
                G_use.add_(E * scale)
            if self.diagnostics:
                rows.append(self._diagnostic_row(G, core[:k, :k], G_use, d))
            g.copy_(G_use)

        stats = {
            "spectral/active_matrices": float(active),
            "spectral/anchor_updates": float(self.anchor_updates),
            "spectral/svd_refreshes": float(self.svd_refreshes),
            "spectral/staleness": (float(self.current_step - self.last_anchor_source_step)
                                   if self.last_anchor_source_step is not None else -1.0),
            "spectral/step": float(self.current_step),
        }
        if self.diagnostics:
            stats.update(self._summarise(rows))
        self._last_stats = stats

    @staticmethod
    def _diagnostic_row(G, core_k, G_use, d) -> torch.Tensor:
        # Kept on the device: one host sync per step for all matrices, not several per matrix.
        diff = G.new_zeros(()) if G_use is None else torch.linalg.norm(G_use - G)
        return torch.stack([G.pow(2).sum(), core_k.pow(2).sum(), diff, (d > 0.5).sum().to(G.dtype)])

    @staticmethod
    def _summarise(rows: list[torch.Tensor]) -> dict[str, float]:
        alignments, effects, passed = [], [], []
        if rows:
            devices = {r.device for r in rows}
            table = torch.stack([r.to("cpu") for r in rows] if len(devices) > 1 else rows).double().cpu().tolist()
            for g_sq, core_sq, diff, n_passed in table:
                if g_sq > 0.0:                      # a zero gradient has no direction to measure
                    alignments.append(core_sq / g_sq)
                    effects.append(diff / math.sqrt(g_sq))
                passed.append(n_passed)
        return {"spectral/alignment_topk": _mean(alignments), "spectral/filter_effect": _mean(effects),
                "spectral/directions_passed": _mean(passed)}

    def last_stats(self) -> dict[str, float]:
        """Diagnostics of the last ``step()`` (flat, JSON-ready floats; empty before any step).

        Means over the matrices corrected in that step (0 when none):
        ``alignment_topk`` = ||U_k^T G V_k||^2 / ||G||^2 of the masked gradient (k = topk_diag,
        capped at the EMA's numerical rank),
        ``filter_effect`` = ||G_use - G_mask|| / ||G_mask||, ``directions_passed`` = #{d_i > 0.5}.
        Counters: ``anchor_updates``, ``svd_refreshes``, ``active_matrices``; ``staleness`` =
        step - source step of the newest anchor (-1 before the first); ``step`` = that step's index.
        """
        return dict(self._last_stats)

    # --- checkpointing --------------------------------------------------------------------------
    STATE_KEYS: tuple = ("spectral",)   # the keys this correction adds to inner's state dict

    def state_dict(self) -> dict:
        """The inner optimizer's state dict plus ``"spectral"`` (anchor state, counters, config)."""
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.inner.load_state_dict(state_dict)

    def _add_state(self, optimizer, sd: dict) -> dict:          # inner's state_dict post-hook
        sd.update(self._extra_state())
        return sd

    def _take_state(self, optimizer, sd: dict) -> dict:         # inner's load_state_dict pre-hook
        sd = dict(sd)
        self._load_extra_state({k: sd.pop(k) for k in self.STATE_KEYS if k in sd})
        return sd

    def _extra_state(self) -> dict:
        return {"spectral": {
            "format": _STATE_FORMAT,
            "config": {"alpha": self.alpha, "tau": self.tau, "beta": self.beta, "tau_mode": self.tau_mode,
                       "anchor_mix": self.anchor_mix,
                       "svd": self.svd, "svd_rank": self.svd_rank, "svd_oversample": self.svd_oversample,
                       "svd_niter": self.svd_niter, "ema_init": self.ema_init, "seed": self.seed},
            "current_step": self.current_step,
            "anchor_updates": self.anchor_updates,
            "svd_refreshes": self.svd_refreshes,
            "last_anchor_source_step": self.last_anchor_source_step,
            # Tensors are never mutated in place, so references are a consistent snapshot.
            "matrices": {name: {"ema": st.ema, "arrivals": st.arrivals, "source_step": st.source_step,
                                "U": st.U, "S": st.S, "V": st.V} for name, st in self._anchor.items()},
        }}

    def _load_extra_state(self, extra: dict) -> None:
        spectral = extra.get("spectral")
        self._reset_anchor_state()
        if spectral is None:
            warnings.warn("optimizer state dict has no 'spectral' entry (saved without SpectralCorrection); "
                          "anchor state starts empty", RuntimeWarning, stacklevel=2)
            return
        if spectral.get("format") != _STATE_FORMAT:
            raise ValueError(f"unknown spectral state format {spectral.get('format')!r}")
        cfg = spectral.get("config", {})
        # The SVD depends on how it was computed and on the EMA's start; tau/alpha only enter at
        # step time, so they may change on resume.
        same_svd = all(cfg.get(k) == getattr(self, k) for k in ("svd", "svd_rank", "svd_oversample", "svd_niter",
                                                                 "ema_init", "beta", "seed"))
        unknown = set(spectral["matrices"]) - set(self.targets)
        if unknown:
            raise ValueError(f"spectral state has matrices that are not targets: {sorted(unknown)[:4]}")
        self.current_step = int(spectral["current_step"])
        self.anchor_updates = int(spectral["anchor_updates"])
        self.svd_refreshes = int(spectral["svd_refreshes"])
        last = spectral["last_anchor_source_step"]
        self.last_anchor_source_step = None if last is None else int(last)
        for name, m in spectral["matrices"].items():
            p = self.targets[name]
            ema = m["ema"].to(device=p.device, dtype=torch.float32).clone()
            if tuple(ema.shape) != tuple(p.shape):
                raise ValueError(f"spectral state {name!r} has shape {tuple(ema.shape)}, parameter has {tuple(p.shape)}")
            arrivals = int(m["arrivals"])
            if same_svd:
                U, S, V = (m[k].to(device=p.device, dtype=torch.float32).clone() for k in ("U", "S", "V"))
            else:
                U, S, V = self._decompose(name, self._effective_ema(ema, arrivals), arrivals)
            self._anchor[name] = _AnchorState(ema=ema, arrivals=arrivals, source_step=int(m["source_step"]),
                                              U=U, S=S, V=V)
        if not same_svd:
            warnings.warn("spectral state was saved with different SVD/EMA settings; SVDs recomputed from the EMA",
                          RuntimeWarning, stacklevel=2)

    def __repr__(self) -> str:
        return (f"SpectralCorrection(alpha={self.alpha}, tau={self.tau} ({self.tau_mode}), beta={self.beta}, "
                f"svd={self.svd}, targets={len(self.targets)}, inner={self.inner!r})")


def _numerical_rank(S: torch.Tensor, shape) -> int:
    """Singular values above fp32 rounding noise (the matrix_rank rule): the alignment diagnostic
    only counts those, since the singular vectors of a (numerically) zero direction are arbitrary."""
    if S.numel() == 0:
        return 0
    cutoff = float(S[0]) * max(shape) * torch.finfo(torch.float32).eps
    return int((S > cutoff).sum())


def _mean(values: list[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0
