"""Held-out perplexity on local corpora (no hub needed).

* ``code-ppl``: the held-out split of the default training corpus (``sympy``, pinned;
  ``ds_twocircuit.data``: the same name-hash split training uses, so no training step ever saw
  these files); ``cpp-ppl``: the same for the ``deepspeed-cpp`` corpus (C++/CUDA);
* ``legal-ppl``: held-out license and copyright texts; ``tech-ppl``: held-out man pages
  (:mod:`eval.corpora`);
* ``heldout-ppl``: the held-out split of the run's own training data (``config.data`` in the
  run's ``summary.json``);
* ``ppl:<folder|file.jsonl>``: every document of any corpus.

Documents are shuffled with a fixed seed, tokenised with an end-of-text token between them and
cut into non-overlapping windows of ``--ppl-seq-len`` tokens until ``--ppl-tokens`` tokens are
covered (fewer when the corpus is smaller). Reported: mean next-token loss (nats), perplexity,
tokens scored, documents read.
"""
from __future__ import annotations

import math
import random

import torch

from .base import EvalContext, Prepared, Task, TaskError

ORDER_SEED = 0


def token_windows(ctx: EvalContext, docs, tokens: int, seq_len: int) -> tuple[torch.Tensor, int]:
    docs = sorted(docs, key=lambda d: d.name)
    random.Random(ORDER_SEED).shuffle(docs)
    eos = ctx.tokenizer.eos_token_id
    n_windows = max(1, math.ceil(tokens / (seq_len - 1)))
    need = n_windows * seq_len
    buf: list[int] = []
    used = 0
    for d in docs:
        if len(buf) >= need:
            break
        text = d.text()
        if not text:
            continue
        ids = ctx.encode(text)
        if not ids:
            continue
        buf.extend(ids)
        if eos is not None:
            buf.append(eos)
        used += 1
    if len(buf) < 2:
        raise TaskError("the held-out corpus has no tokens")
    full = len(buf) // seq_len
    if full == 0:
        return torch.tensor([buf], dtype=torch.long), used
    full = min(full, n_windows)
    return torch.tensor(buf[:full * seq_len], dtype=torch.long).view(full, seq_len), used


class Perplexity(Task):
    metric = "perplexity"
    higher_is_better = False
    family = "perplexity"
    offline = True

    def documents(self, ctx: EvalContext):
        raise NotImplementedError

    def prepare(self, ctx: EvalContext) -> Prepared:
        from ds_twocircuit.config import ConfigError
        try:
            docs = self.documents(ctx)
        except ConfigError as e:
            raise TaskError(f"{self.name}: {e}") from None
        if not docs:
            raise TaskError(f"{self.name}: the corpus has no held-out documents on this machine")
        seq_len = min(ctx.ppl_seq_len, ctx.max_positions())
        windows, used = token_windows(ctx, docs, ctx.ppl_tokens, seq_len)
        return Prepared(windows, {"documents": used, "heldout_documents": len(docs), "seq_len": windows.shape[1]})

    def evaluate(self, ctx: EvalContext, data: Prepared) -> dict:
        nll, n = ctx.windows_nll(data.records, desc=f"{self.name}")
        loss = nll / max(1, n)
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": n, **data.info}


def _heldout(docs):
    from ds_twocircuit.data import split_documents
    return split_documents(docs)[1]


class CodePerplexity(Perplexity):
    name = "code-ppl"
    corpus = "sympy"
    source = "SymPy 1.14.0 source (pinned), held-out split of the default 'sympy' training corpus"
    description = "held-out perplexity, Python code (the default training corpus's held-out split)"

    def documents(self, ctx):
        from ds_twocircuit.data import load_documents
        return _heldout(load_documents(self.corpus))


class CppPerplexity(CodePerplexity):
    name = "cpp-ppl"
    corpus = "deepspeed-cpp"
    source = "DeepSpeed 0.19.8 C++/CUDA sources (pinned), held-out split of the 'deepspeed-cpp' corpus"
    description = "held-out perplexity, C++/CUDA code (the 'deepspeed-cpp' corpus's held-out split)"


class LegalPerplexity(Perplexity):
    name = "legal-ppl"
    source = "/usr/share/common-licenses + /usr/share/doc/*/copyright, held-out split"
    description = "held-out perplexity, legal (license and copyright texts)"

    def documents(self, ctx):
        from ..corpora import legal_documents
        return _heldout(legal_documents())


class TechPerplexity(Perplexity):
    name = "tech-ppl"
    source = "/usr/share/man/man*/*.gz (roff stripped), held-out split"
    description = "held-out perplexity, technical (man pages)"

    def documents(self, ctx):
        from ..corpora import man_documents
        return _heldout(man_documents())


class RunHeldoutPerplexity(Perplexity):
    name = "heldout-ppl"
    source = "held-out split of the run's training data (summary.json config.data)"
    description = "held-out perplexity on the checkpoint's own training corpus"

    def documents(self, ctx):
        from ds_twocircuit.data import load_documents
        if not ctx.training_data:
            raise TaskError("heldout-ppl: the checkpoint has no run summary.json naming its training "
                            "data; use code-ppl or ppl:<corpus>")
        return _heldout(load_documents(ctx.training_data))


class CorpusPerplexity(Perplexity):
    """``ppl:<path>``: all documents of a folder of text files or a JSON Lines file."""

    def __init__(self, path: str):
        self.path = path
        self.name = f"ppl:{path}"
        self.source = f"every document of {path}"
        self.description = "perplexity on a local corpus"

    def documents(self, ctx):
        import os
        from ds_twocircuit.data import load_documents
        if not os.path.exists(self.path):
            raise TaskError(f"{self.name}: {self.path!r} does not exist (a folder of text files or a .jsonl file)")
        return load_documents(self.path)
