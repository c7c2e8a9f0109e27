"""Post-hoc magnitude pruning of the 2-D decoder matrices (attention q/k/v/o, MLP projections).

Embeddings, the LM head and norm weights are never pruned. Scopes:

* ``per-layer`` (default): every matrix loses exactly ``round(s * numel)`` of its smallest-magnitude
  entries, so every layer keeps the same density (the usual magnitude baseline; global pruning
  lets matrices with small weights be emptied first);
* ``global``: one magnitude threshold over all decoder matrices together, exactly
  ``round(s * total)`` entries removed.

Ties at the threshold are broken by position, so the achieved sparsity equals the requested one
up to that rounding. :class:`Pruner` keeps a copy of the original matrices and restores them
exactly before each new sparsity.
"""
from __future__ import annotations

import re

import torch

SCOPES = ("per-layer", "global")
_DECODER = re.compile(r"(^|\.)layers\.\d+\.")


def prunable(model) -> list[tuple[str, torch.nn.Parameter]]:
    """Named 2-D weight matrices inside the decoder layers."""
    return [(n, p) for n, p in model.named_parameters()
            if p.dim() == 2 and n.endswith("weight") and _DECODER.search(n)]


def _smallest(abs_flat: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask of exactly ``k`` smallest entries (ties broken by position)."""
    mask = torch.zeros_like(abs_flat, dtype=torch.bool)
    if k <= 0:
        return mask
    if k >= abs_flat.numel():
        return ~mask
    t = torch.kthvalue(abs_flat.float(), k).values
    mask = abs_flat < t
    need = k - int(mask.sum())
    if need > 0:
        ties = (abs_flat == t).nonzero().flatten()[:need]
        mask[ties] = True
    return mask


class Pruner:
    def __init__(self, model):
        self.params = prunable(model)
        if not self.params:
            raise ValueError("no 2-D decoder matrices found (expected modules named *.layers.<i>.*)")
        self.original = {n: p.detach().to("cpu", copy=True) for n, p in self.params}
        self.total = sum(p.numel() for _, p in self.params)

    @torch.no_grad()
    def restore(self) -> None:
        for n, p in self.params:
            p.copy_(self.original[n].to(p.device))

    @torch.no_grad()
    def apply(self, sparsity: float, scope: str = "per-layer") -> dict:
        """Restore the original weights, then prune to ``sparsity``; returns what was done."""
        if not 0.0 <= sparsity < 1.0:
            raise ValueError(f"sparsity {sparsity} is outside [0, 1)")
        if scope not in SCOPES:
            raise ValueError(f"pruning scope {scope!r}; allowed: {', '.join(SCOPES)}")
        self.restore()
        if sparsity > 0:
            if scope == "per-layer":
                for _, p in self.params:
                    flat = p.view(-1)
                    flat[_smallest(flat.abs(), round(sparsity * flat.numel()))] = 0
            else:
                flat_abs = torch.cat([p.detach().abs().flatten().float().cpu() for _, p in self.params])
                mask = _smallest(flat_abs, round(sparsity * self.total))
                off = 0
                for _, p in self.params:
                    m = mask[off:off + p.numel()].view_as(p).to(p.device)
                    p.masked_fill_(m, 0)
                    off += p.numel()
        return self.stats(sparsity, scope)

    def stats(self, requested: float, scope: str) -> dict:
        zeros = sum(int((p == 0).sum()) for _, p in self.params)
        per = {n: round(float((p == 0).float().mean()), 6) for n, p in self.params}
        return {"requested": requested, "scope": scope, "achieved": zeros / self.total,
                "pruned_parameters": zeros, "prunable_parameters": self.total,
                "matrices": len(self.params),
                "min_matrix_sparsity": min(per.values()), "max_matrix_sparsity": max(per.values())}
