"""Corpora, tokenisation and the training stream of fixed-length sequences.

A corpus is a list of documents split once into ``train`` and ``heldout`` by a hash of each
document's name (so the split never depends on the machine, the order of a directory listing or
the number of ranks). Each split is tokenised once with ``datasets`` (``Dataset.map``, an
end-of-text token after each document) into a memory-mapped Arrow cache keyed by the split's
fingerprint and the tokenizer's, then cut into windows of ``seq_len`` tokens. The training stream
visits the windows in a seeded random order (a new order each pass), so every step's sequences
come from across the whole training set. Sequence ``i`` is a pure function of (corpus, tokenizer,
seed, seq_len, i): every rank computes the same stream, picks its own share, and a resumed run
continues at the same place.

Sources (``--data``):
* ``sympy`` (default): Python, the source files of SymPy 1.14.0 (1,532 files; 9.1M training
  tokens with SmolLM2's tokenizer), pinned: the installed distribution must be exactly that
  release, and the files' fingerprint is checked against the one recorded here, so every
  machine trains and scores on the same text;
* ``deepspeed-cpp``: C++/CUDA, the kernel sources DeepSpeed 0.19.8 ships (252 files), pinned the
  same way; a second domain, one document in 7 held out;
* ``stdlib``: the running interpreter's standard library ``.py`` files (not pinned: differs
  between Python builds);
* a folder of text files (recursively; binary and non-UTF-8 files are skipped);
* a ``.jsonl`` file: one JSON object per line, text in ``text``/``content``, or Alpaca-style
  ``instruction``/``input``/``output``;
* ``hf:<name>[:<split>]`` or a ``datasets`` name: loaded with ``datasets.load_dataset``.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import random
import sysconfig
import tempfile
from dataclasses import dataclass

import numpy as np
import torch

from .config import ConfigError
from .rng import derived_seed

TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".c", ".h", ".cpp", ".js", ".ts", ".java", ".go",
                 ".rs", ".sh", ".json", ".yaml", ".yml", ".toml", ".html", ".css", ".tex", ".sql", ""}
HELDOUT_EVERY = 50  # 2% of documents, chosen by name hash (a pinned corpus may set its own)
HELDOUT_ORDER_SEED = 0  # the held-out windows' order: the same for every run seed and variant
DEFAULT_DATA = "sympy"
TOKENS_FORMAT = 1  # bump when the tokenised cache's layout changes


def _heldout(name: str, every: int = HELDOUT_EVERY) -> bool:
    return int(hashlib.sha1(name.encode()).hexdigest()[:8], 16) % every == 0


@dataclass(frozen=True)
class PinnedCorpus:
    """A corpus read from one exact release of a package on the registry: the same bytes on
    every machine, checked against the fingerprint recorded here."""
    name: str              # the --data value
    distribution: str      # the installed distribution that ships the files
    version: str
    root: str              # the folder inside the distribution, also the documents' name prefix
    suffixes: tuple
    heldout_every: int
    documents: int
    fingerprint: str
    description: str


PINNED = {
    "sympy": PinnedCorpus(
        "sympy", "sympy", "1.14.0", "sympy", (".py",), HELDOUT_EVERY, 1532,
        "e946afefea5eb5b1603a94743554962cbc0135500f1feef1bb7584accfa7dc27",
        "Python: the source of SymPy 1.14.0, tests included"),
    "deepspeed-cpp": PinnedCorpus(
        "deepspeed-cpp", "deepspeed", "0.19.8", "deepspeed", (".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp"),
        7, 252, "c45aa7fced2dadfc44d39a5584557c2fc92f7ddd3a531880eed185b9c29c62fd",
        "C++/CUDA: the kernel sources shipped in DeepSpeed 0.19.8"),
}


class Corpus(list):
    """The documents of one ``--data`` source, sorted by name, with how they are split."""

    def __init__(self, docs, spec: str, heldout_every: int = HELDOUT_EVERY, pinned: PinnedCorpus | None = None):
        super().__init__(sorted(docs, key=lambda d: d.name))
        self.spec, self.heldout_every, self.pinned = spec, heldout_every, pinned

    @property
    def fingerprint(self) -> str:
        return fingerprint(self)


def fingerprint(docs) -> str:
    """SHA-256 over the documents' names and contents (order-independent)."""
    h = hashlib.sha256()
    for d in sorted(docs, key=lambda d: d.name):
        h.update(d.name.encode() + b"\0" + hashlib.sha256(d.text().encode()).digest())
    return h.hexdigest()


class Document:
    __slots__ = ("name", "_text", "_path")

    def __repr__(self) -> str:
        return f"Document({self.name!r})"

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


def pinned_documents(pc: PinnedCorpus) -> Corpus:
    """The files of ``pc`` as installed, verified: the exact release, and the fingerprint."""
    fix = f"pip install --force-reinstall --no-deps {pc.distribution}=={pc.version}"
    try:
        dist = importlib.metadata.distribution(pc.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"--data {pc.name}: needs {pc.distribution}=={pc.version}, which is not "
                          f"installed ({fix})") from None
    if dist.version != pc.version:
        raise ConfigError(f"--data {pc.name}: the corpus is {pc.distribution}=={pc.version}, but "
                          f"{dist.version} is installed; install the pinned release ({fix}) or "
                          "pass another --data")
    root = str(dist.locate_file(pc.root))
    if not os.path.isdir(root):
        raise ConfigError(f"--data {pc.name}: {root} is not a folder ({pc.distribution} installed "
                          f"without its files?); {fix}")
    base = os.path.dirname(root)
    docs = []
    for p in _walk_files(root, skip_dirs={"__pycache__"}, suffixes=set(pc.suffixes)):
        with open(p, "rb") as f:
            raw = f.read()
        docs.append(Document(os.path.relpath(p, base).replace(os.sep, "/"), text=raw.decode("utf-8", "replace")))
    corpus = Corpus(docs, pc.name, pc.heldout_every, pinned=pc)
    fp = corpus.fingerprint
    if fp != pc.fingerprint or len(corpus) != pc.documents:
        raise ConfigError(f"--data {pc.name}: the files under {root} are not the pinned "
                          f"{pc.distribution} {pc.version} ({len(corpus)} documents, fingerprint "
                          f"{fp[:16]}; expected {pc.documents}, {pc.fingerprint[:16]}): modified or "
                          f"partly installed; {fix}")
    return corpus


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


def load_documents(spec: str | None) -> Corpus:
    """The documents of a ``--data`` source (see the module's docstring), as a :class:`Corpus`."""
    spec = spec or DEFAULT_DATA
    if spec in PINNED:
        return pinned_documents(PINNED[spec])
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
        raise ConfigError(f"--data {spec!r} does not exist; use {', '.join(PINNED)}, 'stdlib', a "
                          "folder of text files, a .jsonl file, or a datasets name (hf:<name>)")
    if not docs:
        raise ConfigError(f"--data {spec!r}: the corpus is empty (no non-empty text documents found)")
    return Corpus(docs, spec)


def split_documents(docs: list[Document], every: int | None = None) -> tuple[list[Document], list[Document]]:
    """(train, held-out) by name hash: one document in ``every`` (default: the corpus's own rate,
    else 50) is held out."""
    every = every or getattr(docs, "heldout_every", HELDOUT_EVERY)
    docs = sorted(docs, key=lambda d: d.name)
    held = [d for d in docs if _heldout(d.name, every)]
    train = [d for d in docs if not _heldout(d.name, every)]
    if not held:  # tiny corpora: hold out the last document, if that leaves training data
        held, train = (train[-1:], train[:-1]) if len(train) > 1 else ([], train)
    return train, held


def tokenizer_fingerprint(tok) -> str:
    backend = getattr(tok, "backend_tokenizer", None)
    desc = backend.to_str() if backend is not None else json.dumps(tok.get_vocab(), sort_keys=True)
    return hashlib.sha256(f"{type(tok).__name__}|eos={tok.eos_token_id}|{desc}".encode()).hexdigest()


def _cache_root() -> str:
    from .models.presets import cache_dir
    return os.path.join(cache_dir(), "tokens")


def token_chunks(docs, tokenizer, desc: str = "corpus") -> "TokenChunks":
    """The documents (sorted by name) tokenised and concatenated, an end-of-text token after
    each: int32 tokens backed by a memory-mapped Arrow file that ``datasets`` wrote once per
    (documents' fingerprint, tokenizer), under a lock (all ranks of a node may ask at once; each
    node tokenises into its own cache, nothing assumes a shared filesystem)."""
    import datasets
    from .models.presets import _complete, _locked, _publish

    docs = sorted(docs, key=lambda d: d.name)
    docs_fp, tok_fp = fingerprint(docs), tokenizer_fingerprint(tokenizer)
    key = hashlib.sha256(f"{TOKENS_FORMAT}|{docs_fp}|{tok_fp}".encode()).hexdigest()[:32]
    folder = os.path.join(_cache_root(), key)
    path = os.path.join(folder, "tokens.arrow")
    with _locked(folder):
        if not _complete(folder):
            tmp = tempfile.mkdtemp(dir=os.path.dirname(folder), prefix=f".{key}-")
            eos = tokenizer.eos_token_id
            table = datasets.Dataset.from_dict({"name": [d.name for d in docs], "text": [d.text() for d in docs]})

            def encode(batch):
                ids = tokenizer(batch["text"], add_special_tokens=False, verbose=False)["input_ids"]
                return {"input_ids": [x + [eos] if x and eos is not None else x for x in ids]}

            features = datasets.Features({"name": datasets.Value("string"),
                                          "input_ids": datasets.Sequence(datasets.Value("int32"))})
            out = table.map(encode, batched=True, batch_size=32, remove_columns=["text"], features=features,
                            cache_file_name=os.path.join(tmp, "tokens.arrow"), new_fingerprint=key,
                            desc=f"tokenising {desc} ({len(docs)} documents, once)")
            tokens = sum(len(c.flatten()) for c in out.data.column("input_ids").chunks)
            with open(os.path.join(tmp, "info.json"), "w") as f:
                json.dump({"documents": len(docs), "tokens": tokens, "fingerprint": docs_fp, "tokenizer": tok_fp}, f)
            del out, table
            _publish(tmp, folder)
    return TokenChunks(datasets.Dataset.from_file(path).data.column("input_ids"))


def tokenize_documents(docs, tokenizer, desc: str = "corpus") -> np.ndarray:
    """The documents (sorted by name) tokenised and concatenated, an end-of-text token after
    each, as one int32 array (see :func:`token_chunks`, which does not copy)."""
    return token_chunks(docs, tokenizer, desc).array()


class TokenChunks:
    """The tokenised corpus as zero-copy views of the memory-mapped Arrow file's chunks. A window
    is sliced out of its chunk; only one that straddles two chunks is copied. (Concatenating the
    chunks would touch every page of a 100 MB corpus at start-up: about a second of every rank's
    start on 2 cores.)"""

    def __init__(self, column=None, arrays=None):
        if column is not None:
            arrays = [c.flatten().to_numpy(zero_copy_only=True) for c in column.chunks]
        self.chunks = [a for a in arrays if len(a)]
        self.starts = np.cumsum([0] + [len(a) for a in self.chunks])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def slice(self, k: int, n: int) -> np.ndarray:
        """Tokens ``[k, k + n)``."""
        c = int(np.searchsorted(self.starts, k, side="right")) - 1
        off = k - int(self.starts[c])
        if off + n <= len(self.chunks[c]):
            return self.chunks[c][off:off + n]
        parts, need = [], n
        while need > 0:
            part = self.chunks[c][off:off + need]
            parts.append(part)
            need, c, off = need - len(part), c + 1, 0
        return np.concatenate(parts)

    def array(self) -> np.ndarray:
        if len(self.chunks) == 1:
            return self.chunks[0]
        return np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.int32)


class PackedSequences:
    """Random access to windows of ``seq_len`` tokens of the tokenised documents.

    The documents' tokens are cut into ``len(self)`` non-overlapping windows (the last partial
    one dropped); sequence ``i`` is window ``order(i // len(self))[i % len(self)]``, where each
    pass over the windows has its own order drawn from ``seed`` (``shuffle=False``: the windows
    in corpus order). A corpus shorter than one window is repeated to fill it."""

    def __init__(self, docs: list[Document], tokenizer, seq_len: int, seed: int = 0,
                 shuffle: bool = True, name: str = "corpus"):
        self.seq_len, self.name, self._seed, self._shuffle = int(seq_len), name, int(seed), shuffle
        tokens = token_chunks(docs, tokenizer, desc=name) if docs else TokenChunks(arrays=[])
        if len(tokens) == 0:
            raise ConfigError(f"{name}: the corpus has no tokens")
        self.tokens = len(tokens)
        if len(tokens) < self.seq_len:
            tokens = TokenChunks(arrays=[np.tile(tokens.array(), -(-self.seq_len // len(tokens)))])
        self._ids = tokens
        self.windows = len(tokens) // self.seq_len
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.windows

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:   # one pass at a time is ever needed
            self._orders = {epoch: window_order(self.windows, derived_seed(self._seed, "data.windows", epoch))}
        return self._orders[epoch]

    def window_index(self, i: int) -> int:
        epoch, j = divmod(int(i), self.windows)
        return int(self._order(epoch)[j]) if self._shuffle else j

    def __getitem__(self, i: int) -> torch.Tensor:
        k = self.window_index(i) * self.seq_len
        return torch.from_numpy(self._ids.slice(k, self.seq_len).astype(np.int64))

    def batch(self, start: int, count: int) -> torch.Tensor:
        return torch.stack([self[start + j] for j in range(count)])


ORDER_FORMAT = "random.shuffle/1"   # bump if the order's algorithm or its file changes


def shuffled_order(n: int, seed: int) -> list[int]:
    """``range(n)`` shuffled by Python's ``random.Random(seed).shuffle`` (the training stream's
    order: the pinned protocol's numbers were measured with it)."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order


def window_order(n: int, seed: int) -> np.ndarray:
    """:func:`shuffled_order` as int32, memory-mapped from a per-node cache: the shuffle is a
    Python loop (1.5 s for the 1.6M windows of 16 tokens, on every rank of every start and
    resume); the cached file is the same permutation, written once per (n, seed) and replaced
    atomically, so ranks that compute it at the same time are harmless."""
    from .models.presets import cache_dir
    key = hashlib.sha256(f"{ORDER_FORMAT}|{n}|{seed}".encode()).hexdigest()[:32]
    path = os.path.join(cache_dir(), "orders", f"{key}.npy")
    dtype = np.int32 if n < 2**31 else np.int64
    try:
        order = np.load(path, mmap_mode="r")
        if order.shape == (n,) and order.dtype == dtype:
            return order
    except (OSError, ValueError):
        pass
    order = np.asarray(shuffled_order(n, seed), dtype=dtype)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".npy.tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, order)
        os.replace(tmp, path)
    except OSError:   # a read-only or full cache: the order is still right, only not kept
        if os.path.exists(tmp):
            os.unlink(tmp)
    return order


def heldout_sequences(docs: list[Document], tokenizer, seq_len: int, name: str = "held-out") -> PackedSequences:
    """The held-out windows in one fixed order (spread over all held-out documents, the same for
    every run seed and variant): the first N of them are what an evaluation of N scores."""
    return PackedSequences(docs, tokenizer, seq_len, seed=HELDOUT_ORDER_SEED, shuffle=True, name=name)


@dataclass(frozen=True)
class StreamOrigin:
    """Where the training stream of the current data-parallel width starts: at global ``step``,
    ``micro_batches`` global micro-batches had been consumed (under earlier widths). A run that never
    changed its width has (0, 0). Resuming on another width starts a new origin at the resume step,
    so the stream continues without repeating or skipping a sequence."""
    step: int = 0
    micro_batches: int = 0

    def consumed(self, step: int, dp: int, gas: int) -> int:
        """Global micro-batches consumed before ``step`` at width ``dp``."""
        return self.micro_batches + (step - self.step) * dp * gas

    def to_dict(self) -> dict:
        return {"step": self.step, "micro_batches": self.micro_batches}

    @classmethod
    def from_dict(cls, d: dict | None) -> "StreamOrigin":
        return cls(**d) if d else cls()


class MicroBatchStream:
    """Iterator of ``(input_ids, labels)`` micro-batches for one data-parallel replica.

    Global step s consumes sequences ``[s*B, (s+1)*B)`` (B = global batch); replica r takes
    micro-batches ``r*gas .. r*gas+gas-1`` of that step. The global micro-batch index
    ``r*gas + m`` is also the PRF mask's micro-batch field, so masks follow the data and a run
    does not depend on how the global batch is split over replicas. ``origin``: where this width's
    stream starts (:class:`StreamOrigin`; after a resume on another DP width)."""

    def __init__(self, seqs: PackedSequences, micro_batch: int, gas: int, dp: int, dp_rank: int,
                 start_step: int = 0, origin: StreamOrigin | None = None):
        self.seqs, self.mb, self.gas, self.dp, self.rank = seqs, micro_batch, gas, dp, dp_rank
        self.origin = origin or StreamOrigin()
        if start_step < self.origin.step:
            raise ValueError(f"start step {start_step} is before the stream's origin {self.origin}")
        self.step = start_step
        self.m = 0

    def __iter__(self):
        return self

    def __next__(self):
        g = self.origin.consumed(self.step, self.dp, self.gas) + self.rank * self.gas + self.m
        x = self.seqs.batch(g * self.mb, self.mb)
        self.m += 1
        if self.m == self.gas:
            self.m, self.step = 0, self.step + 1
        return x, x.clone()
