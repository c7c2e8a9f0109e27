"""HF causal LM -> pipeline layers: the chained layers compute the HF model's loss exactly
(Llama, Qwen2, Mistral), and weights map back to the HF names."""
import pytest
import torch

from ds_twocircuit.models.layers import (DecoderPipe, EmbedPipe, HeadPipe, ModelSpec, NormPipe, WeightReader,
                                         causal_lm_loss, hf_state_of, load_layer_weights, tied_head_forward)


def _make(tmp_path, kind, tied):
    import transformers
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=tied)
    cfg = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig}[kind](**common)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    folder = tmp_path / kind
    model.save_pretrained(folder)
    return str(folder), model


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("tied", [True, False])
def test_chained_pipeline_layers_equal_hf_loss(tmp_path, kind, tied):
    folder, hf = _make(tmp_path, kind, tied)
    spec = ModelSpec(folder)
    reader = WeightReader(folder)
    layers = [EmbedPipe(spec)] + [DecoderPipe(spec, i) for i in range(spec.num_layers)] + [NormPipe(spec), HeadPipe(spec)]
    for m in layers:
        load_layer_weights(m, spec, reader)
    x = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    h = x
    for m in layers:
        h = m(h)
    ours = causal_lm_loss(h, x)
    hf.config._attn_implementation = "sdpa"
    ref = hf(input_ids=x, labels=x).loss
    assert torch.allclose(ours, ref, atol=1e-5, rtol=1e-5), (float(ours), float(ref))
    if tied:  # the tied head (sync/freeze modes) is the embedding matrix: same logits as the copy
        hidden = torch.randn(1, 3, 64)
        assert torch.equal(tied_head_forward(layers[0], hidden), layers[-1](hidden))
    # every HF weight is owned by exactly one layer under its HF name
    names = {hf_name for m in layers for hf_name in hf_state_of(m, spec).values()}
    expected = set(hf.state_dict().keys()) | {"lm_head.weight"}
    assert names == expected


def test_missing_weight_is_named(tmp_path):
    folder, _ = _make(tmp_path, "llama", False)
    spec = ModelSpec(folder)
    from safetensors.torch import load_file, save_file
    sd = load_file(f"{folder}/model.safetensors")
    del sd["model.norm.weight"]
    save_file(sd, f"{folder}/model.safetensors", metadata={"format": "pt"})
    from ds_twocircuit.config import ConfigError
    with pytest.raises(ConfigError, match="model.norm.weight"):
        load_layer_weights(NormPipe(spec), spec, WeightReader(folder))
