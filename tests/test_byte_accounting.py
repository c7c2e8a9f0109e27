"""Measured boundary bytes equal K/H x dense bytes (fp32 and bf16 wires); the shape handshake is
counted on its own."""
import json
import os

import pytest

from launch_helpers import CONFIGS, read_summary, torchrun

pytestmark = pytest.mark.multiproc

STEPS, SEQ, H = 2, 16, 64


def _run(tmp_path, name, mode, rate, wire):
    cfg = json.load(open(os.path.join(CONFIGS, "m95.json")))
    cfg["twocircuit"].update(mode=mode, mask_rate=rate, wire_dtype=wire)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    out = str(tmp_path / name)
    torchrun(2, ["--model", "tiny", "--deepspeed", str(path), "--pp", "2", "--steps", str(STEPS),
                 "--seq-len", str(SEQ), "--output-dir", out, "--eval-sequences", "0"])
    return read_summary(out), cfg


def test_m95_bytes_are_k_over_h_of_dense(tmp_path):
    dense, cfg = _run(tmp_path, "dense", "dense", 0.0, "fp32")
    tokens_per_step = cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * SEQ
    values = STEPS * tokens_per_step            # boundary values per direction at K = H
    wb = dense["wire_bytes"]
    assert wb["pp_activations"] == values * H * 4
    assert wb["pp_gradients"] == values * H * 4
    assert wb["pp_handshake"] == 256 * 4          # one dense int32 meta message, counted apart
    K = round(0.05 * H)                           # 3 of 64
    # fp32: tests/test_codec_conformance.py (the pipeline's bytes = the reference's = K x 4 a token)
    for wire, size in (("bf16", 2),):
        m95, _ = _run(tmp_path, f"m95_{wire}", "random", 0.95, wire)
        mb = m95["wire_bytes"]
        assert m95["kept_channels"] == K
        assert mb["pp_activations"] == values * K * size
        assert mb["pp_gradients"] == values * K * size
        assert mb["pp_handshake"] == 256 * 4
        ratio = wb["pp_activations"] / mb["pp_activations"]
        assert ratio == pytest.approx(H / K * 4 / size)
        assert mb["dp"] == 0 and mb["pp_tied"] == 0
        assert mb["export"] == 0                  # each stage wrote its own shard of hf/
    assert wb["export"] == 0 and os.path.isfile(os.path.join(tmp_path, "dense", "hf", "model.safetensors.index.json"))
