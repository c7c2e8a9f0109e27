"""LoRA adapters (PEFT) on the decoder layers, the same under a masked pipeline and in one process.

``inject(layer, cfg, seed, prefix)`` puts PEFT LoRA modules into one decoder layer (a pipeline
stage's ``DecoderPipe.layer`` or a Hugging Face model's ``model.layers[i]``) and freezes the
layer's own weights. ``A`` is drawn from a generator seeded by (seed, the Hugging Face name of the
projection), ``B`` starts at zero (the model is unchanged at step 0), so a stage of a pipeline and
a single-process model get bit-identical adapters whatever the construction order. Only adapter
weights train, so only they cross the DP link, and the anchor's 2-D targets are the ``A`` / ``B``
matrices.

The trained adapters are saved as a normal PEFT adapter folder (``adapter_config.json`` with the
base model's path, ``adapter_model.safetensors``): ``peft.PeftModel.from_pretrained(base, folder)``
loads it, and ``python -m eval --checkpoint <folder>`` evaluates base + adapter.
"""
from __future__ import annotations

import json
import math
import os

import torch

from .rng import derived_generator

PEFT_PREFIX = "base_model.model."   # what PeftModel puts in front of the base model's names


def _peft_config(cfg, base_model: str | None = None):
    from peft import LoraConfig
    return LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                      target_modules=list(cfg.target_modules), bias="none", task_type="CAUSAL_LM",
                      base_model_name_or_path=base_model)


def inject(layer: torch.nn.Module, cfg, seed: int, prefix: str) -> list[str]:
    """Add LoRA to the ``cfg.target_modules`` projections of decoder ``layer`` (Hugging Face
    names under ``prefix``, e.g. ``model.layers.3.``); freeze everything else in it. Returns the
    Hugging Face names of the adapted projections."""
    from peft import inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    for p in layer.parameters():
        p.requires_grad_(False)
    inject_adapter_in_model(_peft_config(cfg), layer)
    names = []
    for name, mod in layer.named_modules():
        if isinstance(mod, LoraLayer):
            hf = prefix + name
            a, b = mod.lora_A["default"].weight, mod.lora_B["default"].weight
            bound = 1.0 / math.sqrt(a.shape[1])   # PEFT's default: kaiming_uniform_(a=sqrt(5))
            with torch.no_grad():
                a.copy_(torch.rand(a.shape, generator=derived_generator(seed, hf, 0), dtype=torch.float32)
                        .mul_(2 * bound).sub_(bound).to(a.dtype))
                b.zero_()
            names.append(hf)
    if not names:
        raise ValueError(f"twocircuit.lora.target_modules {list(cfg.target_modules)} match no projection "
                         f"of the decoder layer ({prefix.rstrip('.')})")
    for n, p in layer.named_parameters():
        p.requires_grad_("lora_" in n)
    return names


def add_lora(root: torch.nn.Module, layers, cfg, seed: int) -> list[str]:
    """Freeze every weight of ``root`` and put adapters into each ``(decoder layer, Hugging Face
    prefix)`` of ``layers``; returns the adapted projections' Hugging Face names."""
    for p in root.parameters():
        p.requires_grad_(False)
    return [n for layer, prefix in layers for n in inject(layer, cfg, seed, prefix)]


def adapter_state(layer: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """The adapter weights of ``layer`` under the names of a saved PEFT adapter
    (``base_model.model.<prefix>self_attn.q_proj.lora_A.weight``)."""
    return {PEFT_PREFIX + prefix + n.replace(".default", ""): p.detach().to("cpu").clone()
            for n, p in layer.named_parameters() if "lora_" in n}


def save_adapter_folder(state: dict[str, torch.Tensor], cfg, base_model: str, out: str) -> None:
    """A PEFT adapter folder: ``adapter_config.json`` (naming ``base_model``) and
    ``adapter_model.safetensors``."""
    from safetensors.torch import save_file
    os.makedirs(out, exist_ok=True)
    _peft_config(cfg, base_model=os.path.abspath(base_model)).save_pretrained(out)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out, "adapter_model.safetensors"),
              metadata={"format": "pt"})


def is_adapter_folder(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "adapter_config.json"))


def base_of(folder: str) -> str:
    with open(os.path.join(folder, "adapter_config.json")) as f:
        return json.load(f).get("base_model_name_or_path") or ""
