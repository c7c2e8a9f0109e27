"""Grouped symmetric quantisation of per-token coefficient vectors (the ``lowrank`` codec's wire)."""
from __future__ import annotations

import math
import torch

SCALE_DTYPE = torch.bfloat16
ALLOWED_BITS = (2, 3, 4, 8)   # the boundary codec's layouts (3 bits: 8 values in 3 bytes)


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
        packed.append(_pack(u, b))
        scales.append(s)
    return [torch.cat(packed, 1).contiguous(), torch.cat(scales, 1).contiguous()]


def _pack(u: torch.Tensor, b: int) -> torch.Tensor:
    """(T, n) int32 codes < 2^b -> (T, n b / 8) uint8: 8 / b codes a byte where b divides 8, else
    (3 bits) 8 codes in b bytes, little-endian, lowest code in the lowest bits."""
    T, n = u.shape
    if 8 % b == 0:
        per = 8 // b
        shifts = torch.arange(per, device=u.device, dtype=torch.int32) * b
        return (u.view(T, n // per, per) << shifts).sum(2).to(torch.uint8)
    shifts = torch.arange(8, device=u.device, dtype=torch.int64) * b
    word = (u.view(T, n // 8, 8).to(torch.int64) << shifts).sum(2)          # 8 b bits
    nbytes = torch.arange(b, device=u.device, dtype=torch.int64) * 8
    return ((word.unsqueeze(2) >> nbytes) & 255).to(torch.uint8).reshape(T, n // 8 * b)


def _unpack(byte: torch.Tensor, n: int, b: int) -> torch.Tensor:
    """The inverse of :func:`_pack`: (T, n b / 8) uint8 -> (T, n) int64 codes."""
    T = byte.shape[0]
    if 8 % b == 0:
        per = 8 // b
        shifts = torch.arange(per, device=byte.device, dtype=torch.int32) * b
        return ((byte.to(torch.int32).unsqueeze(2) >> shifts) & ((1 << b) - 1)).reshape(T, n)
    nbytes = torch.arange(b, device=byte.device, dtype=torch.int64) * 8
    word = (byte.reshape(T, n // 8, b).to(torch.int64) << nbytes).sum(2)
    shifts = torch.arange(8, device=byte.device, dtype=torch.int64) * b
    return ((word.unsqueeze(2) >> shifts) & ((1 << b) - 1)).reshape(T, n)


def dequantize_groups(packed: torch.Tensor, scales: torch.Tensor, groups) -> torch.Tensor:
    out, col = [], 0
    for g, (n, b) in enumerate(groups):
        nb = n * b // 8
        u = _unpack(packed[:, col:col + nb], n, b)
        col += nb
        lim = (1 << (b - 1)) - 1
        q = u.float() - lim
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
        unit = 8 // math.gcd(8, b)   # values in a whole number of bytes: 4 at 2 bits, 8 at 3
        if n < 1 or n % unit:
            raise ValueError(f"{key}: count {n} in {g!r} must be a positive multiple of {unit} "
                             f"({unit} values fill {unit * b // 8} byte(s) at {b} bits)")
        out.append((n, b))
    r = sum(n for n, _ in out)
    if hidden is not None and r > hidden:
        raise ValueError(f"{key}: rank {r} (the sum of the counts) exceeds the hidden size {hidden}")
    return out
