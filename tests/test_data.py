"""Corpora, held-out split and packing: deterministic, rank-independent, errors name the input."""
import dataclasses
import hashlib
import json

import numpy as np
import pytest
import torch

from ds_twocircuit.config import ConfigError
from ds_twocircuit import data
from ds_twocircuit.data import (PINNED, MicroBatchStream, PackedSequences, heldout_sequences, load_documents,
                                split_documents, stdlib_documents)
from ds_twocircuit.models.presets import byte_level_tokenizer


@pytest.fixture(scope="module")
def tok():
    return byte_level_tokenizer()


def test_stdlib_corpus_excludes_tests_and_site_packages():
    docs = stdlib_documents()
    assert len(docs) > 300
    names = [d.name for d in docs]
    assert not any("site-packages" in n or n.startswith("test/") or "/tests/" in n for n in names)
    train, held = split_documents(docs)
    assert held and set(d.name for d in train).isdisjoint(d.name for d in held)
    # the split depends only on names
    train2, held2 = split_documents(list(reversed(docs)))
    assert sorted(d.name for d in held) == sorted(d.name for d in held2)


def test_folder_and_jsonl_sources(tmp_path, tok):
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("alpha " * 50)
    (folder / "sub" / "b.md").write_text("beta " * 50)
    (folder / "img.png").write_bytes(b"\x89PNG\x00\x01")
    docs = load_documents(str(folder))
    assert sorted(d.name for d in docs) == ["a.txt", "sub/b.md"]
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in [
        {"text": "plain text"}, {"instruction": "Add", "input": "1 2", "output": "3"}, {"other": 1}]) + "\n")
    docs = load_documents(str(jl))
    assert [d.text() for d in docs] == ["plain text", "Add\n\n1 2\n\n3"]


def test_bad_sources_are_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_documents(str(tmp_path / "missing"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{oops\n')
    with pytest.raises(ConfigError, match="line 2 is not valid JSON"):
        load_documents(str(bad))
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(ConfigError, match="JSON Lines"):
        load_documents(str(tmp_path / "x.csv"))


def test_packing_is_deterministic_and_separates_documents(tok, tmp_path):
    folder = tmp_path / "c"
    folder.mkdir()
    for i in range(5):
        (folder / f"{i}.txt").write_text(f"document {i} " * 3)
    docs = load_documents(str(folder))
    a = PackedSequences(docs, tok, 32, seed=3)
    b = PackedSequences(docs, tok, 32, seed=3)
    assert torch.equal(a.batch(0, 6), b.batch(0, 6))
    assert torch.equal(a[5], b.batch(5, 1)[0])              # random access == sequential
    flat = torch.cat([a[i] for i in range(len(a))]).tolist()
    assert flat.count(tok.eos_token_id) >= 4                # end-of-text between documents
    c = PackedSequences(docs, tok, 32, seed=4)
    assert not torch.equal(a.batch(0, 6), c.batch(0, 6))    # the seed orders the windows
    # every pass visits each window once, each pass in its own order
    n = len(a)
    first = sorted(a.window_index(i) for i in range(n))
    assert first == list(range(n)) == sorted(a.window_index(n + i) for i in range(n))
    assert [a.window_index(i) for i in range(n)] != [a.window_index(n + i) for i in range(n)]


def test_microbatch_stream_is_independent_of_the_dp_split(tok):
    train, _ = split_documents(load_documents("deepspeed-cpp"))
    seqs = PackedSequences(train[:30], tok, 16, seed=0)
    # global batch 8 per step: dp=2 x gas=2 x mb=2 vs dp=1 x gas=4 x mb=2
    two = [MicroBatchStream(seqs, 2, 2, 2, r) for r in range(2)]
    one = MicroBatchStream(seqs, 2, 4, 1, 0)
    for _ in range(2):  # steps
        ref = torch.cat([next(one)[0] for _ in range(4)])
        got = torch.cat([next(two[r])[0] for r in range(2) for _ in range(2)])
        assert torch.equal(ref, got)


def test_the_stream_mixes_the_whole_corpus(tok):
    """A few steps' sequences come from across the training set, not from a handful of files:
    windows are shuffled over the tokenised corpus (issue: 30 steps once saw two files)."""
    train, _ = split_documents(load_documents("deepspeed-cpp"))
    seqs = PackedSequences(train, tok, 128, seed=0)
    ids = seqs._ids.array()
    eos = np.flatnonzero(ids == tok.eos_token_id)           # document ends (byte tokenizer: no other eos)
    assert len(eos) == len(train)
    docs_seen = {int(np.searchsorted(eos, seqs.window_index(i) * 128)) for i in range(240)}
    walked = {int(np.searchsorted(eos, i * 128)) for i in range(240)}   # whole documents in a row
    assert len(docs_seen) > 80 and len(docs_seen) > 4 * len(walked)      # 240 sequences: 98 of 216 files
    assert seqs.tokens == len(ids) == sum(len(d.text().encode()) for d in train) + len(train)


def test_pinned_corpora_are_the_recorded_bytes():
    """The default corpus is the pinned release on every machine: the fingerprint recorded in the
    code is recomputed from the installed files (it does not depend on the interpreter, whose
    standard library differs between builds), and is what a run reports."""
    for name, pc in PINNED.items():
        corpus = load_documents(name)
        assert len(corpus) == pc.documents and corpus.fingerprint == pc.fingerprint
        assert all(d.name.startswith(pc.root + "/") for d in corpus)
        assert not any("__pycache__" in d.name for d in corpus)
    code = load_documents(None)
    assert code.spec == data.DEFAULT_DATA == "sympy" and len(code) >= 1000
    train, held = split_documents(code)
    assert len(train) + len(held) == len(code) and {d.name for d in train}.isdisjoint(d.name for d in held)


def test_fingerprint_depends_on_names_and_contents_only():
    a = [data.Document("x.py", text="print(1)"), data.Document("y.py", text="print(2)")]
    fp = data.fingerprint(a)
    assert fp == data.fingerprint(list(reversed(a)))
    assert fp != data.fingerprint([data.Document("x.py", text="print(1) "), a[1]])
    assert fp != data.fingerprint([data.Document("z.py", text="print(1)"), a[1]])
    # a hand computation
    h = hashlib.sha256()
    for d in a:
        h.update(d.name.encode() + b"\0" + hashlib.sha256(d.text().encode()).digest())
    assert fp == h.hexdigest()


def test_a_modified_or_wrong_release_is_refused():
    pc = PINNED["deepspeed-cpp"]
    fake = dataclasses.replace(pc, fingerprint="0" * 64)
    with pytest.raises(ConfigError, match=r"not the pinned deepspeed 0\.19\.8.*pip install --force-reinstall"):
        data.pinned_documents(fake)
    with pytest.raises(ConfigError, match=r"is installed; install the pinned release"):
        data.pinned_documents(dataclasses.replace(pc, version="0.0.1"))
    with pytest.raises(ConfigError, match=r"not installed"):
        data.pinned_documents(dataclasses.replace(pc, distribution="no-such-distribution-xyz"))


def test_tokenised_cache_is_keyed_by_corpus_and_tokenizer(tmp_path, monkeypatch, tok):
    monkeypatch.setenv("DS_TWOCIRCUIT_CACHE", str(tmp_path / "cache"))
    docs = [data.Document(f"{i}.txt", text=f"doc {i} " * 20) for i in range(4)]
    a = data.tokenize_documents(docs, tok)
    assert a.dtype == np.int32 and list(a[:6]) == list("doc 0 ".encode())
    folders = sorted(p.name for p in (tmp_path / "cache" / "tokens").iterdir() if p.is_dir() and not p.name.startswith("."))
    assert len(folders) == 1 and (tmp_path / "cache" / "tokens" / folders[0] / "tokens.arrow").is_file()
    info = json.loads((tmp_path / "cache" / "tokens" / folders[0] / "info.json").read_text())
    assert info["tokens"] == len(a) == 4 * 120 + 4 and info["fingerprint"] == data.fingerprint(docs)
    assert np.array_equal(data.tokenize_documents(list(reversed(docs)), tok), a)   # cached, same order
    docs[0] = data.Document("0.txt", text="changed")
    b = data.tokenize_documents(docs, tok)
    assert len(b) != len(a)
    assert len([p for p in (tmp_path / "cache" / "tokens").iterdir() if p.is_dir() and not p.name.startswith(".")]) == 2


def test_window_order_is_pythons_shuffle_and_is_cached_per_node(tmp_path, monkeypatch):
    """The training stream's order is random.Random(seed).shuffle (the pinned protocol's numbers
    were measured with it); the cached copy is the same permutation, read back memory-mapped, and
    a damaged file is recomputed rather than trusted."""
    import random
    monkeypatch.setenv("DS_TWOCIRCUIT_CACHE", str(tmp_path / "cache"))
    ref = list(range(1000))
    random.Random(77).shuffle(ref)
    first = data.window_order(1000, 77)
    files = list((tmp_path / "cache" / "orders").iterdir())
    assert [f.suffix for f in files] == [".npy"]                     # one file, no temporary left
    again = data.window_order(1000, 77)
    assert isinstance(again, np.memmap)                              # read from the cache
    assert first.tolist() == again.tolist() == ref
    assert data.window_order(1000, 78).tolist() != ref               # keyed by the seed
    assert data.window_order(999, 77).tolist() != ref[:999]          # and by the length
    files[0].write_bytes(b"not an array")
    assert data.window_order(1000, 77).tolist() == ref


def test_token_chunks_slice_across_chunk_boundaries():
    """Windows are sliced out of the Arrow file's chunks without concatenating them: a window that
    straddles two or more chunks is the same tokens as in the concatenated corpus."""
    arrays = [np.arange(0, 5, dtype=np.int32), np.arange(5, 7, dtype=np.int32), np.zeros(0, np.int32),
              np.arange(7, 20, dtype=np.int32)]
    t = data.TokenChunks(arrays=arrays)
    whole = np.arange(20, dtype=np.int32)
    assert len(t) == 20 and np.array_equal(t.array(), whole)
    for k in range(20):
        for n in range(1, 21 - k):
            assert np.array_equal(t.slice(k, n), whole[k:k + n]), (k, n)


def test_heldout_windows_are_fixed_and_spread(tok):
    _, held = split_documents(load_documents("deepspeed-cpp"))
    h1, h2 = heldout_sequences(held, tok, 128), heldout_sequences(held, tok, 128)
    assert torch.equal(h1.batch(0, 16), h2.batch(0, 16))
    first = [h1.window_index(i) for i in range(64)]
    assert max(first) > 0.8 * len(h1) and min(first) < 0.2 * len(h1)   # not the first files only


class _FakeEngine:
    """Stands in for an engine: each call scores one global batch (mb x gas x dp windows of the
    replica's stream) and returns the next scripted loss."""

    def __init__(self, losses, plan):
        self.losses, self.calls, self.plan = iter(losses), [], plan

    def eval_losses(self, seqs, calls, dense, bar=None):
        from ds_twocircuit.data import MicroBatchStream
        it = MicroBatchStream(seqs, self.plan.mb, self.plan.gas, self.plan.dp, 0)
        out = []
        for _ in range(calls):
            self.calls.append((next(it)[0].shape, dense))
            out.append(next(self.losses))
        return out


def test_training_evaluation_reports_the_mean_its_standard_error_and_what_it_scored(tok):
    import statistics
    import types
    from ds_twocircuit.trainer import Trainer
    docs = [data.Document(f"{i}.txt", text=f"held-out {i} " * 40) for i in range(3)]
    seqs = heldout_sequences(docs, tok, 16)
    plan = types.SimpleNamespace(mb=2, gas=1, dp=1, args=types.SimpleNamespace(eval_sequences=9), tc=None)
    eng = _FakeEngine([2.0, 3.0, 4.0, 5.0], plan)
    trainer = Trainer(plan, eng)
    trainer.held_seqs = seqs
    mean, se, scored = trainer.held_out(coded=True)
    assert (mean, scored) == (3.5, 8) and se == pytest.approx(statistics.stdev([2, 3, 4, 5]) / 2)
    assert eng.calls == [((2, 16), False)] * 4                  # dense=False: through the codec
    # never more than the held-out set: a second pass would score windows twice
    plan.args.eval_sequences = 10 ** 6
    trainer.engine = _FakeEngine([1.0] * 1000, plan)
    assert trainer.held_out(coded=False)[2] == (len(seqs) // 2) * 2
