"""``lowrank``: transform coding of the boundary on the sender's own principal directions.

The sender keeps a running mean and covariance of its own dense boundary activations; on refresh it
ships the mean and the top-r principal directions U (state: H x (r + 1) values in bf16; with
``state_bits: 8`` the basis goes as int8 with one bf16 scale per direction). Every token
then sends its r coefficients ``(x - mean) U``, quantised in groups of decreasing precision (the
leading directions carry most of the energy: e.g. 224 coefficients at 4 bits, one bf16 scale per
token and group: 114 bytes per token against 2,304 for dense fp32 or 1,152 for bf16). The gradient
goes back the same way: the receiver sends ``g U`` (the gradient w.r.t. the coefficients) in the
same groups, the sender multiplies by U^T. Exact in the graph up to the quantisation (a straight-
through estimate, identical on both ends).

``reference: "base"`` (issue 26's side-information lever, for fine-tuning a pretrained model): both
ends of the link compute the *base* model's activation at this boundary for the same tokens (its
frozen pretrained weights are on every node already; the engine hands it to the codec as ``ref``),
and only the drift ``x - ref`` is coded on its own principal directions. Fine-tuning moves the
boundary slowly (a probe on SmolLM2 measured the drift at 2% of the activation's energy after about
120 steps), so far fewer coefficients carry it. The gradient cannot use the drift's basis (at step 0
the drift is zero); by default it goes back on the principal directions of the activations
themselves, a second basis shipped with the state (``grad_groups`` coefficients). With
``grad_basis: "forward"`` it goes back on the forward's own drift basis instead (its leading
``grad_groups`` directions): the exact gradient of the coded forward ``ref + U U^T (x - ref)``, as
without a reference, and no second basis in the state. Until the drift has energy (the first fit
of a fine-tune, where ``x == ref``) that basis is fitted on the activations themselves, so the first
steps train through their leading directions rather than arbitrary ones. The price is compute, not
bytes: each end runs the base model's stages before the boundary once more, forward only.

``metric: "gradient"``: what the loss sees of the boundary is not its energy. The receiver alone
holds the dense gradient g of the loss at the boundary; on the first gradient message of each step
in ``metric_steps`` it sends back M = g^T g / T over its gradients since the previous one (that
message's included; default: step 0's and step 1's first; with ``metric_every`` n, also every n
steps after the last one listed; with ``metric_window`` w, only those of the w steps before it; its
upper triangle in bf16, or with ``metric_rank`` k its k leading eigenvectors in int8 and their
eigenvalues, the others at their mean; counted as ``pp_grad_state``),
and the next step's first activation message refits in the metric W = M + floor I: V the principal
directions of W^1/2 cov W^1/2, the sender codes with enc = W^1/2 V, the receiver decodes with dec =
W^-1/2 V (the basis shipped; the same state bytes), an oblique projection dec enc^T that keeps the
drift along the directions the loss reacts to. The gradient goes back as enc Q(dec^T g), the exact
gradient of that coded forward. Directions the gradients did not visit keep the floor's weight (a
share of M's mean eigenvalue), so none is dropped outright.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..configkit import ConfigError, check_choice, check_range
from .base import register_codec
from .quant import SCALE_DTYPE, check_groups, dequantize_groups, group_bytes, quantize_groups
from .stateful import RefreshConfig, RefreshSchedule, RunningMoments, StatefulCodec

STATE_DTYPE = torch.bfloat16
STATE_BITS = (16, 8)      # a basis entry on the wire: bf16, or int8 with one bf16 scale per direction
COEF_NORMS = ("none", "sqrt_std")
REFERENCES = ("none", "base")
GRAD_BASES = ("activations", "forward")
METRICS = ("none", "gradient")
# the gradient metric's floor: a share of its mean eigenvalue added to every direction, so that no
# direction the receiver's gradients happened not to visit is dropped outright (and its inverse square
# root stays bounded)
METRIC_FLOOR = 1e-3
# the drift counts as zero (fit the forward basis on the activations) below this share of their energy
DRIFT_FLOOR = 1e-6


def _int8_columns(u) -> list:
    """(H, r) as int8 entries with one bf16 scale per column (its largest entry / 127)."""
    s = (u.abs().amax(0) / 127).to(STATE_DTYPE)
    sf = s.float()
    q = torch.round(u / torch.where(sf > 0, sf, torch.ones_like(sf))).clamp_(-127, 127)
    return [q.to(torch.int8).contiguous(), s.contiguous()]


def _from_int8_columns(q, s) -> torch.Tensor:
    """The float (H, r) that :func:`_int8_columns` sent."""
    return q.float() * s.float()


@dataclass(frozen=True)
class LowRankConfig(RefreshConfig):
    """``twocircuit.codec`` of ``lowrank``."""
    groups: list = field(default_factory=lambda: [[16, 8], [184, 4]])  # [count, bits] of the
                                    # coefficients, leading principal directions first
    coef_norm: str = "none"         # none | sqrt_std (divide each coefficient by lambda_i ** 0.25
                                    # before quantising; r more bf16 values of state)
    grad_groups: list | None = None  # [count, bits] of the gradient's coefficients (None: ``groups``);
                                    # without a reference at most ``groups``' rank (its leading directions)
    reference: str = "none"         # none | base (code the drift from the base model's activation)
    grad_basis: str = "activations"  # with reference base: activations (a basis of the activations'
                                    # own, shipped) | forward (the drift basis: the exact gradient)
    metric: str = "none"            # none | gradient (fit the basis in the metric of the receiver's
                                    # boundary gradients, sent back once: see the module docstring)
    metric_steps: list = field(default_factory=lambda: [1])  # steps whose first gradient message
                                    # carries the metric: the receiver's gradients since the previous
                                    # one (default: all of step 0's and step 1's first message's)
    metric_every: int = 0           # > 0: after the last of ``metric_steps``, a metric every this many
                                    # steps for the rest of the run (0: only the steps listed)
    metric_window: int = 0          # > 0: a metric step s takes only the gradients of steps
                                    # s - metric_window .. s - 1 (and s's first message), so a metric
                                    # refitted late in a run measures where the model is then; 0: all
                                    # since the previous metric step
    metric_rank: int = 0            # 0: the metric crosses whole (its upper triangle in bf16); k > 0:
                                    # its k leading eigenvectors (int8, a bf16 scale each) and
                                    # eigenvalues, the rest at their mean (about k / (H / 2) of the bytes)
    state_bits: int = 16            # bits of each basis entry a refresh ships: 16 (bf16) | 8 (int8,
                                    # one bf16 scale per direction: about half the state's bytes)

    def validate(self, p):
        try:
            check_groups(self.groups, key=f"{p}.groups")
            if self.grad_groups is not None:
                check_groups(self.grad_groups, key=f"{p}.grad_groups")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        super().validate(p)
        check_choice(self.coef_norm, COEF_NORMS, f"{p}.coef_norm")
        check_choice(self.reference, REFERENCES, f"{p}.reference")
        check_choice(self.grad_basis, GRAD_BASES, f"{p}.grad_basis")
        check_choice(self.metric, METRICS, f"{p}.metric")
        if (not isinstance(self.metric_steps, list) or not self.metric_steps
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in self.metric_steps)):
            raise ConfigError(f"{p}.metric_steps must be a non-empty list of step numbers >= 0 (steps whose "
                              f"first gradient message carries the metric), got {self.metric_steps!r}")
        for name in ("metric_every", "metric_window", "metric_rank"):   # integers (typed_fields) >= 0
            check_range(getattr(self, name), f"{p}.{name}", 0)
        if self.metric != "none" and self.reference != "none" and self.grad_basis != "forward":
            raise ConfigError(f"{p}.metric: \"{self.metric}\" needs the gradient on the forward's basis (the "
                              f"exact gradient of the coded forward); with reference \"base\" set "
                              f"grad_basis \"forward\", or metric \"none\"")
        if isinstance(self.state_bits, bool) or self.state_bits not in STATE_BITS:
            raise ConfigError(f"{p}.state_bits: {self.state_bits!r}; allowed: 16 (bf16 basis) or 8 (int8 "
                              f"basis, one bf16 scale per direction)")
        if (self.reference == "none" or self.grad_basis == "forward") and self.grad_rank > self.rank:
            why, other = (("the gradient shares the activations' basis", "\"reference\": \"base\"")
                          if self.reference == "none" else
                          ("with grad_basis \"forward\" the gradient uses the forward's basis",
                           "grad_basis \"activations\""))
            raise ConfigError(f"{p}.grad_groups: {self.grad_rank} gradient coefficients, but {why} of "
                              f"{self.rank} directions; use at most {self.rank}, or {other} (a basis of its own)")

    @property
    def rank(self) -> int:
        return sum(int(n) for n, _ in self.groups)

    @property
    def grad_rank(self) -> int:
        return sum(int(n) for n, _ in (self.grad_groups or self.groups))


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
        self.grad_groups = check_groups(cfg.grad_groups) if cfg.grad_groups is not None else self.groups
        self.grad_rank = sum(n for n, _ in self.grad_groups)
        if cfg.reference not in REFERENCES:
            raise ValueError(f"lowrank codec: reference = {cfg.reference!r}; allowed: {', '.join(REFERENCES)}")
        self.reference = cfg.reference
        if cfg.grad_basis not in GRAD_BASES:
            raise ValueError(f"lowrank codec: grad_basis = {cfg.grad_basis!r}; allowed: {', '.join(GRAD_BASES)}")
        # a gradient basis of its own: with a reference, unless the gradient takes the forward's
        self.own_grad_basis = self.needs_reference and cfg.grad_basis == "activations"
        if not self.own_grad_basis and self.grad_rank > self.rank:
            raise ValueError(f"lowrank codec: grad_groups rank {self.grad_rank} exceeds the basis' {self.rank}")
        self._STATE_FIELDS = (("mean", "basis") + (("coef_scale",) if self.coef_norm != "none" else ())
                              + (("grad_basis",) if self.own_grad_basis else ()))
        if cfg.state_bits not in STATE_BITS:
            raise ValueError(f"lowrank codec: state_bits = {cfg.state_bits!r}; allowed: 16, 8")
        self.state_bits = cfg.state_bits
        if cfg.metric not in METRICS:
            raise ValueError(f"lowrank codec: metric = {cfg.metric!r}; allowed: {', '.join(METRICS)}")
        self.metric_on = cfg.metric == "gradient"
        if self.metric_on and self.own_grad_basis:
            raise ValueError("lowrank codec: metric \"gradient\" needs grad_basis \"forward\" with a reference")
        # the steps whose first gradient message carries the metric: the listed ones, then every
        # ``metric_every`` (the refresh schedule's rule)
        self.metric_schedule = RefreshSchedule(cfg.metric_steps, cfg.metric_every)
        self.metric_window = int(cfg.metric_window)
        self.metric_rank = int(cfg.metric_rank)
        self.metric = None          # the sender's copy of the receiver's gradient metric (H, H), as sent
        self.enc = None             # the sender's analysis basis with a metric (W^1/2 V); else the basis
        self.metric_pending = False  # a metric crossed since the last state: the next step refits
        # the receiver's gradient moments since the last metric sent (until the last metric step)
        self.grad_moments = RunningMoments(True) if self.metric_on else None
        # tensors on the wire per refresh: an 8-bit basis is two (entries, per-direction scales)
        per_basis = 2 if self.state_bits == 8 else 1
        self._n_state_wire = (1 + per_basis + (self.coef_norm != "none")
                              + (per_basis if self.own_grad_basis else 0))
        self.mean = None
        self.basis = None
        self.coef_scale = None
        self.grad_basis = None
        self._init_state(second=True)
        # with a reference: ``moments`` measure the drift x - ref (the activation basis); with a gradient
        # basis of its own, ``moments_x`` the activations themselves (that basis)
        self.moments_x = RunningMoments(True) if self.own_grad_basis else None

    def metric_due(self, step: int) -> bool:
        return self.metric_on and self.metric_schedule.due(step)

    def metric_collects(self, step: int, first: bool) -> bool:
        # every training gradient up to and including the first message of the next metric step (with
        # a window, only those of the window's steps before it): a pure function of the step, so a
        # run that turns the metric on at a resume past its last metric step collects nothing
        if not self.metric_on:
            return False
        if first and self.metric_schedule.due(step):
            return True
        nxt, w = self.metric_schedule.next_after(step), self.metric_window
        return nxt is not None and (w == 0 or step >= nxt - w)

    def carries_state(self, msg) -> bool:
        # a metric that crossed the link is fitted at the next step's first activation message
        return super().carries_state(msg) or (self.metric_pending and msg.train and msg.first)

    def _metric_msg(self, msg) -> bool:
        return self.metric_on and msg.metric and msg.train

    def grad_state_tensor_count(self, msg) -> int:
        if not self._metric_msg(msg):
            return 0
        return 3 if self._metric_k(msg.hidden) else 1   # eigenvectors, their scales, eigenvalues

    def _metric_k(self, hidden: int) -> int:
        return min(self.metric_rank, hidden)

    def _metric_roots(self, device):
        """(W^1/2, W^-1/2) of the metric W = M + floor I, float64 on ``device``."""
        m = self.metric.to(device=device, dtype=torch.float64)
        h = m.shape[0]
        floor = METRIC_FLOOR * float(m.diagonal().sum().clamp_min(0)) / h + 1e-30
        ev, v = torch.linalg.eigh(m + floor * torch.eye(h, dtype=m.dtype, device=device))
        ev = ev.clamp_min(floor)
        return (v * ev.sqrt()) @ v.T, (v / ev.sqrt()) @ v.T

    @property
    def needs_reference(self) -> bool:
        return self.reference != "none"

    @classmethod
    def check_model(cls, cfg, hidden, where):
        cfg = cfg or LowRankConfig()
        rank = max(cfg.rank, cfg.grad_rank)
        if rank > hidden:
            raise ConfigError(f"twocircuit.codec.groups: {rank} coefficients per token, but the boundary of "
                              f"{where} is {hidden} wide; use at most {hidden} "
                              f"(e.g. \"groups\": [[{hidden - hidden % 2}, 4]]) or a larger model")

    def bytes_per_token(self) -> int:
        return group_bytes(self.groups)

    def payload_bytes(self, hidden, element_bytes, step=None):
        return self.bytes_per_token(), group_bytes(self.grad_groups)

    def describe(self) -> dict:
        d = {"mode": self.name, "rank": self.rank, "bytes_per_token": self.bytes_per_token()}
        if self.grad_groups != self.groups or self.needs_reference:
            d.update(grad_rank=self.grad_rank, grad_bytes_per_token=group_bytes(self.grad_groups),
                     reference=self.reference)
        if self.needs_reference:
            d.update(grad_basis="activations" if self.own_grad_basis else "forward")
        if self.state_bits != 16:
            d.update(state_bits=self.state_bits)
        if self.metric_on:
            d.update(metric="gradient", metric_steps=self.metric_schedule.steps)
            if self.metric_schedule.every:
                d.update(metric_every=self.metric_schedule.every)
            if self.metric_window:
                d.update(metric_window=self.metric_window)
            if self.metric_rank:
                d.update(metric_rank=self.metric_rank)
        return d

    @staticmethod
    def _coef_buffers(tokens, device, groups):
        return [torch.empty(tokens, sum(n * b // 8 for n, b in groups), dtype=torch.uint8, device=device),
                torch.empty(tokens, len(groups), dtype=SCALE_DTYPE, device=device)]

    def _basis_buffers(self, hidden, rank, device):
        if self.state_bits == 8:
            return [torch.empty(hidden, rank, dtype=torch.int8, device=device),
                    torch.empty(rank, dtype=STATE_DTYPE, device=device)]
        return [torch.empty(hidden, rank, dtype=STATE_DTYPE, device=device)]

    def _state_buffers(self, hidden, device):
        return ([torch.empty(hidden, dtype=STATE_DTYPE, device=device)]
                + self._basis_buffers(hidden, self.rank, device)
                + ([torch.empty(self.rank, dtype=STATE_DTYPE, device=device)] if self.coef_norm != "none" else [])
                + (self._basis_buffers(hidden, self.grad_rank, device) if self.own_grad_basis else []))

    def _basis_wire(self, u) -> list:
        """A basis (H, r) as it crosses the link: bf16, or (state_bits 8) int8 entries with one bf16
        scale per direction (its largest entry / 127), rounded to bf16 before use by both ends."""
        if self.state_bits != 8:
            return [u.to(STATE_DTYPE).contiguous()]
        return _int8_columns(u)

    def _basis_from_wire(self, bufs: list) -> torch.Tensor:
        if self.state_bits != 8:
            return bufs.pop(0).float()
        q, s = bufs.pop(0), bufs.pop(0)
        return _from_int8_columns(q, s)

    def _set_state(self, *wire):
        rest = list(wire)
        self.mean = rest.pop(0).float()
        self.basis = self._basis_from_wire(rest)
        self.coef_scale = rest.pop(0).float() if self.coef_norm != "none" else None
        self.grad_basis = self._basis_from_wire(rest) if self.own_grad_basis else None
        self.has_state = True
        self.metric_pending = False

    def state_tensor_count(self, msg) -> int:
        return self._n_state_wire if self.carries_state(msg) else 0

    def _gbasis(self):
        """The gradient's basis: its own (reference, grad_basis activations), else the forward's leading
        columns."""
        return self.grad_basis if self.own_grad_basis else self.basis[:, :self.grad_rank]

    def _gbasis_send(self):
        """The sender's side of the gradient: the analysis basis' leading columns with a metric (the
        transpose of the coded forward's Jacobian dec enc^T), else the gradient's basis."""
        return self.enc[:, :self.grad_rank] if self.enc is not None else self._gbasis()

    def _running_moments(self) -> list:
        return [self.moments] + ([self.moments_x] if self.moments_x is not None else [])

    def state_dict(self) -> dict:
        d = super().state_dict()
        if self.own_grad_basis:
            d["moments_x"] = self.moments_x.state_dict()
        if self.metric_on:
            d.update(metric=self.metric, enc=self.enc, metric_pending=self.metric_pending,
                     grad_moments=self.grad_moments.state_dict())
        return d

    def load_state_dict(self, d: dict) -> None:
        super().load_state_dict(d)
        if self.own_grad_basis:
            self.moments_x.load_state_dict(d["moments_x"])
        if self.metric_on:
            # a checkpoint written without the metric: none yet (a later metric step sends one)
            self.metric, self.enc, self.metric_pending = d.get("metric"), d.get("enc"), d.get("metric_pending", False)
            if "grad_moments" in d:
                self.grad_moments.load_state_dict(d["grad_moments"])

    @classmethod
    def merge_states(cls, states: list[dict]) -> dict:
        out = super().merge_states(states)
        if "moments_x" in states[0]:
            from ..replicas import mean_state
            mx = [s["moments_x"] for s in states if s["moments_x"]["n"]]
            if mx:
                out = {**out, "moments_x": {**mean_state(mx), "n": sum(m["n"] for m in mx) / len(mx)}}
        return out

    def _coef_div(self, c):
        return c if self.coef_scale is None else c / self.coef_scale.to(c.device)

    def _coef_mul(self, c):
        return c if self.coef_scale is None else c * self.coef_scale.to(c.device)

    def _check_ref(self, ref, msg):
        if self.needs_reference and (ref is None or tuple(ref.shape) != tuple(msg.shape)):
            raise ValueError(f"lowrank codec with reference = {self.reference!r} needs the base model's "
                             f"activation of shape {tuple(msg.shape)} at this boundary, got "
                             f"{None if ref is None else tuple(ref.shape)}")

    def pack_activation(self, x, msg, ref=None):
        if max(self.rank, self.grad_rank) > msg.hidden:
            raise ValueError(f"lowrank codec: rank {max(self.rank, self.grad_rank)} exceeds the hidden size {msg.hidden}")
        self._check_ref(ref, msg)
        flat = x.detach().reshape(msg.tokens, msg.hidden)
        if self.needs_reference:
            if msg.train and self.own_grad_basis:
                self.moments_x.add(flat)
            flat = flat.float() - ref.detach().reshape(msg.tokens, msg.hidden).float()
        if msg.train:
            self.moments.add(flat)
        out = []
        if self.carries_state(msg):
            mom = self.moments
            if not mom.n:  # no training statistics yet (evaluation before the first step)
                mom = RunningMoments(True)
                mom.add(flat)
            cov = mom.covariance()
            if self.needs_reference and not self.own_grad_basis:
                # the gradient rides on this basis: while the drift is (numerically) zero, fit it on this
                # batch's activations, whose leading directions the first steps then train through
                cov_x = self._moments_x(x, msg).covariance()
                if float(cov.diagonal().sum()) <= DRIFT_FLOOR * float(cov_x.diagonal().sum()):
                    cov = cov_x
            if self.metric is not None:
                # in the receiver's gradient metric W: the principal directions V of W^1/2 cov W^1/2;
                # the sender codes with enc = W^1/2 V, the receiver decodes with dec = W^-1/2 V (the
                # basis shipped), an oblique projection dec enc^T that keeps what the loss sees
                wh, wi = self._metric_roots(cov.device)
                cov = wh @ cov @ wh
                v = principal_basis(cov, self.rank)
                enc, u = wh @ v, wi @ v
            else:
                enc = u = v = principal_basis(cov, self.rank)
            state = [mom.mean().to(STATE_DTYPE).contiguous(), *self._basis_wire(u)]
            if self.coef_norm == "sqrt_std":  # lambda_i ** 0.25, floored against a zero variance
                var = ((cov @ v) * v).sum(0).clamp_min(0.0)
                state.append(var.clamp_min(var.max() * 1e-12 + 1e-30).pow(0.25).to(STATE_DTYPE).contiguous())
            if self.own_grad_basis:   # the gradient's basis: the activations' own principal directions
                state += self._basis_wire(principal_basis(self._moments_x(x, msg).covariance(), self.grad_rank))
            self._set_state(*state)
            self.enc = enc.float() if self.metric is not None else None
            self.state_bytes_sent += sum(t.numel() * t.element_size() for t in state)
            out += state
        c = (flat.float() - self.mean.to(flat.device)) @ (self.enc if self.enc is not None else self.basis).to(flat.device)
        return out + quantize_groups(self._coef_div(c), self.groups)

    def _moments_x(self, x, msg):
        """The activations' moments: the running ones where they are kept and have data, else this
        batch's (a drift basis' fallback keeps none: it is fitted at the first refresh only)."""
        if self.moments_x is not None and self.moments_x.n:
            return self.moments_x
        mx = RunningMoments(True)
        mx.add(x.detach().reshape(msg.tokens, msg.hidden))
        return mx

    def activation_buffers(self, msg, dtype, device):
        st = self._state_buffers(msg.hidden, device) if self.carries_state(msg) else []
        return st + self._coef_buffers(msg.tokens, device, self.groups)

    def unpack_activation(self, bufs, msg, dtype, ref=None):
        self._check_ref(ref, msg)
        if self.carries_state(msg):
            n = self._n_state_wire
            self._set_state(*bufs[:n])
            bufs = bufs[n:]
        c = self._coef_mul(dequantize_groups(bufs[0], bufs[1], self.groups))
        x = self.mean.to(c.device) + c @ self.basis.to(c.device).T
        if self.needs_reference:
            x = x + ref.detach().reshape(msg.tokens, msg.hidden).float()
        return x.to(dtype).view(msg.shape)

    def pack_gradient(self, g, msg):
        flat = g.detach().reshape(msg.tokens, msg.hidden).float()
        out = []
        if self.metric_on and msg.collect:
            self.grad_moments.add(flat)
        if self._metric_msg(msg):
            # the metric: the second moment of the dense gradients (the receiver alone sees them) since
            # the previous metric (or over its window), this message's included
            mom = self.grad_moments
            m = (mom.s2 / max(mom.n, 1)).float()
            k = self._metric_k(msg.hidden)
            if k:
                # its k leading eigenvectors (int8, a bf16 scale each), their eigenvalues and the mean
                # of the others (bf16)
                ev, v = torch.linalg.eigh(m.double())
                ev = ev.clamp_min(0.0)
                rest = ev[:-k].mean() if k < msg.hidden else ev.new_zeros(())
                out += _int8_columns(v[:, -k:].float())
                out.append(torch.cat([ev[-k:], rest.view(1)]).to(STATE_DTYPE).contiguous())
            else:
                iu = torch.triu_indices(msg.hidden, msg.hidden, device=m.device)
                out.append(m[iu[0], iu[1]].to(STATE_DTYPE).contiguous())
            self.grad_moments = RunningMoments(True)
            self.metric_pending = True
            self.state_bytes_sent += sum(t.numel() * t.element_size() for t in out)
        gc = flat @ self._gbasis().to(g.device)
        return out + quantize_groups(gc, self.grad_groups)

    def gradient_buffers(self, msg, dtype, device):
        h = msg.hidden
        st = []
        if self._metric_msg(msg):
            k = self._metric_k(h)
            st = ([torch.empty(h, k, dtype=torch.int8, device=device),
                   torch.empty(k, dtype=STATE_DTYPE, device=device),
                   torch.empty(k + 1, dtype=STATE_DTYPE, device=device)] if k else
                  [torch.empty(h * (h + 1) // 2, dtype=STATE_DTYPE, device=device)])
        return st + self._coef_buffers(msg.tokens, device, self.grad_groups)

    def unpack_gradient(self, bufs, msg, dtype):
        if self._metric_msg(msg):
            h = msg.hidden
            k = self._metric_k(h)
            if k:
                q, sc, vals, bufs = bufs[0], bufs[1], bufs[2], bufs[3:]
                # the int8 eigenvectors made orthonormal again (QR keeps their span and order), so
                # the metric is symmetric with exactly the eigenvalues sent (>= 0)
                v = torch.linalg.qr(_from_int8_columns(q, sc).double())[0]
                e = vals.double()
                m = (v * e[:k]) @ v.T + e[k] * (torch.eye(h, dtype=torch.float64, device=v.device) - v @ v.T)
                self.metric = m.float()
            else:
                tri, bufs = bufs[0], bufs[1:]
                iu = torch.triu_indices(h, h, device=tri.device)
                m = torch.zeros(h, h, dtype=torch.float32, device=tri.device)
                m[iu[0], iu[1]] = tri.float()
                self.metric = m + m.T - torch.diag(m.diagonal())
            self.metric_pending = True
        gc = dequantize_groups(bufs[0], bufs[1], self.grad_groups)
        return (gc @ self._gbasis_send().to(gc.device).T).to(dtype).view(msg.shape)
