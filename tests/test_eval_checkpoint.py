"""Loading checkpoints (HF folder, run folder, DeepSpeed pipeline layer files) and masked inference."""
import json
import os
import shutil

import pytest
import torch

from eval.checkpoint import CheckpointError, load_checkpoint, resolve
from eval.masking import MaskedInference, MaskingError, mask_settings

IDS = torch.tensor([[5, 17, 99, 3, 42, 7, 250, 11]])


@pytest.fixture(scope="module")
def tiny_folder():
    from ds_twocircuit.models.presets import resolve_model
    return resolve_model("tiny")


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def _write_pipeline_checkpoint(folder, tag_dir, untied: bool, seed=0):
    """Per-layer files exactly as DeepSpeed's PipelineModule.save_state_dict writes them for the
    project's pipeline layers, from perturbed tiny weights; returns the reference HF model."""
    from transformers import AutoModelForCausalLM
    from ds_twocircuit.models.layers import (DecoderPipe, EmbedPipe, HeadPipe, ModelSpec, NormPipe,
                                             WeightReader, hf_state_of, load_layer_weights)
    spec = ModelSpec(folder)
    reader = WeightReader(folder)
    layers = [EmbedPipe(spec)] + [DecoderPipe(spec, i) for i in range(spec.num_layers)] + [NormPipe(spec)]
    if untied:
        layers.append(HeadPipe(spec))
    os.makedirs(tag_dir, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    hf_state = {}
    for idx, mod in enumerate(layers):
        load_layer_weights(mod, spec, reader)
        with torch.no_grad():
            for p in mod.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        torch.save(mod.state_dict(), os.path.join(tag_dir, f"layer_{idx:02d}-model_states.pt"))
        sd = mod.state_dict()
        for local, hf in hf_state_of(mod, spec).items():
            hf_state[hf] = sd[local].clone()
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if untied:
        from ds_twocircuit.reference import untie_head
        untie_head(ref)
    missing, unexpected = ref.load_state_dict(hf_state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return ref.eval()


def test_hf_folder_and_preset(tiny_folder):
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32).eval()
    for spec in (tiny_folder, "tiny"):
        ck = load_checkpoint(spec, dtype="float32")
        assert torch.equal(_logits(ck.model), _logits(ref))
        assert ck.tokenizer.padding_side == "left" and ck.tokenizer.pad_token_id is not None
    assert resolve("tiny")["kind"] == "preset"


def test_run_folder_with_summary(tiny_folder, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_folder, run / "hf")
    (run / "summary.json").write_text(json.dumps({"config": {"data": "stdlib", "model_folder": tiny_folder}}))
    for spec in (run, run / "hf"):
        ck = load_checkpoint(str(spec), dtype="float32")
        assert ck.info["kind"] == "hf" and ck.summary["config"]["data"] == "stdlib"


@pytest.mark.parametrize("untied", [True, False])
def test_deepspeed_pipeline_checkpoint_equals_the_hf_model(tiny_folder, tmp_path, untied):
    run = tmp_path / "run"
    tag = run / "checkpoint" / "global_step3"
    ref = _write_pipeline_checkpoint(tiny_folder, str(tag), untied)
    (run / "checkpoint" / "latest").write_text("global_step3")
    (run / "summary.json").write_text(json.dumps({"config": {"model_folder": tiny_folder, "model": "tiny"}}))
    for spec in (run, run / "checkpoint", tag):  # run folder, checkpoint root, tag folder
        ck = load_checkpoint(str(spec), dtype="float32")
        assert ck.info["kind"] == "deepspeed" and ck.info["tag_dir"] == str(tag)
        assert torch.equal(_logits(ck.model), _logits(ref))
        assert ck.model.config.tie_word_embeddings == (not untied)
        if not untied:
            assert ck.model.lm_head.weight.data_ptr() == ck.model.model.embed_tokens.weight.data_ptr()


def test_deepspeed_checkpoint_needs_a_base_model(tiny_folder, tmp_path):
    tag = tmp_path / "ckpt" / "global_step1"
    ref = _write_pipeline_checkpoint(tiny_folder, str(tag), untied=True)
    with pytest.raises(CheckpointError, match="--base-model"):
        load_checkpoint(str(tmp_path / "ckpt"))
    ck = load_checkpoint(str(tmp_path / "ckpt"), base_model="tiny", dtype="float32")
    assert torch.equal(_logits(ck.model), _logits(ref))


def test_broken_deepspeed_checkpoints_give_clear_errors(tiny_folder, tmp_path):
    tag = tmp_path / "global_step2"
    _write_pipeline_checkpoint(tiny_folder, str(tag), untied=True)
    os.remove(tag / "layer_02-model_states.pt")
    with pytest.raises(CheckpointError, match="layer_02-model_states.pt is missing"):
        load_checkpoint(str(tag), base_model="tiny")
    (tag / "layer_02-model_states.pt").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match="cannot be read"):
        load_checkpoint(str(tag), base_model="tiny")
    (tmp_path / "latest").write_text("global_step9")
    with pytest.raises(CheckpointError, match="global_step9"):
        resolve(str(tmp_path))


def test_bad_checkpoint_paths(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve(str(tmp_path / "nope"))
    (tmp_path / "file.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="is a file"):
        resolve(str(tmp_path / "file.bin"))
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        resolve(str(tmp_path))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="could not be loaded"):
        load_checkpoint(str(broken))


# ------------------------------------------------------------------ masked inference
def test_mask_settings_from_summary_and_flags():
    summary = {"config": {"twocircuit": {"mode": "random", "mask_rate": 0.95, "partition": "balanced"},
                          "mask_seed": 7, "seed": 0}, "mesh": {"pp": 2, "parts": [0, 3, 7]}, "steps": 40}
    s = mask_settings(summary)
    assert (s["pp"], s["mask_rate"], s["seed"], s["parts"]) == (2, 0.95, 7, [0, 3, 7])
    s = mask_settings(summary, pp=4, mask_rate=0.9, mask_seed=1)
    assert (s["pp"], s["mask_rate"], s["seed"], s["parts"]) == (4, 0.9, 1, None)
    with pytest.raises(MaskingError, match="--pp --mask-rate --mask-seed"):
        mask_settings(None)
    with pytest.raises(MaskingError, match="no boundary"):
        mask_settings(None, pp=1, mask_rate=0.5, mask_seed=0)


def test_masked_inference_applies_the_training_masks(tiny_folder):
    from ds_twocircuit.reference import BoundaryMasker
    ck = load_checkpoint(tiny_folder, dtype="float32")
    dense = _logits(ck.model)
    settings = mask_settings(None, pp=2, mask_rate=0.9, mask_seed=3)
    mi = MaskedInference(ck.model, settings)
    masked = _logits(ck.model)
    assert not torch.allclose(masked, dense)
    mi.reset()
    assert torch.equal(_logits(ck.model), masked)  # reproducible after reset
    assert not torch.equal(_logits(ck.model), masked)  # the next call gets the next micro-batch key
    mi.remove()
    assert torch.equal(_logits(ck.model), dense)
    # the same masks as the training reference's BoundaryMasker for (step, micro-batch 0)
    from ds_twocircuit.codecs import build_codec
    ref = BoundaryMasker(ck.model, 2, lambda: build_codec("random", mask_rate=0.9), seed=3, parts=settings["parts"])
    ref.set_message(settings["step"], 0)
    assert torch.equal(_logits(ck.model), masked)
    ref.remove()


def test_coded_inference_through_the_lowrank_codec(tiny_folder):
    """A lowrank run's summary gives the codec (groups); the state is fitted on the first batch."""
    ck = load_checkpoint(tiny_folder, dtype="float32")
    dense = _logits(ck.model)
    summary = {"config": {"twocircuit": {"mode": "lowrank", "mask_rate": 0.95, "partition": "balanced",
                                         "codec": {"groups": [[8, 8], [16, 4]], "refresh_steps": [0],
                                                   "refresh_every": 0}}, "seed": 0},
               "mesh": {"pp": 2}, "steps": 4}
    s = mask_settings(summary)
    mi = MaskedInference(ck.model, s)
    coded = _logits(ck.model)
    assert torch.isfinite(coded).all() and not torch.allclose(coded, dense)
    pair = mi.masker.pair(0)
    assert pair[1].rank == 24 and pair[1].has_state and pair[0].moments.n == 0  # eval never measures
    mi.remove()
    assert torch.equal(_logits(ck.model), dense)


def test_coded_inference_of_a_drift_codec_is_refused_with_what_to_do(tiny_folder):
    """reference = base needs the base model beside the checkpoint: the eval CLI says so, and leaves
    the model uncoded."""
    ck = load_checkpoint(tiny_folder, dtype="float32")
    dense = _logits(ck.model)
    summary = {"config": {"twocircuit": {"mode": "lowrank", "mask_rate": 0.0, "partition": "balanced",
                                         "codec": {"groups": [[8, 4]], "reference": "base"}}, "seed": 0},
               "mesh": {"pp": 2}, "steps": 4}
    with pytest.raises(MaskingError, match=r"--masked: .*reference = \"base\".*score it dense"):
        MaskedInference(ck.model, mask_settings(summary))
    assert torch.equal(_logits(ck.model), dense)


@pytest.mark.multiproc
def test_real_training_checkpoint_loads_like_its_hf_folder(tmp_path):
    """A 2-stage DeepSpeed run with --save-checkpoint: its pipeline layer files give the same
    model as the Hugging Face folder it also writes, and masked inference reads its summary."""
    from launch_helpers import CONFIGS, torchrun
    cfg = json.load(open(os.path.join(CONFIGS, "m95.json")))
    path = tmp_path / "m95.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / "run"
    torchrun(2, ["--model", "tiny", "--deepspeed", str(path), "--pp", "2", "--steps", "2", "--seq-len", "32",
                 "--output-dir", str(out), "--eval-sequences", "0", "--save-checkpoint"])
    from_hf = load_checkpoint(str(out / "hf"), dtype="float32")
    from_ds = load_checkpoint(str(out / "checkpoint"), dtype="float32")
    assert from_ds.info["kind"] == "deepspeed"
    hf_state, ds_state = from_hf.model.state_dict(), from_ds.model.state_dict()
    assert set(hf_state) == set(ds_state)
    for k in hf_state:
        assert torch.equal(hf_state[k], ds_state[k]), k
    assert torch.equal(_logits(from_hf.model), _logits(from_ds.model))
    s = mask_settings(from_hf.summary)
    assert s["pp"] == 2 and s["mask_rate"] == cfg["twocircuit"]["mask_rate"] and s["parts"]
    mi = MaskedInference(from_hf.model, s)
    assert not torch.allclose(_logits(from_hf.model), _logits(from_ds.model))
    mi.remove()
