"""LoRA (PEFT) under masked pipeline parallelism: only adapters train and cross the DP link, the
masked PP=2 run equals a single-process model with the same masks and adapters, the result is a
PEFT adapter folder that loads (and merges) onto the base model."""
import glob
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from launch_helpers import read_metrics, read_summary, torchrun
from test_pipeline_equivalence import SGD_LR, STEPS, _config, reference

LORA = {"r": 4, "alpha": 8.0}


def _lora_run(tmp_path, argv, nprocs=2):
    """SGD without clipping, as the full-model equivalence test: the update is lr x gradient, so a
    tight tolerance holds on any CPU (AdamW would turn a rounding difference in a near-zero
    gradient -- B starts at zero -- into a difference of ~lr)."""
    path, cfg = _config(tmp_path, "m95", lora=LORA)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": SGD_LR}}
    cfg["gradient_clipping"] = 0.0
    with open(path, "w") as f:
        json.dump(cfg, f)
    out = tmp_path / "run"
    torchrun(nprocs, ["--deepspeed", path, "--model", "tiny", "--steps", str(STEPS), "--seq-len", "32",
                      "--eval-sequences", "8", "--output-dir", str(out), *argv], timeout=600)
    return str(out), cfg



def test_unit_adapters_are_the_only_trainable_and_anchor_targets():
    from ds_twocircuit.adapters.anchor_circuit import decoder_matrices
    from ds_twocircuit.config import LoRAConfig
    from ds_twocircuit.lora import add_lora
    from ds_twocircuit.models.layers import DecoderPipe, ModelSpec
    from ds_twocircuit.models.presets import resolve_model
    spec = ModelSpec(resolve_model("tiny"))
    stage = torch.nn.Sequential(DecoderPipe(spec, 0), DecoderPipe(spec, 1))
    names = add_lora(stage, [(m.layer, f"model.layers.{m.layer_idx}.") for m in stage], LoRAConfig(r=4), 0)
    assert len(names) == 2 * 7
    trainable = {n for n, p in stage.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    # the spectral correction acts on A and B, named as in the Hugging Face model
    assert set(decoder_matrices(stage)) == {f"model.layers.{n.split('.')[0]}." + n.split(".", 2)[2] for n in trainable}
    again = torch.nn.Sequential(DecoderPipe(spec, 1))         # another construction: the same A
    add_lora(again, [(again[0].layer, "model.layers.1.")], LoRAConfig(r=4), 0)
    a1 = dict(stage[1].layer.named_parameters())["self_attn.q_proj.lora_A.default.weight"]
    a2 = dict(again[0].layer.named_parameters())["self_attn.q_proj.lora_A.default.weight"]
    assert torch.equal(a1, a2) and a1.abs().sum() > 0


@pytest.mark.multiproc
def test_masked_pipeline_with_lora_matches_single_process_reference(tmp_path):
    out, cfg = _lora_run(tmp_path, ["--pp", "2", "--save-interval", str(STEPS)])
    ref_losses, ref_state = reference(cfg, pp=2, dp=1, lora=LORA)
    got = [m["loss"] for m in read_metrics(out)]
    assert got == pytest.approx(ref_losses, rel=1e-5)
    adapters = load_file(os.path.join(out, "hf", "adapter_model.safetensors"))
    from transformers import AutoConfig
    from ds_twocircuit.models.presets import resolve_model
    n_layers = AutoConfig.from_pretrained(resolve_model("tiny")).num_hidden_layers
    assert len(adapters) == n_layers * 7 * 2                 # layers x 7 projections x (A, B)
    assert set(adapters) == set(ref_state)                  # both PEFT adapter folders
    worst = max(float((v - ref_state[k]).abs().max()) for k, v in adapters.items())
    assert worst < 2e-6, worst
    assert any(float(v.abs().max()) > 0 for k, v in adapters.items() if "lora_B" in k)  # B trained
    # parameter diff: in the run's DeepSpeed checkpoint every weight but the adapters is the base's
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(resolve_model("tiny"), dtype=torch.float32).state_dict()
    tag = sorted(glob.glob(os.path.join(out, "checkpoint", "global_step*")))[-1]
    checked = 0
    for f in glob.glob(os.path.join(tag, "layer_*-model_states.pt")):
        idx = int(os.path.basename(f)[len("layer_"):].split("-")[0])
        if not 1 <= idx <= n_layers:
            continue                                          # embedding / norm / head: frozen too, below
        for k, v in torch.load(f, map_location="cpu", weights_only=True).items():
            if "lora_" in k or not k.startswith("layer."):
                continue
            name = f"model.layers.{idx - 1}." + k[len("layer."):].replace("base_layer.", "")
            assert torch.equal(v, base[name]), name
            checked += 1
    assert checked == n_layers * 9                          # 7 projections + 2 norms per layer
    s = read_summary(out)
    assert s["parameters"]["trainable"] == sum(v.numel() for v in adapters.values())
    assert s["config"]["twocircuit"]["lora"]["r"] == 4
    # the export: stage 1 sends its adapters to rank 0 (safetensors bytes after an 8-byte length)
    from safetensors.torch import save
    parts = s["mesh"]["parts"]          # pipeline layers; decoder i is pipeline layer i + 1
    stage1 = {k: v for k, v in adapters.items() if parts[1] <= int(k.split(".")[4]) + 1 < parts[2]}
    assert 0 < len(stage1) < len(adapters)
    assert s["wire_bytes"]["export"] == 8 + len(save(stage1))
    # bytes_per_token is training traffic: the one-off export is not in it
    training = sum(v for k, v in s["wire_bytes"].items() if k != "export")
    assert s["bytes_per_token"] == round(training / s["tokens"], 3)


@pytest.mark.multiproc
def test_lora_dp_bytes_are_the_adapters_and_the_folder_loads_onto_the_base(tmp_path):
    out, _ = _lora_run(tmp_path, ["--pp", "1", "--dp", "2", "--lora-r", "4"])
    s = read_summary(out)
    trainable = s["parameters"]["trainable"]
    assert trainable < s["parameters"]["total"] / 10
    # a ring all-reduce of the fp32 adapter gradients per step, 2 ranks: 4 bytes x trainable each
    assert s["wire_bytes"]["dp"] == STEPS * 2 * 4 * trainable
    assert s["wire_bytes"]["export"] == 0                    # one stage: rank 0 holds its adapters
    folder = os.path.join(out, "hf")
    cfg = json.load(open(os.path.join(folder, "adapter_config.json")))
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and os.path.isdir(cfg["base_model_name_or_path"])
    from eval.checkpoint import load_checkpoint
    ck = load_checkpoint(out, dtype="float32")               # the run folder: base + adapter, merged
    assert ck.info["kind"] == "adapter"
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(cfg["base_model_name_or_path"], dtype=torch.float32).state_dict()
    merged = ck.model.state_dict()
    ad = load_file(os.path.join(folder, "adapter_model.safetensors"))
    scale = cfg["lora_alpha"] / cfg["r"]
    for k in [k for k in ad if "lora_A" in k]:
        name = k[len("base_model.model."):].replace(".lora_A.weight", ".weight")
        want = base[name] + scale * ad[k.replace("lora_A", "lora_B")] @ ad[k]
        assert torch.allclose(merged[name], want, atol=1e-6), name
    assert torch.equal(merged["model.norm.weight"], base["model.norm.weight"])
