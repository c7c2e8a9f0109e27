"""Boundary codecs with state: the sender measures its own dense activations and ships statistics.

Why (``docs/benchmarks/quality.md``, ``notes/quality-screening``): at 5% of the boundary bytes the
PRF mask with zero fill destroys the model (held-out loss 2.56 -> 12.4 on SmolLM2-135M) because the
residual stream carries a few massive, nearly input-independent channels and a low-dimensional
structure that random coordinates cannot keep. Two codecs that keep the dense signal:

* :class:`MeanFillCodec` -- the PRF mask, with the dropped channels filled with per-channel means
  the sender measured on its own outputs (state: H values per refresh).
* :class:`LowRankCodec` -- transform coding. The sender keeps a running mean and covariance of its
  own dense boundary activations; on refresh it ships the mean and the top-r principal directions U
  (state: H x (r + 1) values in bf16). Every token then sends its r coefficients ``(x - mean) U``,
  quantised in groups of decreasing precision (the leading directions carry most of the energy:
  e.g. 16 coefficients at 8 bits and 184 at 4 bits, one bf16 scale per token and group: 112 bytes
  per token against 2,304 for dense fp32). The gradient goes back the same way: the receiver sends
  ``g U`` (the gradient w.r.t. the coefficients) in the same groups, the sender multiplies by U^T.
  Exact in the graph up to the quantisation (a straight-through estimate, identical on both ends).

Invariant: both ends apply the state only from the message that carries it, so sender and receiver
hold the same (bf16-rounded) mean and basis at every message; which messages carry state is a pure
function of (step, first message of the step, state present), known to both ends.

Pure torch, no DeepSpeed: the engine adapter and the single-process reference share it.
"""
from __future__ import annotations

import torch

from .codec import DenseCodec, Message, RandomMaskCodec

STATE_DTYPE = torch.bfloat16
SCALE_DTYPE = torch.bfloat16
ALLOWED_BITS = (2, 4, 8)


class RefreshSchedule:
    """Which training steps refresh the codec state: the listed ``steps``, plus every ``every``
    steps after the last listed one (0: never)."""

    def __init__(self, steps=(0,), every: int = 0):
        self.steps = sorted(int(s) for s in steps)
        self.every = int(every)

    def due(self, step: int) -> bool:
        if step in self.steps:
            return True
        last = self.steps[-1] if self.steps else 0
        return self.every > 0 and step > last and (step - last) % self.every == 0


class RunningMoments:
    """Token count, sum and (optionally) sum of outer products of the sender's activations, in
    float64 (a covariance of H x H)."""

    def __init__(self, second: bool):
        self.second = second
        self.n = 0
        self.s1 = None
        self.s2 = None

    def add(self, flat: torch.Tensor) -> None:
        f = flat.detach().to(torch.float64)
        if self.s1 is None:
            self.s1 = torch.zeros(f.shape[1], dtype=torch.float64, device=f.device)
            if self.second:
                self.s2 = torch.zeros(f.shape[1], f.shape[1], dtype=torch.float64, device=f.device)
        self.n += f.shape[0]
        self.s1 += f.sum(0)
        if self.second:
            self.s2 += f.T @ f

    def mean(self) -> torch.Tensor:
        return self.s1 / max(self.n, 1)

    def covariance(self) -> torch.Tensor:
        m = self.mean()
        return self.s2 / max(self.n, 1) - torch.outer(m, m)

    def state_dict(self):
        return {"n": self.n, "s1": self.s1, "s2": self.s2}

    def load_state_dict(self, d):
        self.n, self.s1, self.s2 = d["n"], d["s1"], d["s2"]


def principal_basis(cov: torch.Tensor, rank: int) -> torch.Tensor:
    """(H, rank) top eigenvectors of a symmetric matrix, largest first, each with its largest
    entry positive (a deterministic sign)."""
    _, vecs = torch.linalg.eigh(cov)
    u = vecs[:, -rank:].flip(1)
    idx = u.abs().argmax(0)
    sign = torch.sign(u[idx, torch.arange(rank, device=u.device)])
    return u * torch.where(sign == 0, torch.ones_like(sign), sign)


# ------------------------------------------------------------------ grouped quantisation
def group_bytes(groups) -> int:
    """Wire bytes per token of the packed coefficients plus one bf16 scale per group."""
    return sum(n * b // 8 for n, b in groups) + 2 * len(groups)


def quantize_groups(c: torch.Tensor, groups) -> list[torch.Tensor]:
    """(T, r) float -> [packed uint8 (T, sum n*b/8), scales bf16 (T, G)]. Per token and group:
    symmetric round-to-nearest at ``b`` bits with the scale max|c| / (2^(b-1) - 1), rounded to bf16
    before use so that both ends dequantise with the same scale."""
    packed, scales, i = [], [], 0
    for n, b in groups:
        x = c[:, i:i + n].float()
        i += n
        lim = (1 << (b - 1)) - 1
        s = (x.abs().amax(1, keepdim=True) / lim).to(SCALE_DTYPE)
        sf = s.float()
        q = torch.round(x / torch.where(sf > 0, sf, torch.ones_like(sf))).clamp_(-lim, lim)
        u = (q + lim).to(torch.int32)  # 0 .. 2 lim < 2^b
        per = 8 // b
        u = u.view(u.shape[0], n // per, per)
        shifts = torch.arange(per, device=u.device, dtype=torch.int32) * b
        packed.append((u << shifts).sum(2).to(torch.uint8))
        scales.append(s)
    return [torch.cat(packed, 1).contiguous(), torch.cat(scales, 1).contiguous()]


def dequantize_groups(packed: torch.Tensor, scales: torch.Tensor, groups) -> torch.Tensor:
    out, col = [], 0
    for g, (n, b) in enumerate(groups):
        per = 8 // b
        nb = n // per
        byte = packed[:, col:col + nb].to(torch.int32)
        col += nb
        lim = (1 << (b - 1)) - 1
        shifts = torch.arange(per, device=byte.device, dtype=torch.int32) * b
        u = (byte.unsqueeze(2) >> shifts) & ((1 << b) - 1)
        q = u.reshape(u.shape[0], n).float() - lim
        out.append(q * scales[:, g:g + 1].float())
    return torch.cat(out, 1)


def check_groups(groups, hidden: int | None = None, key: str = "groups") -> list[tuple[int, int]]:
    """Validate ``[[n, bits], ...]``; errors name ``key`` and what is allowed."""
    if not isinstance(groups, (list, tuple)) or not groups:
        raise ValueError(f"{key} must be a non-empty list of [count, bits] pairs, got {groups!r}")
    out = []
    for g in groups:
        if (not isinstance(g, (list, tuple)) or len(g) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in g)):
            raise ValueError(f"{key}: each entry must be [count, bits] (integers), got {g!r}")
        n, b = g
        if b not in ALLOWED_BITS:
            raise ValueError(f"{key}: bits = {b} in {g!r}; allowed: {', '.join(map(str, ALLOWED_BITS))}")
        if n < 1 or n % (8 // b):
            raise ValueError(f"{key}: count {n} in {g!r} must be a positive multiple of {8 // b} "
                             f"(values packed per byte at {b} bits)")
        out.append((n, b))
    r = sum(n for n, _ in out)
    if hidden is not None and r > hidden:
        raise ValueError(f"{key}: rank {r} (the sum of the counts) exceeds the hidden size {hidden}")
    return out


# ------------------------------------------------------------------ codecs
class _StatefulMixin:
    stateful = True

    def _init_state(self, refresh: RefreshSchedule, second: bool):
        self.refresh = refresh
        self.moments = RunningMoments(second)
        self.has_state = False
        self.state_bytes_sent = 0

    _STATE_FIELDS: tuple = ()

    def state_dict(self) -> dict:
        """Everything a resumed run needs to continue bit-for-bit (saved per rank)."""
        return {"moments": self.moments.state_dict(), "has_state": self.has_state,
                **{k: getattr(self, k) for k in self._STATE_FIELDS}}

    def load_state_dict(self, d: dict) -> None:
        self.moments.load_state_dict(d["moments"])
        self.has_state = d["has_state"]
        for k in self._STATE_FIELDS:
            setattr(self, k, d[k])

    def state_tensor_count(self, msg: Message) -> int:
        """How many leading tensors of this activation message are codec state (call before
        packing/unpacking it)."""
        return len(self._STATE_FIELDS) if self.carries_state(msg) else 0

    def carries_state(self, msg: Message) -> bool:
        """Whether this activation message carries new state (both ends answer the same)."""
        return msg.refresh or not self.has_state


class MeanFillCodec(_StatefulMixin, RandomMaskCodec):
    """PRF mask; dropped channels = the sender's running per-channel mean (shipped on refresh, in
    the wire dtype). Gradients go back as for the plain mask: the fill is a constant."""

    name = "meanfill"
    _STATE_FIELDS = ("fill",)

    def __init__(self, wire_dtype=None, refresh: RefreshSchedule | None = None):
        super().__init__(wire_dtype)
        self._init_state(refresh or RefreshSchedule(), second=False)
        self.fill = None

    def pack_activation(self, x, msg):
        flat = x.detach().reshape(msg.tokens, msg.hidden)
        if msg.train:
            self.moments.add(flat)
        out = []
        if self.carries_state(msg):
            m = self.moments.mean() if self.moments.n else flat.double().mean(0)
            st = m.to(self._wire(x.dtype)).contiguous()
            self.fill = st.to(x.dtype)
            self.has_state = True
            self.state_bytes_sent += st.numel() * st.element_size()
            out.append(st)
        return out + RandomMaskCodec._pack(self, x, msg)

    def activation_buffers(self, msg, dtype, device):
        st = [torch.empty(msg.hidden, dtype=self._wire(dtype), device=device)] if self.carries_state(msg) else []
        return st + RandomMaskCodec._buffers(self, msg, dtype, device)

    def unpack_activation(self, bufs, msg, dtype):
        if self.carries_state(msg):
            self.fill = bufs[0].to(dtype)
            self.has_state = True
            bufs = bufs[1:]
        if msg.keep >= msg.hidden:
            return DenseCodec.unpack_activation(self, bufs, msg, dtype)
        out = self.fill.to(bufs[0].device).expand(msg.tokens, msg.hidden).clone()
        out.scatter_(1, self.indices(msg, bufs[0].device), bufs[0].to(dtype))
        return out.view(msg.shape)

    pack_gradient = RandomMaskCodec._pack
    gradient_buffers = RandomMaskCodec._buffers
    unpack_gradient = RandomMaskCodec._unpack

    def reset(self):  # per-step: drop the index cache, keep the state
        RandomMaskCodec.reset(self)


class LowRankCodec(_StatefulMixin, DenseCodec):
    """Mean + rank-r principal basis of the sender's own activations; grouped-quantised
    coefficients each way (see the module docstring)."""

    name = "lowrank"
    COEF_NORMS = ("none", "sqrt_std")

    def __init__(self, wire_dtype=None, groups=((16, 8), (184, 4)), refresh: RefreshSchedule | None = None,
                 coef_norm: str = "none"):
        super().__init__(wire_dtype)
        self.groups = check_groups(groups)
        self.rank = sum(n for n, _ in self.groups)
        if coef_norm not in self.COEF_NORMS:
            raise ValueError(f"lowrank codec: coef_norm = {coef_norm!r}; allowed: {', '.join(self.COEF_NORMS)}")
        # ``sqrt_std``: each coefficient is divided by the square root of its standard deviation
        # (lambda_i ** 0.25, shipped with the basis) before the per-group scale is taken, so a
        # group's scale is no longer set by its leading direction alone and the tail directions
        # keep some of their bits (a flatter bit allocation; base-model screening: 2.70 vs 2.74
        # at 224 x 4 bits vs 16 x 8 + 184 x 4). The backward pass is unchanged: the straight-
        # through Jacobian of x -> mean + U diag(s) q(c / s) is U U^T for any s.
        self.coef_norm = coef_norm
        self._STATE_FIELDS = ("mean", "basis") + (("coef_scale",) if coef_norm != "none" else ())
        self.mean = None
        self.basis = None
        self.coef_scale = None
        self._init_state(refresh or RefreshSchedule(), second=True)

    def bytes_per_token(self) -> int:
        return group_bytes(self.groups)

    def _coef_buffers(self, tokens, device):
        return [torch.empty(tokens, sum(n * b // 8 for n, b in self.groups), dtype=torch.uint8, device=device),
                torch.empty(tokens, len(self.groups), dtype=SCALE_DTYPE, device=device)]

    def _state_buffers(self, hidden, device):
        return [torch.empty(hidden, dtype=STATE_DTYPE, device=device),
                torch.empty(hidden, self.rank, dtype=STATE_DTYPE, device=device)] + (
                    [torch.empty(self.rank, dtype=STATE_DTYPE, device=device)] if self.coef_norm != "none" else [])

    def _set_state(self, mean_w, basis_w, scale_w=None):
        self.mean, self.basis = mean_w.float(), basis_w.float()
        self.coef_scale = scale_w.float() if scale_w is not None else None
        self.has_state = True

    def _coef_div(self, c):
        return c if self.coef_scale is None else c / self.coef_scale.to(c.device)

    def _coef_mul(self, c):
        return c if self.coef_scale is None else c * self.coef_scale.to(c.device)

    def pack_activation(self, x, msg):
        if self.rank > msg.hidden:
            raise ValueError(f"lowrank codec: rank {self.rank} exceeds the hidden size {msg.hidden}")
        flat = x.detach().reshape(msg.tokens, msg.hidden)
        if msg.train:
            self.moments.add(flat)
        out = []
        if self.carries_state(msg):
            mom = self.moments
            if not mom.n:  # no training statistics yet (evaluation before the first step)
                mom = RunningMoments(True)
                mom.add(flat)
            cov = mom.covariance()
            u = principal_basis(cov, self.rank)
            state = [mom.mean().to(STATE_DTYPE).contiguous(), u.to(STATE_DTYPE).contiguous()]
            if self.coef_norm == "sqrt_std":  # lambda_i ** 0.25, floored against a zero variance
                var = ((cov @ u) * u).sum(0).clamp_min(0.0)
                state.append(var.clamp_min(var.max() * 1e-12 + 1e-30).pow(0.25).to(STATE_DTYPE).contiguous())
            self._set_state(*state)
            self.state_bytes_sent += sum(t.numel() * t.element_size() for t in state)
            out += state
        c = (flat.float() - self.mean.to(flat.device)) @ self.basis.to(flat.device)
        return out + quantize_groups(self._coef_div(c), self.groups)

    def activation_buffers(self, msg, dtype, device):
        st = self._state_buffers(msg.hidden, device) if self.carries_state(msg) else []
        return st + self._coef_buffers(msg.tokens, device)

    def unpack_activation(self, bufs, msg, dtype):
        if self.carries_state(msg):
            n = len(self._STATE_FIELDS)
            self._set_state(*bufs[:n])
            bufs = bufs[n:]
        c = self._coef_mul(dequantize_groups(bufs[0], bufs[1], self.groups))
        x = self.mean.to(c.device) + c @ self.basis.to(c.device).T
        return x.to(dtype).view(msg.shape)

    def pack_gradient(self, g, msg):
        gc = g.detach().reshape(msg.tokens, msg.hidden).float() @ self.basis.to(g.device)
        return quantize_groups(gc, self.groups)

    def gradient_buffers(self, msg, dtype, device):
        return self._coef_buffers(msg.tokens, device)

    def unpack_gradient(self, bufs, msg, dtype):
        gc = dequantize_groups(bufs[0], bufs[1], self.groups)
        return (gc @ self.basis.to(gc.device).T).to(dtype).view(msg.shape)
