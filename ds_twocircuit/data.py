"""Corpora, tokenisation and packing into fixed-length training sequences.

A corpus is a list of documents split once into ``train`` and ``heldout`` by a hash of each
document's name (so the split never depends on the machine, the order of a directory listing or
the number of ranks). Training documents are shuffled with the run seed, tokenised lazily with an
end-of-text token between documents, and packed into sequences of ``seq_len`` tokens. Sequence
``i`` is a pure function of (corpus, tokenizer, seed, seq_len, i): every rank computes the same
stream, picks its own share, and a resumed run continues at the same place.

Sources (``--data``):
* ``stdlib`` (default): the CPython standard library's ``.py`` files (no site-packages, no tests):
  a code-domain adaptation corpus present on every machine.
* a folder of text files (recursively; binary and non-UTF-8 files are skipped);
* a ``.jsonl`` file: one JSON object per line, text in ``text``/``content``, or Alpaca-style
  ``instruction``/``input``/``output``;
* ``hf:<name>[:<split>]`` or a ``datasets`` name: loaded with ``datasets.load_dataset``.
"""
from __future__ import annotations

import array
import hashlib
import json
import os
import random
import sysconfig

import torch

from .config import ConfigError

TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".c", ".h", ".cpp", ".js", ".ts", ".java", ".go",
                 ".rs", ".sh", ".json", ".yaml", ".yml", ".toml", ".html", ".css", ".tex", ".sql", ""}
HELDOUT_EVERY = 50  # 2% of documents, chosen by name hash


def _heldout(name: str) -> bool:
    return int(hashlib.sha1(name.encode()).hexdigest()[:8], 16) % HELDOUT_EVERY == 0


class Document:
    __slots__ = ("name", "_text", "_path")

    def __init__(self, name: str, text: str | None = None, path: str | None = None):
        self.name, self._text, self._path = name, text, path

    def text(self) -> str:
        if self._text is not None:
            return self._text
        try:
            with open(self._path, encoding="utf-8") as f:
                return f.read()
        except (UnicodeDecodeError, OSError):
            return ""


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def _walk_files(root: str, skip_dirs=(), suffixes=None) -> list[str]:
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in skip_dirs and not x.startswith("."))
        for fn in sorted(files):
            if suffixes is not None and os.path.splitext(fn)[1] not in suffixes:
                continue
            out.append(os.path.join(d, fn))
    return out


def stdlib_documents() -> list[Document]:
    root = stdlib_root()
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = _walk_files(root, skip_dirs=skip, suffixes={".py"})
    return [Document(os.path.relpath(p, root), path=p) for p in files]


def folder_documents(root: str) -> list[Document]:
    files = _walk_files(root, skip_dirs={"__pycache__", ".git"}, suffixes=TEXT_SUFFIXES)
    return [Document(os.path.relpath(p, root), path=p) for p in files if os.path.getsize(p) > 0]


def _record_text(rec: dict) -> str:
    for key in ("text", "content"):
        if isinstance(rec.get(key), str):
            return rec[key]
    if "instruction" in rec or "output" in rec:
        parts = [rec.get("instruction", ""), rec.get("input", ""), rec.get("output", "")]
        return "\n\n".join(p for p in parts if p)
    return ""


def jsonl_documents(path: str) -> list[Document]:
    docs = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--data {path}: line {i + 1} is not valid JSON ({e})") from None
            text = _record_text(rec) if isinstance(rec, dict) else ""
            if text:
                docs.append(Document(f"{os.path.basename(path)}:{i}", text=text))
    return docs


def datasets_documents(name: str) -> list[Document]:
    ds_name, _, split = name.removeprefix("hf:").partition(":")
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"--data {name!r} needs the 'datasets' package: pip install datasets") from None
    try:
        ds = datasets.load_dataset(ds_name, split=split or "train")
    except Exception as e:
        raise ConfigError(f"--data {name!r}: datasets could not load it ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200]})") from None
    return [Document(f"{ds_name}:{i}", text=t) for i, rec in enumerate(ds) if (t := _record_text(rec))]


def load_documents(spec: str | None) -> list[Document]:
    spec = spec or "stdlib"
    if spec == "stdlib":
        docs = stdlib_documents()
    elif os.path.isdir(spec):
        docs = folder_documents(spec)
    elif os.path.isfile(spec):
        if not spec.endswith((".jsonl", ".json")):
            raise ConfigError(f"--data {spec!r}: a file must be JSON Lines (.jsonl); use a folder for text files")
        docs = jsonl_documents(spec)
    elif spec.startswith("hf:") or (spec.count("/") == 1 and not spec.startswith((".", "/", "~"))):
        docs = datasets_documents(spec)
    else:
        raise ConfigError(f"--data {spec!r} does not exist; use 'stdlib', a folder of text files, a "
                          ".jsonl file, or a datasets name (hf:<name>)")
    if not docs:
        raise ConfigError(f"--data {spec!r}: the corpus is empty (no non-empty text documents found)")
    return docs


def split_documents(docs: list[Document]) -> tuple[list[Document], list[Document]]:
    held = [d for d in docs if _heldout(d.name)]
    train = [d for d in docs if not _heldout(d.name)]
    if not held:  # tiny corpora: hold out the last document, if that leaves training data
        held, train = (train[-1:], train[:-1]) if len(train) > 1 else ([], train)
    return train, held


class PackedSequences:
    """Random access to packed token sequences of length ``seq_len`` (tokenised lazily)."""

    def __init__(self, docs: list[Document], tokenizer, seq_len: int, seed: int = 0,
                 shuffle: bool = True, name: str = "corpus"):
        self.docs = list(docs)
        if shuffle:
            random.Random(seed).shuffle(self.docs)
        self.tok = tokenizer
        self.seq_len = int(seq_len)
        self.eos = tokenizer.eos_token_id
        self.name = name
        self._buf = array.array("i")
        self._next_doc = 0
        self._epoch = 0
        self._epoch_tokens = 0
        self._seed = seed
        self._shuffle = shuffle

    def _extend(self, need: int) -> None:
        while len(self._buf) < need:
            if self._next_doc >= len(self.docs):
                if self._epoch_tokens == 0:
                    raise ConfigError(f"{self.name}: the corpus has no tokens")
                self._next_doc, self._epoch, self._epoch_tokens = 0, self._epoch + 1, 0
                if self._shuffle:  # a new order for each pass over the corpus
                    random.Random(self._seed + self._epoch).shuffle(self.docs)
            text = self.docs[self._next_doc].text()
            self._next_doc += 1
            if text:
                ids = self.tok(text, add_special_tokens=False, verbose=False)["input_ids"]
                self._epoch_tokens += len(ids)
                self._buf.extend(ids)
                if ids and self.eos is not None:
                    self._buf.append(self.eos)

    def __getitem__(self, i: int) -> torch.Tensor:
        end = (i + 1) * self.seq_len
        self._extend(end)
        return torch.tensor(self._buf[i * self.seq_len:end].tolist(), dtype=torch.long)

    def batch(self, start: int, count: int) -> torch.Tensor:
        return torch.stack([self[start + j] for j in range(count)])


class MicroBatchStream:
    """Iterator of ``(input_ids, labels)`` micro-batches for one data-parallel replica.

    Global step s consumes sequences ``[s*B, (s+1)*B)`` (B = global batch); replica r takes
    micro-batches ``r*gas .. r*gas+gas-1`` of that step. The global micro-batch index
    ``r*gas + m`` is also the PRF mask's micro-batch field, so masks follow the data and a run
    does not depend on how the global batch is split over replicas."""

    def __init__(self, seqs: PackedSequences, micro_batch: int, gas: int, dp: int, dp_rank: int,
                 start_step: int = 0):
        self.seqs, self.mb, self.gas, self.dp, self.rank = seqs, micro_batch, gas, dp, dp_rank
        self.step = start_step
        self.m = 0

    def __iter__(self):
        return self

    def __next__(self):
        g = self.step * self.dp * self.gas + self.rank * self.gas + self.m
        x = self.seqs.batch(g * self.mb, self.mb)
        self.m += 1
        if self.m == self.gas:
            self.m, self.step = 0, self.step + 1
        return x, x.clone()
