"""Batched decoding with a KV cache: greedy, or sampled (temperature, top-p) for pass@k with k > 1.

Prompts are sorted by length and decoded in batches with left padding (an attention mask and
position ids that skip the pads); rows that hit an end-of-sequence token, a stop string or a stop
pattern leave the batch at once (their KV-cache rows are dropped) and waiting prompts join the
running batch (continuous batching), so one long answer does not keep the machine at batch size
one. Greedy decoding gives the same tokens as one-at-a-time decoding up to floating-point
reassociation in batched matmuls.

``naive_generate`` is the baseline of the throughput benchmark: one ``model.generate`` call per
prompt, no batching.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import torch


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int = 256
    do_sample: bool = False
    temperature: float = 0.8
    top_p: float = 0.95
    seed: int = 0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if not self.do_sample:
            d = {"max_new_tokens": self.max_new_tokens, "do_sample": False}
        return d


@dataclasses.dataclass
class Generation:
    text: str              # decoded continuation, cut before the stop string / after the stop pattern
    new_tokens: int        # tokens decoded for this prompt (including the one that stopped it)
    finish: str            # "eos" | "stop" | "length"


def eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        v = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    return ids


def max_positions(model) -> int:
    return int(getattr(model.config, "max_position_embeddings", 0) or 4096)


def cache_kwarg(model) -> str:
    """transformers 5.x renamed ``past_key_values`` to ``cache`` (the old name warns)."""
    import inspect
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _cut(text: str, stop: Sequence[str], stop_regex: re.Pattern | None) -> int | None:
    best = None
    for s in stop:
        i = text.find(s)
        if i >= 0 and (best is None or i < best):
            best = i
    if stop_regex is not None:
        m = stop_regex.search(text)
        if m and (best is None or m.end() < best):
            best = m.end()
    return best


def _sample(logits: torch.Tensor, s: SamplingSettings, gen: torch.Generator) -> torch.Tensor:
    if not s.do_sample:
        return logits.argmax(dim=-1)
    logits = logits.float() / max(s.temperature, 1e-5)
    probs = torch.softmax(logits, dim=-1)
    if s.top_p < 1.0:
        sp, si = probs.sort(dim=-1, descending=True)
        keep = sp.cumsum(-1) - sp < s.top_p  # always keeps the most likely token
        sp = sp * keep
        probs = torch.zeros_like(probs).scatter_(-1, si, sp)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


def encode_prompts(tokenizer, prompts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
    return [tokenizer(p, add_special_tokens=add_special_tokens, verbose=False)["input_ids"] for p in prompts]


def _prefill(model, ckw: str, seqs: list[list[int]], pad: int, device):
    """Left-padded forward pass over new prompts: (cache, attention mask, last positions, logits)."""
    from transformers import DynamicCache
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        input_ids[r, width - len(s):] = torch.tensor(s, dtype=torch.long)
        attn[r, width - len(s):] = 1
    input_ids, attn = input_ids.to(device), attn.to(device)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=input_ids, attention_mask=attn, position_ids=pos, **{ckw: cache},
                   use_cache=True, logits_to_keep=1).logits[:, -1, :]
    return cache, attn, pos[:, -1], logits


def _mergeable(cache) -> bool:
    """Rows can join a running batch only with plain growing layers (no sliding windows)."""
    from transformers.cache_utils import DynamicLayer
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer and layer.is_initialized for layer in layers)


def _left_pad(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    if n == 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _merge(cache, attn, new_cache, new_attn):
    """Append the rows of ``new_cache`` to ``cache`` (in place), left-padding the shorter side;
    padded key/value slots are masked out by the returned attention mask."""
    ta, tb = attn.shape[1], new_attn.shape[1]
    t = max(ta, tb)
    for la, lb in zip(cache.layers, new_cache.layers):
        la.keys = torch.cat([_left_pad(la.keys, t - ta, 2), _left_pad(lb.keys, t - tb, 2)], dim=0)
        la.values = torch.cat([_left_pad(la.values, t - ta, 2), _left_pad(lb.values, t - tb, 2)], dim=0)
    return torch.cat([_left_pad(attn, t - ta, 1), _left_pad(new_attn, t - tb, 1)], dim=0)


def _trim(cache, attn):
    """Drop the leading key/value columns that are padding in every row."""
    lead = int((attn.cumsum(1) == 0).sum(1).min())
    if lead == 0:
        return attn
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, lead:], layer.values[:, :, lead:]
    return attn[:, lead:]


@torch.inference_mode()
def generate(model, tokenizer, prompts: Sequence[str] | Sequence[list[int]],
             settings: SamplingSettings = SamplingSettings(), stop: Sequence[str] = (),
             stop_regex: str | re.Pattern | None = None, batch_size: int = 8,
             add_special_tokens: bool = True, desc: str = "generating",
             progress: bool = True) -> list[Generation]:
    """Decode a continuation of every prompt (strings, or token id lists used as given).

    Up to ``batch_size`` rows decode together; rows leave as soon as they finish and, once half
    the batch is free, waiting prompts are prefilled and join the running batch (their cache rows
    left-padded to the same length), so a long answer does not leave the batch running at one row."""
    from tqdm.auto import tqdm

    if prompts and isinstance(prompts[0], str):
        ids = encode_prompts(tokenizer, prompts, add_special_tokens)
    else:
        ids = [list(p) for p in prompts]
    pattern = re.compile(stop_regex, re.DOTALL) if isinstance(stop_regex, str) else stop_regex
    device = next(model.parameters()).device
    eos = eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (min(eos) if eos else 0)
    budget = max_positions(model) - settings.max_new_tokens
    if budget < 1:
        raise ValueError(f"max_new_tokens={settings.max_new_tokens} leaves no room for a prompt in "
                         f"the model's {max_positions(model)} positions")
    ids = [p[-budget:] if len(p) > budget else p for p in ids]  # keep the end of over-long prompts
    gen = torch.Generator(device="cpu").manual_seed(settings.seed)
    ckw = cache_kwarg(model)
    queue = sorted(range(len(ids)), key=lambda i: -len(ids[i]))  # longest first
    out: list[Generation | None] = [None] * len(ids)
    bar = tqdm(total=len(ids), desc=desc, unit="seq", leave=False, disable=not progress)
    rows: list[int] = []                 # prompt index of each batch row
    tokens: list[list[int]] = []         # tokens decoded so far, per batch row
    cache = attn = last_pos = logits = None
    joinable = None
    while queue or rows:
        free = batch_size - len(rows)
        if queue and (not rows or (joinable and free >= max(1, batch_size // 2))):
            take, queue = queue[:free], queue[free:]
            c2, a2, p2, l2 = _prefill(model, ckw, [ids[i] for i in take], pad, device)
            if rows:
                attn = _merge(cache, attn, c2, a2)
                last_pos, logits = torch.cat([last_pos, p2]), torch.cat([logits, l2])
            else:
                cache, attn, last_pos, logits = c2, a2, p2, l2
            if joinable is None:
                joinable = _mergeable(cache)
            rows += take
            tokens += [[] for _ in take]
        nxt = _sample(logits, settings, gen).cpu()
        keep = []
        for b, r in enumerate(rows):
            t = int(nxt[b])
            tokens[b].append(t)
            finish = None
            if t in eos:
                finish, text = "eos", tokenizer.decode(tokens[b][:-1], skip_special_tokens=True)
            else:
                text = tokenizer.decode(tokens[b], skip_special_tokens=True)
                cut = _cut(text, stop, pattern)
                if cut is not None:
                    finish, text = "stop", text[:cut]
                elif len(tokens[b]) >= settings.max_new_tokens:
                    finish = "length"
            if finish is None:
                keep.append(b)
            else:
                out[r] = Generation(text, len(tokens[b]), finish)
                bar.update(1)
        if len(keep) < len(rows):
            rows, tokens = [rows[b] for b in keep], [tokens[b] for b in keep]
            if not rows:
                cache = attn = last_pos = logits = None
                continue
            idx = torch.tensor(keep, dtype=torch.long, device=device)
            cache.batch_select_indices(idx)
            attn, last_pos, nxt = attn[idx], last_pos[idx], nxt[idx.cpu()]
            if joinable:
                attn = _trim(cache, attn)
        attn = torch.cat([attn, attn.new_ones((attn.shape[0], 1))], dim=1)
        last_pos = last_pos + 1
        logits = model(input_ids=nxt.to(device).unsqueeze(1), attention_mask=attn,
                       position_ids=last_pos.unsqueeze(1), **{ckw: cache},
                       use_cache=True, logits_to_keep=1).logits[:, -1, :]
    bar.close()
    return out  # type: ignore[return-value]


@torch.inference_mode()
def naive_generate(model, tokenizer, prompts: Sequence[str], max_new_tokens: int,
                   progress: bool = True) -> list[list[int]]:
    """Baseline: ``model.generate`` on one prompt at a time (greedy, same token budget)."""
    from tqdm.auto import tqdm
    device = next(model.parameters()).device
    outs = []
    for p in tqdm(prompts, desc="naive generate", unit="seq", leave=False, disable=not progress):
        enc = tokenizer(p, return_tensors="pt").to(device)
        o = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                           pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        outs.append(o[0, enc["input_ids"].shape[1]:].tolist())
    return outs
