"""An analytic cost model of one training step on a mesh of pipeline stages joined by slow links.

What it models (each term in seconds, per optimizer step):

* compute: a micro-batch of ``T`` tokens costs ``2 N T`` FLOPs forward and ``4 N T`` backward for
  ``N`` parameters; a stage holds ``N / pp`` of them and runs at ``flops`` FLOP/s (the effective
  rate: peak x utilisation);
* boundaries: each micro-batch crosses every link once forward (activations) and once backward
  (activation gradients), ``bytes_per_token`` each way (the codec's payload, as measured), plus the
  codec state per step spread over the step's micro-batches; a transfer costs ``latency + bytes x 8
  / rate``. DeepSpeed's pipeline sends block (send and compute do not overlap), so in the 1F1B
  schedule a stage's slot per micro-batch is ``t_fwd + t_bwd + t_send_act + t_send_grad`` and the
  step is ``(m + pp - 1)`` slots (``m`` micro-batches: the fill and drain bubbles included);
* data parallelism: every rank sends ``dp_bytes_per_rank`` per step over its link (a ring
  all-reduce of 2 (d - 1) / d of the payload, plus ``2 (d - 1)`` latencies); ``dp_hidden`` of it
  overlaps compute (Streaming DiLoCo's overlapped fragments: the share measured as
  ``hidden_comm_s / comm_s``), the rest adds to the step;
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
    anchor_bytes_per_step: float = 0.0  # anchor traffic per step and rank (shares the DP link)

    def __post_init__(self):
        for k in ("params", "flops", "link_mbit"):
            if not getattr(self, k) > 0:
                raise ValueError(f"{k} must be > 0, got {getattr(self, k)!r}")
        for k in ("pp", "dp", "micro_batches", "tokens_per_micro"):
            if type(getattr(self, k)) is not int or getattr(self, k) < 1:
                raise ValueError(f"{k} must be an integer >= 1, got {getattr(self, k)!r}")
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
    slot = t_fwd + t_bwd + 2.0 * t_hop
    slots = s.micro_batches + s.pp - 1
    pipeline = slots * slot
    dp_bytes = s.dp_bytes_per_rank + s.anchor_bytes_per_step
    t_dp = transfer_s(dp_bytes, s.link_mbit) + (2 * (s.dp - 1) * s.latency_s if s.dp_bytes_per_rank > 0 else 0.0)
    dp_exposed = t_dp * (1.0 - s.dp_hidden)
    step = pipeline + dp_exposed
    tokens = s.dp * s.micro_batches * s.tokens_per_micro
    return {"compute_s": slots * (t_fwd + t_bwd), "bubble_s": (s.pp - 1) * (t_fwd + t_bwd),
            "boundary_s": slots * 2.0 * t_hop, "dp_s": t_dp, "dp_exposed_s": dp_exposed,
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


def paper_equivalent_link_mbit(s: Setting, reference: Setting) -> float:
    """The link rate at which setting ``s`` has the same communication / computation ratio of its
    dense pipeline boundaries as ``reference`` (e.g. this machine's compute vs an A100 mesh at
    200 Mbit/s): comm time scales with 1 / rate, so rate = rate_ref x (ratio_ref / ratio_s at
    rate_ref)."""
    def ratio(x: Setting, rate: float) -> float:
        b = step_breakdown(x.replace(link_mbit=rate, latency_s=0.0))
        return (b["boundary_s"] + b["dp_s"]) / b["compute_s"]
    r_ref = ratio(reference, reference.link_mbit)
    r_s = ratio(s, reference.link_mbit)
    if r_ref <= 0:
        raise ValueError("the reference setting sends nothing: no communication ratio to match")
    return reference.link_mbit * r_s / r_ref
