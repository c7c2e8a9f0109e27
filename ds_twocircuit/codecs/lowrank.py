"""``lowrank``: transform coding of the boundary on the sender's own principal directions.

The sender keeps a running mean and covariance of its own dense boundary activations; on refresh it
ships the mean and the top-r principal directions U (state: H x (r + 1) values in bf16). Every token
then sends its r coefficients ``(x - mean) U``, quantised in groups of decreasing precision (the
leading directions carry most of the energy: e.g. 224 coefficients at 4 bits, one bf16 scale per
token and group: 114 bytes per token against 2,304 for dense fp32 or 1,152 for bf16). The gradient
goes back the same way: the receiver sends ``g U`` (the gradient w.r.t. the coefficients) in the
same groups, the sender multiplies by U^T. Exact in the graph up to the quantisation (a straight-
through estimate, identical on both ends).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..configkit import ConfigError, check_choice
from .base import register_codec
from .quant import SCALE_DTYPE, check_groups, dequantize_groups, group_bytes, quantize_groups
from .stateful import RefreshConfig, RunningMoments, StatefulCodec

STATE_DTYPE = torch.bfloat16
COEF_NORMS = ("none", "sqrt_std")


@dataclass(frozen=True)
class LowRankConfig(RefreshConfig):
    """``twocircuit.codec`` of ``lowrank``."""
    groups: list = field(default_factory=lambda: [[16, 8], [184, 4]])  # [count, bits] of the
                                    # coefficients, leading principal directions first
    coef_norm: str = "none"         # none | sqrt_std (divide each coefficient by lambda_i ** 0.25
                                    # before quantising; r more bf16 values of state)

    def validate(self, p):
        try:
            check_groups(self.groups, key=f"{p}.groups")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        super().validate(p)
        check_choice(self.coef_norm, COEF_NORMS, f"{p}.coef_norm")

    @property
    def rank(self) -> int:
        return sum(int(n) for n, _ in self.groups)


def principal_basis(cov: torch.Tensor, rank: int) -> torch.Tensor:
    """(H, rank) top eigenvectors of a symmetric matrix, largest first, each with its largest
    entry positive (a deterministic sign)."""
    _, vecs = torch.linalg.eigh(cov)
    u = vecs[:, -rank:].flip(1)
    idx = u.abs().argmax(0)
    sign = torch.sign(u[idx, torch.arange(rank, device=u.device)])
    return u * torch.where(sign == 0, torch.ones_like(sign), sign)


@register_codec("lowrank")
class LowRankCodec(StatefulCodec):
    """Mean + rank-r principal basis of the sender's own activations; grouped-quantised
    coefficients each way (see the module docstring)."""

    config_cls = LowRankConfig
    COEF_NORMS = COEF_NORMS

    def __init__(self, wire_dtype=None, schedule=None, rescale=False, cfg=None):
        cfg = cfg if cfg is not None else LowRankConfig()
        super().__init__(wire_dtype, schedule, rescale, cfg)
        self.groups = check_groups(cfg.groups)
        self.rank = sum(n for n, _ in self.groups)
        if cfg.coef_norm not in COEF_NORMS:
            raise ValueError(f"lowrank codec: coef_norm = {cfg.coef_norm!r}; allowed: {', '.join(COEF_NORMS)}")
        # ``sqrt_std``: each coefficient is divided by the square root of its standard deviation
        # (lambda_i ** 0.25, shipped with the basis) before the per-group scale is taken, so a
        # group's scale is no longer set by its leading direction alone and the tail directions
        # keep some of their bits (a flatter bit allocation; base-model screening: 2.70 vs 2.74
        # at 224 x 4 bits vs 16 x 8 + 184 x 4). The backward pass is unchanged: the straight-
        # through Jacobian of x -> mean + U diag(s) q(c / s) is U U^T for any s.
        self.coef_norm = cfg.coef_norm
        self._STATE_FIELDS = ("mean", "basis") + (("coef_scale",) if self.coef_norm != "none" else ())
        self.mean = None
        self.basis = None
        self.coef_scale = None
        self._init_state(second=True)

    @classmethod
    def check_model(cls, cfg, hidden, where):
        rank = (cfg or LowRankConfig()).rank
        if rank > hidden:
            raise ConfigError(f"twocircuit.codec.groups: {rank} coefficients per token, but the boundary of "
                              f"{where} is {hidden} wide; use at most {hidden} "
                              f"(e.g. \"groups\": [[{hidden - hidden % 2}, 4]]) or a larger model")

    def bytes_per_token(self) -> int:
        return group_bytes(self.groups)

    def payload_bytes(self, hidden, element_bytes, step=None):
        return self.bytes_per_token(), self.bytes_per_token()

    def describe(self) -> dict:
        return {"mode": self.name, "rank": self.rank, "bytes_per_token": self.bytes_per_token()}

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
