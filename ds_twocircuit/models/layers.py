"""A Hugging Face decoder-only causal LM as a flat list of pipeline layers.

``[Embed, Decoder x N, Norm, Head]``: only the hidden state (one float tensor) crosses a stage
boundary; every decoder layer rebuilds its rotary tables from ``arange(T)`` and attends causally
(no attention-mask tensor travels), so the pipeline computes exactly what the HF model computes
on a packed, unpadded batch. Modules are cloned from the HF model's own classes (built on the
meta device), so Llama, Qwen2 and Mistral share this code. Each layer knows its HF key prefix,
which makes loading and saving ``save_pretrained`` folders a key rename.

Pure torch + transformers; the DeepSpeed ``PipelineModule`` wrapper lives in ``adapters/pipe_module.py``.
"""
from __future__ import annotations

import copy
import functools
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ConfigError


class ModelSpec:
    """What every pipeline layer needs to build itself: the folder and its config."""

    def __init__(self, folder: str, attn_implementation: str = "sdpa"):
        from transformers import AutoConfig
        self.folder = folder
        self.config = AutoConfig.from_pretrained(folder)
        self.config._attn_implementation = attn_implementation
        self.num_layers = int(self.config.num_hidden_layers)
        self.hidden = int(self.config.hidden_size)
        self.tied = bool(getattr(self.config, "tie_word_embeddings", False))
        self.max_positions = int(getattr(self.config, "max_position_embeddings", 0) or 0)

    @functools.cached_property
    def meta_model(self):
        from transformers import AutoModelForCausalLM
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(self.config)

    def clone(self, name: str) -> nn.Module:
        """A real (uninitialised) copy of submodule ``name`` of the HF model; weights load later."""
        mod = copy.deepcopy(self.meta_model.get_submodule(name))
        return mod.to_empty(device="cpu")

    def parts(self, num_stages: int, method: str) -> list[int]:
        return model_parts(self.meta_model, num_stages, method)

    def rotary(self) -> nn.Module:
        cls = type(self.meta_model.model.rotary_emb)
        return cls(config=self.config)


class EmbedPipe(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.embed_tokens = spec.clone("model.embed_tokens")

    def forward(self, input_ids):
        return self.embed_tokens(input_ids)

    def hf_keys(self, spec, index):
        return {"embed_tokens.": "model.embed_tokens."}


class DecoderPipe(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.layer = spec.clone(f"model.layers.{layer_idx}")
        self.rotary = spec.rotary()

    def forward(self, hidden):
        T = hidden.shape[1]
        pos = torch.arange(T, device=hidden.device).unsqueeze(0)
        cos_sin = self.rotary(hidden, pos)
        out = self.layer(hidden, attention_mask=None, position_ids=pos, position_embeddings=cos_sin)
        return out[0] if isinstance(out, tuple) else out

    def hf_keys(self, spec, index):
        return {"layer.": f"model.layers.{self.layer_idx}."}


class NormPipe(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.norm = spec.clone("model.norm")

    def forward(self, hidden):
        return self.norm(hidden)

    def hf_keys(self, spec, index):
        return {"norm.": "model.norm."}


class HeadPipe(nn.Module):
    """The LM head as its own weight (untied, or a model without tied embeddings)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.lm_head = spec.clone("lm_head")

    def forward(self, hidden):
        return self.lm_head(hidden)

    def hf_keys(self, spec, index):
        # A tied source model has no lm_head.weight: the untied head starts from the embedding.
        return {"lm_head.": "lm_head."}


def hf_decoder_matrices(model) -> dict:
    """The 2-D decoder weights (attention and MLP projections) of a plain HF causal LM."""
    return {f"model.layers.{i}.{n}": p for i, layer in enumerate(model.model.layers)
            for n, p in layer.named_parameters() if p.dim() == 2 and p.requires_grad}


def tied_head_forward(embed: EmbedPipe, hidden):
    return F.linear(hidden, embed.embed_tokens.weight)


def causal_lm_loss(logits, labels):
    """Hugging Face's causal-LM loss: predict token t+1 from the prefix, mean over tokens."""
    logits = logits[:, :-1, :].float()
    labels = labels[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def pipeline_layer_count(num_decoders: int) -> int:
    return num_decoders + 3


def compute_weights(num_decoders: int, head_cost: float = 0.0, embed_cost: float = 0.0) -> list[float]:
    """Relative cost of each pipeline layer: a decoder layer is 1."""
    return [embed_cost] + [1.0] * num_decoders + [0.0, head_cost]


def partition_parts(num_decoders: int, num_stages: int, method: str = "balanced",
                    head_cost: float = 0.0, embed_cost: float = 0.0) -> list[int]:
    """Stage boundaries over pipeline layer indices ``[embed, dec 0..N-1, norm, head]``.

    ``balanced`` (default): contiguous stages minimising the most expensive stage, with the LM
    head priced at ``head_cost`` decoder layers (for a 49k vocabulary and a 576-wide model it
    costs about 8 decoder layers, so the last stage gets fewer decoders). ``type``: decoders
    spread evenly, embedding on the first stage, norm and head on the last. ``uniform``: all
    N+3 layers spread evenly. Every stage holds at least one decoder layer, so every boundary
    carries a decoder's hidden state. Returns DeepSpeed's ``parts`` list."""
    if num_stages < 1:
        raise ConfigError(f"--pp must be >= 1, got {num_stages}")
    if num_stages > num_decoders:
        raise ConfigError(f"--pp {num_stages}: more pipeline stages than the model's "
                          f"{num_decoders} decoder layers (num_hidden_layers); use --pp <= {num_decoders}")
    total = pipeline_layer_count(num_decoders)
    if method == "type":
        return [0] + [1 + (s * num_decoders) // num_stages for s in range(1, num_stages)] + [total]
    if method == "uniform":
        cuts = [(s * total) // num_stages for s in range(num_stages)] + [total]
        # keep one decoder per stage: cuts strictly inside [2, N]
        for s in range(1, num_stages):
            cuts[s] = min(max(cuts[s], 1 + s), num_decoders - num_stages + 1 + s)
        return cuts
    if method == "balanced":
        w = compute_weights(num_decoders, head_cost, embed_cost)
        prefix = [0.0]
        for x in w:
            prefix.append(prefix[-1] + x)
        cost = lambda a, b: prefix[b] - prefix[a]  # noqa: E731
        INF = float("inf")
        # best[k][c]: minimal max-stage-cost of layers [0, c) split into k stages, last cut at c
        best = [[INF] * (total + 1) for _ in range(num_stages + 1)]
        arg = [[0] * (total + 1) for _ in range(num_stages + 1)]
        for c in range(2, num_decoders + 1):
            best[1][c] = cost(0, c)
        for k in range(2, num_stages):
            for c in range(k + 1, num_decoders + 1):
                for b in range(k, c):
                    v = max(best[k - 1][b], cost(b, c))
                    if v < best[k][c] - 1e-12:
                        best[k][c], arg[k][c] = v, b
        if num_stages == 1:
            return [0, total]
        final, last = INF, 0
        for b in range(num_stages, num_decoders + 1):
            v = max(best[num_stages - 1][b], cost(b, total))
            if v < final - 1e-12:
                final, last = v, b
        cuts = [last]
        for k in range(num_stages - 1, 1, -1):
            cuts.append(arg[k][cuts[-1]])
        return [0] + cuts[::-1] + [total]
    raise ConfigError(f"twocircuit.partition = {method!r}; allowed: balanced, type, uniform")


def model_parts(hf_model, num_stages: int, method: str) -> list[int]:
    """:func:`partition_parts` for a HF causal LM, pricing the head and embedding by parameter
    count (matmul FLOPs scale with it; the embedding only pays its optimizer update)."""
    cfg = hf_model.config
    dec = sum(p.numel() for p in hf_model.model.layers[0].parameters())
    head = cfg.vocab_size * cfg.hidden_size / dec
    costs = (head, 0.1 * head) if method == "balanced" else (0.0, 0.0)
    return partition_parts(int(cfg.num_hidden_layers), num_stages, method, *costs)


def pipeline_layer_of(hf_name: str, num_layers: int) -> int:
    """The pipeline layer (embedding 0, decoder i at i + 1, norm, head) that holds the Hugging Face
    parameter ``hf_name`` (the numbering of :func:`partition_parts`)."""
    if hf_name.startswith("model.embed_tokens."):
        return 0
    if hf_name.startswith("model.layers."):
        return int(hf_name.split(".")[2]) + 1
    if hf_name.startswith("model.norm."):
        return num_layers + 1
    if hf_name.startswith("lm_head."):
        return num_layers + 2
    raise ValueError(f"parameter {hf_name!r} is in no pipeline layer (embed_tokens, layers.i, norm, lm_head)")


def stage_of(hf_name: str, parts: list[int], num_layers: int) -> int:
    """The pipeline stage holding ``hf_name`` under the stage boundaries ``parts``."""
    layer = pipeline_layer_of(hf_name, num_layers)
    return next(s for s in range(len(parts) - 1) if parts[s] <= layer < parts[s + 1])


def boundary_layers(parts: list[int]) -> list[int]:
    """Pipeline-layer index whose output crosses boundary b (the last layer of stage b)."""
    return [parts[b + 1] - 1 for b in range(len(parts) - 2)]


def layer_module_name(spec: ModelSpec, layer_index: int) -> str:
    """The HF submodule whose output is pipeline layer ``layer_index``'s output."""
    n = spec.num_layers
    if layer_index == 0:
        return "model.embed_tokens"
    if 1 <= layer_index <= n:
        return f"model.layers.{layer_index - 1}"
    if layer_index == n + 1:
        return "model.norm"
    raise ValueError(f"layer {layer_index} is the head: it never feeds a boundary")


# ---------------------------------------------------------------------------------------------
# Weights: HF safetensors <-> pipeline layers, one layer at a time (no rank builds the full model)

class WeightReader:
    """Reads individual tensors from a HF folder (single or sharded safetensors, or .bin)."""

    def __init__(self, folder: str):
        self.folder = folder
        idx = os.path.join(folder, "model.safetensors.index.json")
        single = os.path.join(folder, "model.safetensors")
        self._where: dict[str, str] = {}
        self._bin = None
        if os.path.isfile(idx):
            with open(idx) as f:
                for k, fn in json.load(f)["weight_map"].items():
                    self._where[k] = os.path.join(folder, fn)
        elif os.path.isfile(single):
            from safetensors import safe_open
            with safe_open(single, "pt") as f:
                for k in f.keys():
                    self._where[k] = single
        elif os.path.isfile(os.path.join(folder, "pytorch_model.bin")):
            self._bin = torch.load(os.path.join(folder, "pytorch_model.bin"), map_location="cpu",
                                   weights_only=True, mmap=True)
        else:
            raise ConfigError(f"{folder}: no model.safetensors, model.safetensors.index.json or "
                              "pytorch_model.bin")
        self._handles = {}

    def keys(self):
        return self._bin.keys() if self._bin is not None else self._where.keys()

    def __contains__(self, key):
        return key in (self._bin if self._bin is not None else self._where)

    def get(self, key: str) -> torch.Tensor:
        if self._bin is not None:
            return self._bin[key]
        from safetensors import safe_open
        fn = self._where[key]
        if fn not in self._handles:
            self._handles[fn] = safe_open(fn, "pt")
        return self._handles[fn].get_tensor(key)


def hf_state_of(module: nn.Module, spec: ModelSpec) -> dict[str, str]:
    """Map of the module's own state-dict keys to HF keys."""
    prefixes = module.hf_keys(spec, None)
    out = {}
    for k in module.state_dict().keys():
        for local, hf in prefixes.items():
            if k.startswith(local):
                out[k] = hf + k[len(local):]
                break
    return out


def load_layer_weights(module: nn.Module, spec: ModelSpec, reader: WeightReader) -> None:
    state = {}
    for local, hf in hf_state_of(module, spec).items():
        if hf not in reader and hf == "lm_head.weight":
            hf = "model.embed_tokens.weight"  # tied source model, untied head
        if hf not in reader:
            raise ConfigError(f"{spec.folder}: weight {hf!r} missing from the checkpoint")
        state[local] = reader.get(hf)
    dtype = next((p.dtype for p in module.parameters()), torch.float32)
    module.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    for name, buf in module.named_buffers():  # non-persistent buffers (rotary) are rebuilt by ctor
        if buf.is_meta:
            raise ConfigError(f"{type(module).__name__}.{name} has no weights to load")


PIPE_LAYER_TYPES = (EmbedPipe, DecoderPipe, NormPipe, HeadPipe)
