"""Counter-based PRF masks for pipeline boundaries (method notes, section 1).

Every token of a boundary activation keeps exactly ``K = round((1 - p) * H)`` of its ``H``
channels. Which channels is a pure function of a key

    (run seed, boundary id, global step, micro-batch index, hidden size)

and the token's position, never of the activation values. Sender and receiver therefore
regenerate the same kept set and only the kept values cross the wire (no indices).

Invariant: the kept set depends only on the key and (T, H, K), bit-for-bit identical on every
device. The PRF is SplitMix64 (a counter-based generator: element ``i`` of the stream for key
``k`` is ``mix64(k + (i + 1) * GAMMA)``) evaluated in int64 tensor arithmetic, whose wrap-around
multiplication is the same on CPU and CUDA. Ties are impossible because the channel index is
packed into the low bits of the sort key, so the selection is deterministic everywhere.
"""
from __future__ import annotations

import torch

EVAL_STEP_OFFSET = 1 << 40  # evaluation messages use steps from here on, apart from training keys
GAMMA = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1
_CHANNEL_BITS = 20  # hidden sizes up to 2**20 channels
MAX_HIDDEN = 1 << _CHANNEL_BITS


def _signed(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= (1 << 63) else x


def mix64_int(z: int) -> int:
    """SplitMix64 finaliser on Python ints (reference implementation)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def mask_key(seed: int, boundary: int, step: int, micro_batch: int, hidden: int) -> int:
    """64-bit key of one boundary message. Fields are chained through the mixer so that no two
    different tuples share a key by arithmetic coincidence."""
    k = mix64_int(int(seed) + GAMMA)
    for field in (boundary, step, micro_batch, hidden):
        k = mix64_int(k ^ mix64_int(int(field) + GAMMA))
    return k


def _lshr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 tensors (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _lshr(z, 30)) * _signed(_M1)
    z = (z ^ _lshr(z, 27)) * _signed(_M2)
    return z ^ _lshr(z, 31)


def kept_count(hidden: int, p: float) -> int:
    """K = round((1 - p) * H), at least one channel."""
    return max(1, int(round((1.0 - p) * hidden)))


def kept_indices(key: int, tokens: int, hidden: int, keep: int, device="cpu") -> torch.Tensor:
    """int64 tensor (tokens, keep): the kept channels of every token, ascending per row."""
    if not 0 < keep <= hidden:
        raise ValueError(f"keep must be in [1, {hidden}], got {keep}")
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} above the supported {MAX_HIDDEN}")
    if keep == hidden:
        return torch.arange(hidden, device=device).expand(tokens, hidden).contiguous()
    counter = torch.arange(1, tokens * hidden + 1, dtype=torch.int64, device=device)
    z = _mix64(counter * _signed(GAMMA) + _signed(key))
    # 43 random high bits above 20 channel bits: unique, non-negative sort keys.
    sort_key = (_lshr(z, 21) << _CHANNEL_BITS) | (counter - 1).remainder(hidden)
    sort_key = sort_key.view(tokens, hidden)
    idx = torch.topk(sort_key, keep, dim=1, largest=False, sorted=False).indices
    return torch.sort(idx, dim=1).values


def reference_kept_indices(key: int, tokens: int, hidden: int, keep: int) -> list[list[int]]:
    """Pure-Python implementation of :func:`kept_indices` (for tests and audits)."""
    out = []
    for t in range(tokens):
        row = []
        for c in range(hidden):
            i = t * hidden + c + 1
            z = mix64_int((key + i * GAMMA) & _MASK64)
            row.append(((z >> 21) << _CHANNEL_BITS | c, c))
        row.sort()
        out.append(sorted(c for _, c in row[:keep]))
    return out


class MaskSchedule:
    """Effective mask rate over training: dense for ``warmup_steps``, then a linear ramp of p
    from 0 to ``mask_rate`` over ``ramp_steps``, then constant."""

    def __init__(self, mask_rate: float, warmup_steps: int = 0, ramp_steps: int = 0):
        self.mask_rate = float(mask_rate)
        self.warmup_steps = int(warmup_steps)
        self.ramp_steps = int(ramp_steps)

    def rate(self, step: int) -> float:
        if step < self.warmup_steps:
            return 0.0
        if self.ramp_steps > 0:
            frac = min(1.0, (step - self.warmup_steps + 1) / self.ramp_steps)
            return self.mask_rate * frac
        return self.mask_rate

    def keep(self, step: int, hidden: int) -> int:
        return kept_count(hidden, self.rate(step))


def boundary_mask(key: int, shape, keep: int, device="cpu", dtype=torch.float32) -> torch.Tensor:
    """Dense 0/1 mask of ``shape`` (..., H) with the kept channels of ``key`` set to one."""
    hidden = shape[-1]
    tokens = 1
    for s in shape[:-1]:
        tokens *= s
    idx = kept_indices(key, tokens, hidden, keep, device=device)
    m = torch.zeros(tokens, hidden, device=device, dtype=dtype)
    m.scatter_(1, idx, 1.0)
    return m.view(*shape)
