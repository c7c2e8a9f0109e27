"""An analytic cost model of one training step on a mesh of pipeline stages joined by slow links.

What it models (each term in seconds, per optimizer step):

* compute: a micro-batch of ``T`` tokens costs ``2 N T`` FLOPs forward and ``4 N T`` backward for
  ``N`` parameters; a stage holds ``N / pp`` of them and runs at ``flops`` FLOP/s (the effective
  rate: peak x utilisation);
* boundaries: each micro-batch crosses every link once forward (activations) and once backward
  (activation gradients), ``bytes_per_token`` each way (the codec's payload, as measured), plus the
  codec state per step spread over the step's micro-batches; a transfer costs ``latency + bytes x 8
  / rate`` (``t_hop``). The step is ``(m + pp - 1)`` compute slots of ``t_fwd + t_bwd`` (``m``
  micro-batches: the fill and drain bubbles included) plus the boundary time on the critical path
  of 1F1B: the first micro-batch's activation crosses ``pp - 1`` links and its gradient comes back
  before stage 0 runs its first backward, then every further micro-batch of stage 0 waits for one
  round trip (its next forward goes out only after a backward), so ``2 (m + pp - 2) t_hop``. (A
  send itself does not stall its sender: the kernel buffers it; the round trips do.) Checked
  against kernel-capped runs: 8.2 round trips of 4 micro-batches on 2 stages at 8 Mbit/s;
* data parallelism: every rank sends ``dp_bytes_per_rank`` per step on average over its link (a
  ring all-reduce of 2 (d - 1) / d of the payload, plus ``2 (d - 1)`` latencies). A sync every
  ``dp_sync_every`` steps carries that many steps' bytes; with ``dp_overlap_steps`` > 0 (Streaming
  DiLoCo's overlap) it runs behind that many steps of pipeline work on other links, and only what
  is left over adds to the step; ``dp_hidden`` is a further share hidden (measured
  ``hidden_comm_s / comm_s``; 0 by default);
* anchor traffic is asynchronous (a separate circuit reads snapshots) and only shares the links:
  its bytes per step add to the DP link's.

Everything is per link and direction at ``link_mbit`` (full duplex, one link per neighbouring pair
of stages and one per rank into the DP ring). The model is a projection: it is checked against the
emulated runs on capped links (``launch/project.py --validate``) before it is applied elsewhere.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    params: float               # N: model parameters
    pp: int                     # pipeline stages
    dp: int                     # data-parallel replicas
    micro_batches: int          # m per step and replica
    tokens_per_micro: int       # T: micro-batch size x sequence length
    flops: float                # effective FLOP/s of one GPU
    link_mbit: float            # link rate, Mbit/s, each direction
    latency_s: float = 0.0      # one-way latency of a message
    bytes_per_token: float = 0.0        # boundary payload per token, each direction
    state_bytes_per_step: float = 0.0   # codec state per step and link (e.g. a low-rank basis refresh)
    dp_bytes_per_rank: float = 0.0      # DP bytes one rank sends per step (all methods included)
    dp_hidden: float = 0.0              # share of the DP time hidden behind compute, in [0, 1]
    dp_sync_every: int = 1              # steps between DP syncs on a link (DiLoCo: H; Streaming: H / F)
    dp_overlap_steps: int = 0           # steps of pipeline work a sync runs behind (Streaming DiLoCo)
    anchor_bytes_per_step: float = 0.0  # anchor traffic per step and rank (shares the DP link)

    def __post_init__(self):
        for k in ("params", "flops", "link_mbit"):
            if not getattr(self, k) > 0:
                raise ValueError(f"{k} must be > 0, got {getattr(self, k)!r}")
        for k in ("pp", "dp", "micro_batches", "tokens_per_micro", "dp_sync_every"):
            if type(getattr(self, k)) is not int or getattr(self, k) < 1:
                raise ValueError(f"{k} must be an integer >= 1, got {getattr(self, k)!r}")
        if type(self.dp_overlap_steps) is not int or self.dp_overlap_steps < 0:
            raise ValueError(f"dp_overlap_steps must be an integer >= 0, got {self.dp_overlap_steps!r}")
        if not 0.0 <= self.dp_hidden <= 1.0:
            raise ValueError(f"dp_hidden must be in [0, 1], got {self.dp_hidden!r}")

    def replace(self, **kw) -> "Setting":
        return dataclasses.replace(self, **kw)


def transfer_s(nbytes: float, link_mbit: float, latency_s: float = 0.0) -> float:
    """Seconds to send ``nbytes`` over one link (0 bytes: nothing sent, no latency)."""
    if nbytes <= 0:
        return 0.0
    return latency_s + nbytes * 8.0 / (link_mbit * 1e6)


def step_breakdown(s: Setting) -> dict:
    """Seconds per step by term, the step time and tokens/s (all replicas)."""
    stage_params = s.params / s.pp
    t_fwd = 2.0 * stage_params * s.tokens_per_micro / s.flops
    t_bwd = 4.0 * stage_params * s.tokens_per_micro / s.flops
    if s.pp > 1:
        per_micro = s.bytes_per_token * s.tokens_per_micro + s.state_bytes_per_step / s.micro_batches
        t_hop = transfer_s(per_micro, s.link_mbit, s.latency_s)
    else:
        t_hop = 0.0
    slots = s.micro_batches + s.pp - 1
    compute = slots * (t_fwd + t_bwd)
    boundary = 2.0 * (s.micro_batches + s.pp - 2) * t_hop
    pipeline = compute + boundary
    dp_bytes = s.dp_bytes_per_rank + s.anchor_bytes_per_step
    every = s.dp_sync_every
    # one sync carries `every` steps' bytes; its transfer runs behind `dp_overlap_steps` steps of
    # pipeline work; what is left over is spread over the `every` steps
    t_sync = transfer_s(dp_bytes * every, s.link_mbit) + (2 * (s.dp - 1) * s.latency_s if s.dp_bytes_per_rank > 0
                                                          else 0.0)
    t_dp = t_sync / every
    dp_exposed = max(0.0, t_sync - s.dp_overlap_steps * pipeline) * (1.0 - s.dp_hidden) / every
    step = pipeline + dp_exposed
    tokens = s.dp * s.micro_batches * s.tokens_per_micro
    return {"compute_s": compute, "bubble_s": (s.pp - 1) * (t_fwd + t_bwd),
            "boundary_s": boundary, "dp_s": t_dp, "dp_exposed_s": dp_exposed,
            "step_s": step, "tokens_per_step": tokens, "tokens_per_s": tokens / step}


def tokens_per_s(s: Setting) -> float:
    return step_breakdown(s)["tokens_per_s"]


def compute_only(s: Setting) -> Setting:
    """The same setting with free communication (for the share of the compute-only rate)."""
    return s.replace(bytes_per_token=0.0, state_bytes_per_step=0.0, dp_bytes_per_rank=0.0,
                     anchor_bytes_per_step=0.0, latency_s=0.0)


def ring_allreduce_bytes(payload_bytes: float, dp: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``payload_bytes`` over ``dp`` ranks."""
    return 0.0 if dp <= 1 else 2.0 * (dp - 1) / dp * payload_bytes
