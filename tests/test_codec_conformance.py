"""What every registered boundary codec must do, run over the registry (a new codec is one module
and its registration: the example plugin ``examples/codec_plugin.py`` is checked here like the
built-ins):

* its declared payload is the bytes it packs, and the run's meter counts exactly that;
* a run resumed from a checkpoint continues bit for bit (codec state saved);
* the DeepSpeed pipeline engine and the single-process reference engine train the same weights on
  the same config file and count the same bytes (multi-process).

Tiny preset, fp32."""
import json
import os

import pytest
import torch

from launch_helpers import CONFIGS, ROOT, read_metrics, read_summary, read_weights, torchrun

PLUGIN = "examples.codec_plugin"
SEQ, MB, GAS, STEPS = 32, 2, 2, 3
# per codec: the twocircuit keys that make it a representative run on the tiny model (64 channels)
SETTINGS = {
    "dense": {},
    "random": {"mask_rate": 0.9},
    "topk": {"mask_rate": 0.9},
    "meanfill": {"mask_rate": 0.9, "codec": {"refresh_steps": [0, 2]}},
    "lowrank": {"codec": {"groups": [[8, 8], [16, 4]], "refresh_steps": [0, 2], "coef_norm": "sqrt_std"}},
    "int8": {"plugins": [PLUGIN]},
}


# what each declares for the tiny model's 64 channels in fp32 (activation, gradient bytes per token):
# a kept value is 4 bytes; Top-K adds an int16 index per value forward; low-rank 8 x 8 + 16 x 4 bits
# plus a bf16 scale per group; int8 one byte a channel plus a bf16 scale
EXPECTED = {"dense": (256, 256), "random": (24, 24), "topk": (36, 24), "meanfill": (24, 24), "lowrank": (20, 20),
            "int8": (66, 66)}


def _registered():
    import importlib
    import sys
    from ds_twocircuit.codecs import available_codecs
    if ROOT not in sys.path:       # the plugin's module: the checkout on the path, as the example says
        sys.path.insert(0, ROOT)
    importlib.import_module(PLUGIN)
    return list(available_codecs())


CODECS = _registered()


def test_every_registered_codec_is_covered():
    assert set(CODECS) == set(SETTINGS), "a registered codec without conformance settings: add it to SETTINGS"


def _config(tmp_path, mode, optimizer="SGD") -> str:
    cfg = json.load(open(os.path.join(CONFIGS, "dense.json")))
    cfg["twocircuit"] = {**cfg["twocircuit"], "mode": mode, **SETTINGS[mode]}
    cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"] = MB, GAS
    if optimizer == "SGD":   # the update is lr x gradient: a tight tolerance holds on any CPU
        cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.05}}
        cfg["gradient_clipping"] = 0.0
    path = tmp_path / f"{mode}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _reference(tmp_path, config, name, steps=STEPS, extra=()):
    from ds_twocircuit import train
    out = str(tmp_path / name)
    rc = train.run(["--engine", "reference", "--model", "tiny", "--deepspeed", config, "--steps", str(steps),
                    "--seq-len", str(SEQ), "--eval-sequences", "0", "--output-dir", out, *extra])
    assert rc == 0
    return read_summary(out), [m["loss"] for m in read_metrics(out)], out


@pytest.mark.parametrize("mode", CODECS)
def test_declared_payload_is_what_is_packed(mode):
    from ds_twocircuit.codecs import build_codec, codec_config
    from ds_twocircuit.masks import mask_key
    cfg = {k: v for k, v in SETTINGS[mode].items() if k not in ("plugins",)}
    make = lambda: build_codec(mode, "auto", codec_config(mode, cfg.get("codec")), mask_rate=cfg.get("mask_rate", 0.0))  # noqa: E731
    send, recv = make(), make()
    H, T = 64, 24
    x = torch.randn(2, T // 2, H)
    msg = send.message(mask_key(0, 0, 5, 0, H), x.shape, step=5, first_of_step=False, train=True)
    state = send.state_tensor_count(msg)
    wire = send.pack_activation(x, msg)
    act, grad = send.payload_bytes(H, 4, step=5)
    assert (act, grad) == EXPECTED[mode]
    assert sum(t.numel() * t.element_size() for t in wire[state:]) == T * act
    y = recv.unpack_activation([t.clone() for t in wire], msg, x.dtype)
    assert y.shape == x.shape and torch.isfinite(y).all()
    g = recv.pack_gradient(torch.randn_like(x), msg)
    assert sum(t.numel() * t.element_size() for t in g) == T * grad
    back = send.unpack_gradient([t.clone() for t in g], msg, x.dtype)
    assert back.shape == x.shape and torch.isfinite(back).all()


@pytest.mark.parametrize("mode", CODECS)
def test_the_meter_counts_the_declared_payload(tmp_path, mode):
    """A 3-step run on the reference engine: pp_activations and pp_gradients are the declared
    payload of every token that crossed the boundary, state apart."""
    from ds_twocircuit.codecs import build_codec, codec_config
    from ds_twocircuit.config import import_plugins
    import_plugins(SETTINGS[mode].get("plugins", []))
    s, _, _ = _reference(tmp_path, _config(tmp_path, mode), "run")
    codec = build_codec(mode, "auto", codec_config(mode, SETTINGS[mode].get("codec")),
                        mask_rate=SETTINGS[mode].get("mask_rate", 0.0))
    act, grad = codec.payload_bytes(64, 4)
    tokens = STEPS * MB * GAS * SEQ
    assert s["wire_bytes"]["pp_activations"] == tokens * act
    assert s["wire_bytes"]["pp_gradients"] == tokens * grad
    assert (s["wire_bytes"]["pp_codec_state"] > 0) == codec.stateful
    assert s["codec"]["mode"] == mode


@pytest.mark.parametrize("mode", CODECS)
def test_resume_continues_bit_for_bit(tmp_path, mode):
    config = _config(tmp_path, mode, optimizer="AdamW")
    _, full_loss, full = _reference(tmp_path, config, "full", steps=4)
    _reference(tmp_path, config, "part", steps=2, extra=["--save-checkpoint"])
    _, part_loss, part = _reference(tmp_path, config, "part", steps=4, extra=["--resume", "auto"])
    assert part_loss == full_loss
    wa, wb = read_weights(os.path.join(full, "hf")), read_weights(os.path.join(part, "hf"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.multiproc
@pytest.mark.parametrize("mode", CODECS)
def test_pipeline_equals_reference_on_the_same_config(tmp_path, mode):
    config = _config(tmp_path, mode)
    out = str(tmp_path / "pipe")
    torchrun(2, ["--model", "tiny", "--deepspeed", config, "--pp", "2", "--steps", str(STEPS), "--seq-len", str(SEQ),
                 "--eval-sequences", "0", "--output-dir", out])
    ref, ref_loss, ref_out = _reference(tmp_path, config, "ref")
    pipe = read_summary(out)
    got = [m["loss"] for m in read_metrics(out)]
    assert got == pytest.approx(ref_loss, rel=1e-5, abs=1e-5)
    for kind in ("pp_activations", "pp_gradients", "pp_codec_state"):
        assert pipe["wire_bytes"][kind] == ref["wire_bytes"][kind], kind
    w, r = read_weights(os.path.join(out, "hf")), read_weights(os.path.join(ref_out, "hf"))
    assert set(w) == set(r)
    n = sum(t.numel() for t in w.values())
    mean = sum(float((w[k] - r[k]).abs().sum()) for k in w) / n
    # SGD: float order moves weights by ~lr x 1e-7; a quantised codec may move a value on a rounding
    # edge by one level (see test_statecodecs_pipeline): the bulk must agree far more tightly than
    # one SGD step of the whole gradient (~1e-4 here)
    assert mean < 5e-7 and max(float((w[k] - r[k]).abs().max()) for k in w) < 1e-4
