"""launch/bench_quality.py on the tiny preset (single process, seconds): the `clean` control trains
through a dense boundary on its clean steps and counts their dense bytes; the delayed_ef pair is
clipped like the fast step's."""
import os
import sys
import types

import pytest

from launch_helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "launch"))
import bench_quality as bq  # noqa: E402

CODEC = dict(groups=[[8, 4]], refresh_steps=[0], refresh_every=0)


def _args(**kw):
    a = dict(model="tiny", data="deepspeed-cpp", seq_len=32, batch=4, micro_batch=2, lr=1e-3, pp=2, seed=0, eval_sequences=2,
             eval_every=100, steps=4, save_dir=None)
    a.update(kw)
    return types.SimpleNamespace(**a)


def _hidden():
    from transformers import AutoConfig
    from ds_twocircuit.models.presets import resolve_model
    return AutoConfig.from_pretrained(resolve_model("tiny")).hidden_size


def test_clean_steps_train_through_a_dense_boundary_and_count_dense_bytes(monkeypatch):
    monkeypatch.setitem(bq.VARIANTS, "t_clean1", dict(mode="lowrank", p=0.0, codec=CODEC, clean_every=1))
    monkeypatch.setitem(bq.VARIANTS, "t_clean2", dict(mode="lowrank", p=0.0, codec=CODEC, clean_every=2))
    monkeypatch.setitem(bq.VARIANTS, "t_coded", dict(mode="lowrank", p=0.0, codec=CODEC))
    dense = bq.run_variant("dense", _args())
    every = bq.run_variant("t_clean1", _args())
    # every step clean: exactly dense training, no codec state shipped, dense bytes
    assert every["train_loss"] == dense["train_loss"]
    assert every["heldout_loss"] == dense["heldout_loss"]
    assert every["pp_codec_state_bytes"] == 0 and every["pp_bytes_ratio"] == 1.0
    coded = bq.run_variant("t_coded", _args())
    half = bq.run_variant("t_clean2", _args())
    # steps 1 and 3 clean: step 0 trains as the coded run, step 1 differs from it
    assert half["train_loss"][0] == coded["train_loss"][0] != dense["train_loss"][0]
    assert half["train_loss"][1] != coded["train_loss"][1]
    H, tok_step = _hidden(), 4 * 32
    payload = bq.payload_bytes_per_token(bq.VARIANTS["t_coded"], H)
    assert payload == 8 * 4 // 8 + 2  # 8 coefficients at 4 bits + one bf16 scale
    state = half["pp_codec_state_bytes"]
    assert state > 0
    assert half["pp_bytes"] == 2 * 2 * tok_step * payload + 2 * 2 * tok_step * H * 4 + state
    assert coded["pp_bytes"] == 2 * 4 * tok_step * payload + coded["pp_codec_state_bytes"]


def test_anchor_clip_pairs_a_clipped_dense_gradient(monkeypatch):
    """With anchor_clip the anchor's dense gradient is clipped by the fast step's rule before it is
    paired with the kept (clipped) coded gradient; without it, it arrives unclipped."""
    import torch
    from ds_twocircuit.anchor.corrections import DelayedErrorFeedback
    norms = []
    orig = DelayedErrorFeedback.submit_anchor_gradients

    def spy(self, grads, source_step):
        norms.append(float(torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values()))))
        return orig(self, grads, source_step)

    monkeypatch.setattr(DelayedErrorFeedback, "submit_anchor_gradients", spy)
    base = dict(mode="lowrank", p=0.0, codec=CODEC, correction="delayed_ef", every=1, lam=1.0, beta=0.5)
    monkeypatch.setitem(bq.VARIANTS, "t_def_clip", dict(base, anchor_clip=0.05))
    monkeypatch.setitem(bq.VARIANTS, "t_def_raw", base)
    bq.run_variant("t_def_clip", _args(steps=3))
    clipped, norms[:] = list(norms), []
    bq.run_variant("t_def_raw", _args(steps=3))
    assert len(clipped) == 2 and max(clipped) <= 0.05 * (1 + 1e-4)   # delivered at steps 1 and 2
    assert len(norms) == 2 and min(norms) > 0.05                      # unclipped: far above it


def test_report_compares_each_variant_with_dense_training_on_the_same_seeds(tmp_path):
    import json

    def row(variant, seed, loss, **settings):
        return {"variant": variant, "seed": seed, "steps": 2, "tokens": 256, "heldout_loss": loss,
                "heldout_loss_coded": None if variant == "dense" else loss + 0.1, "heldout_loss_base": 3.0,
                "settings": {"mode": "dense" if variant == "dense" else "lowrank", "p": 0.0, **settings},
                "pp_bytes_ratio": 1.0 if variant == "dense" else 20.0, "pp_bytes": 1, "pp_codec_state_bytes": 0,
                "tokens_per_s": 10.0, "heldout": [{"step": 0, "dense": 3.0, "coded": 4.0}, {"step": 2, "dense": loss, "coded": loss + 0.1}],
                "command": "x"}
    results = tmp_path / "q.jsonl"
    rows = [row("dense", 0, 2.0), row("dense", 1, 3.0), row("a", 0, 2.2), row("a", 1, 3.3),
            row("b", 1, 3.3, clean_every=10), row("b", 1, 3.6, clean_every=10)]  # the newest of a seed counts
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bq.report(types.SimpleNamespace(results=str(results), model="tiny"))
    out = json.loads((tmp_path / "q.json").read_text())
    vs = {s["variant"]: s["vs_dense"] for s in out["summary"]}
    assert vs["a"] == pytest.approx(1.1) and vs["b"] == pytest.approx(1.2)  # b: seed 1 only, 3.6 / 3.0
    assert out["recommended"] == "a"                                        # the only one with 2 seeds
    assert {r["correction"] for r in out["rows"] if r["variant"] == "b"} == {"clean every 10"}
    assert "| `b` | 1 | 3.600 |" in (tmp_path / "q.md").read_text()
    # the table rounds the exact mean once: 2.39648 prints 2.396 (rounded to 4 first it printed 2.397)
    results.write_text(json.dumps(row("dense", 0, 2.3)) + "\n" + json.dumps(row("c", 0, 2.39648)) + "\n")
    bq.report(types.SimpleNamespace(results=str(results), model="tiny"))
    assert "| `c` | 0 | 2.396 |" in (tmp_path / "q.md").read_text()
    assert json.loads((tmp_path / "q.json").read_text())["summary"][1]["heldout_loss_mean"] == 2.3965


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
