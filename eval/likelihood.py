"""Log-likelihood scoring: continuations (multiple choice) and fixed windows (perplexity).

The vocabulary projection is applied only where a score is needed, a chunk of positions at a
time, so a batch of long contexts never materialises a (batch x length x vocab) logits tensor.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F


def _head(model):
    head = model.get_output_embeddings()
    cap = getattr(model.config, "final_logit_softcapping", None)

    def logits(h):
        out = head(h)
        if out.dtype not in (torch.float32, torch.float64):
            out = out.float()
        if cap:
            out = torch.tanh(out / cap) * cap
        return out
    return logits


def _hidden(model, input_ids, attention_mask):
    base = getattr(model, model.base_model_prefix, None) or model.base_model
    return base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state


@torch.inference_mode()
def loglikelihoods(model, requests: Sequence[tuple[list[int], list[int]]], batch_size: int = 8,
                   max_length: int | None = None, desc: str = "log-likelihood",
                   progress: bool = True) -> list[tuple[float, int, bool]]:
    """For each (context ids, continuation ids): (sum of log p(continuation | context), number
    of continuation tokens, whether greedy decoding would produce the continuation). Contexts
    are cut from the left to fit ``max_length`` (default: the model's positions)."""
    from tqdm.auto import tqdm
    max_length = max_length or int(getattr(model.config, "max_position_embeddings", 2048))
    device = next(model.parameters()).device
    logits_of = _head(model)
    seqs = []
    for ctx, cont in requests:
        if not cont:
            raise ValueError("empty continuation")
        full = (list(ctx) + list(cont))[-(max_length + 1):]
        seqs.append((full[:-1], full[1:], len(cont)))
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i][0]))
    out: list[tuple[float, int, bool] | None] = [None] * len(seqs)
    for start in tqdm(range(0, len(order), batch_size), desc=desc, unit="batch", leave=False,
                      disable=not progress):
        rows = order[start:start + batch_size]
        width = max(len(seqs[i][0]) for i in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            inp = seqs[i][0]
            ids[r, :len(inp)] = torch.tensor(inp)
            mask[r, :len(inp)] = 1
        hidden = _hidden(model, ids.to(device), mask.to(device))
        for r, i in enumerate(rows):
            inp, tgt, n = seqs[i]
            L = len(inp)
            lp = F.log_softmax(logits_of(hidden[r, L - n:L]), dim=-1)
            target = torch.tensor(tgt[L - n:], device=device)
            score = float(lp.gather(-1, target[:, None]).sum())
            greedy = bool((lp.argmax(-1) == target).all())
            out[i] = (score, n, greedy)
    return out  # type: ignore[return-value]


@torch.inference_mode()
def windows_nll(model, windows: torch.Tensor, batch_size: int = 4, chunk: int = 256,
                desc: str = "perplexity", progress: bool = True) -> tuple[float, int]:
    """Summed next-token NLL over (N, T) token windows (each predicts T-1 tokens) and the count."""
    from tqdm.auto import tqdm
    device = next(model.parameters()).device
    logits_of = _head(model)
    total, count = 0.0, 0
    for start in tqdm(range(0, windows.shape[0], batch_size), desc=desc, unit="batch", leave=False,
                      disable=not progress):
        x = windows[start:start + batch_size].to(device)
        hidden = _hidden(model, x, torch.ones_like(x))
        for c in range(0, x.shape[1] - 1, chunk):
            h = hidden[:, c:min(c + chunk, x.shape[1] - 1)]
            y = x[:, c + 1:c + 1 + h.shape[1]]
            logits = logits_of(h)
            total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                           reduction="sum"))
            count += y.numel()
    return total, count
