"""Load what training wrote: a Hugging Face folder, a run folder, or a DeepSpeed pipeline checkpoint.

Accepted ``--checkpoint`` values:

* a ``save_pretrained`` folder (``<run>/hf``; ``<run>/summary.json`` next to it is picked up);
* a run folder holding ``hf/`` (preferred) or ``checkpoint/``;
* a DeepSpeed checkpoint: its root (``latest`` file or ``global_stepN/`` folders; the newest tag
  is taken) or a tag folder with ``layer_XX-model_states.pt`` files. Pipeline layer ``0`` is the
  embedding (``embed_tokens.*``), ``1..N`` the decoder layers (``layer.*`` = HF
  ``model.layers.{i-1}.*``), ``N+1`` the final norm, ``N+2`` the LM head (absent when the
  embeddings stay tied). Config and tokenizer come from the run's base model folder
  (``summary.json``: ``config.model_folder``) or ``--base-model``;
* a model preset of ``ds_twocircuit`` (``smollm2-135m``, ``tiny``): the base model itself.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import re

import torch

from ds_twocircuit.lora import is_adapter_folder


class CheckpointError(ValueError):
    """The checkpoint cannot be used: the message says what was expected."""


@dataclasses.dataclass
class LoadedCheckpoint:
    model: torch.nn.Module
    tokenizer: object
    info: dict                      # what was loaded, for the results JSON
    summary: dict | None            # the run's summary.json, when there is one


def _read_summary(path: str | None) -> dict | None:
    if path and os.path.isfile(path):
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, json.JSONDecodeError):
            return None
    return None


def _is_hf(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "config.json"))




def _layer_files(folder: str) -> list[str]:
    return glob.glob(os.path.join(folder, "layer_*-model_states.pt")) + \
        glob.glob(os.path.join(folder, "layer_*-*model_states.pt"))


def _ds_tag_dir(folder: str) -> str | None:
    """The tag folder of a DeepSpeed checkpoint root or tag folder, else None."""
    if _layer_files(folder):
        return folder
    latest = os.path.join(folder, "latest")
    if os.path.isfile(latest):
        tag = open(latest).read().strip()
        return os.path.join(folder, tag)
    tags = [d for d in glob.glob(os.path.join(folder, "global_step*")) if os.path.isdir(d)]
    if tags:
        return max(tags, key=lambda d: int(re.sub(r"\D", "", os.path.basename(d)) or 0))
    return None


def resolve(spec: str) -> dict:
    """Classify ``spec`` without loading weights: {kind, path, summary_path, ...}."""
    path = os.path.abspath(os.path.expanduser(spec))
    if os.path.isfile(path):
        raise CheckpointError(f"--checkpoint {spec!r} is a file; pass the folder that holds it (a Hugging "
                              "Face folder, a run folder or a DeepSpeed checkpoint folder)")
    if os.path.isdir(path):
        if not os.access(path, os.R_OK | os.X_OK):
            raise CheckpointError(f"--checkpoint {spec!r}: folder is not readable")
        if _is_hf(path):
            parent = os.path.dirname(path)
            return {"kind": "hf", "path": path, "hf_folder": path,
                    "summary_path": os.path.join(parent, "summary.json")}
        if _is_hf(os.path.join(path, "hf")):
            return {"kind": "hf", "path": path, "hf_folder": os.path.join(path, "hf"),
                    "summary_path": os.path.join(path, "summary.json")}
        for folder, summary in ((path, os.path.join(os.path.dirname(path), "summary.json")),
                                (os.path.join(path, "hf"), os.path.join(path, "summary.json"))):
            if is_adapter_folder(folder):  # a PEFT adapter folder (a --lora-r run): base + adapter
                return {"kind": "adapter", "path": path, "hf_folder": folder, "summary_path": summary}
        for root in (path, os.path.join(path, "checkpoint")):
            tag = _ds_tag_dir(root) if os.path.isdir(root) else None
            if tag is not None:
                if not os.path.isdir(tag):
                    raise CheckpointError(f"--checkpoint {spec!r}: 'latest' names {os.path.basename(tag)!r}, "
                                          "which does not exist")
                candidates = [os.path.join(path, "summary.json"),
                              os.path.join(os.path.dirname(os.path.dirname(tag)), "summary.json"),
                              os.path.join(os.path.dirname(tag), "summary.json")]
                summary = next((c for c in candidates if os.path.isfile(c)), None)
                return {"kind": "deepspeed", "path": path, "tag_dir": tag, "summary_path": summary}
        raise CheckpointError(
            f"--checkpoint {spec!r} is not a checkpoint: expected a Hugging Face folder (config.json), "
            "a run folder (hf/ or checkpoint/), or a DeepSpeed checkpoint (a 'latest' file, "
            "global_stepN/ folders or layer_XX-model_states.pt files)")
    from ds_twocircuit.models.presets import ALIASES, PRESETS
    if spec in PRESETS or spec in ALIASES:
        return {"kind": "preset", "path": spec, "summary_path": None}
    raise CheckpointError(f"--checkpoint {spec!r} does not exist (a folder, or a preset: "
                          f"{', '.join(PRESETS)})")


def _dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") and torch.cuda.is_bf16_supported() else torch.float32
    return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
            "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}[name]


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:240]}"


def _base_folder(info: dict, summary: dict | None, base_model: str | None) -> str:
    from ds_twocircuit.config import ConfigError
    from ds_twocircuit.models.presets import resolve_model
    cands = []
    if base_model:
        cands.append(base_model)
    elif summary:
        cfg = summary.get("config", {})
        cands += [c for c in (cfg.get("model_folder"), cfg.get("model")) if c]
    if not cands:
        raise CheckpointError(f"--checkpoint {info['path']!r}: a DeepSpeed checkpoint holds weights only; "
                              "no summary.json names the base model, so pass --base-model (the Hugging "
                              "Face folder or preset the run started from, for config and tokenizer)")
    errors = []
    for c in cands:
        try:
            return resolve_model(c)
        except ConfigError as e:
            errors.append(str(e))
    raise CheckpointError(f"--checkpoint {info['path']!r}: base model not found ({'; '.join(errors)}); "
                          "pass --base-model")


def hf_name(layer_index: int, num_layers: int, key: str) -> str | None:
    """HF state-dict name of a pipeline layer's key (None: not a model weight)."""
    if layer_index == 0 and key.startswith("embed_tokens."):
        return "model." + key
    if 1 <= layer_index <= num_layers and key.startswith("layer."):
        return f"model.layers.{layer_index - 1}." + key[len("layer."):]
    if layer_index == num_layers + 1 and key.startswith("norm."):
        return "model." + key
    if layer_index == num_layers + 2 and key.startswith("lm_head."):
        return key
    return None


def read_pipeline_state(tag_dir: str, num_layers: int) -> dict[str, torch.Tensor]:
    """HF-named weights from a DeepSpeed pipeline checkpoint's per-layer files."""
    state: dict[str, torch.Tensor] = {}
    for idx in range(num_layers + 3):
        files = sorted(glob.glob(os.path.join(tag_dir, f"layer_{idx:02d}-*model_states.pt")))
        if not files:
            if idx == num_layers + 2:
                continue  # tied head: no layer of its own
            raise CheckpointError(f"{tag_dir}: layer_{idx:02d}-model_states.pt is missing (a model with "
                                  f"{num_layers} decoder layers has pipeline layers 0..{num_layers + 2})")
        try:
            sd = torch.load(files[0], map_location="cpu", weights_only=True)
        except Exception as e:  # truncated or foreign file
            raise CheckpointError(f"{files[0]}: cannot be read ({_first_line(e)})") from None
        for k, v in sd.items():
            name = hf_name(idx, num_layers, k)
            if name is None and idx == num_layers + 2 and k.startswith("embed_tokens."):
                continue  # a tied head saved as the embedding module
            if name is None:
                raise CheckpointError(f"{files[0]}: unexpected key {k!r} for pipeline layer {idx} "
                                      f"(model with {num_layers} decoder layers)")
            state[name] = v
    return state


def load_checkpoint(spec: str, device: str = "cpu", dtype: str = "auto",
                    base_model: str | None = None) -> LoadedCheckpoint:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    info = resolve(spec)
    summary = _read_summary(info.get("summary_path"))
    info["summary_path"] = info["summary_path"] if summary is not None else None
    torch_dtype = _dtype(dtype, device)
    try:
        if info["kind"] == "preset":
            from ds_twocircuit.models.presets import resolve_model
            info["hf_folder"] = resolve_model(spec)
        if info["kind"] in ("hf", "preset"):
            folder = info["hf_folder"]
            tok_folder = folder
            from ds_twocircuit.export import MERGE_HINT, missing_shards
            if missing_shards(folder):   # a multi-node run without a shared output folder
                raise CheckpointError(f"{folder}: {', '.join(missing_shards(folder))} named by its index "
                                      f"missing; {MERGE_HINT}")
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype)
        elif info["kind"] == "adapter":
            from peft import PeftModel
            folder = tok_folder = info["hf_folder"]
            from ds_twocircuit.lora import base_of
            from ds_twocircuit.models.presets import resolve_model
            base = resolve_model(base_model) if base_model else base_of(folder)
            if not base or not os.path.isdir(base):
                raise CheckpointError(f"{folder}: the adapter's base model {base!r} is not a folder here; "
                                      "pass --base-model (a folder or a preset)")
            info["base_folder"] = base
            model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch_dtype),
                                              folder).merge_and_unload()   # base + B A (alpha / r)
        else:
            base = _base_folder(info, summary, base_model)
            info["base_folder"] = tok_folder = base
            config = AutoConfig.from_pretrained(base)
            n = int(config.num_hidden_layers)
            state = read_pipeline_state(info["tag_dir"], n)
            if "lm_head.weight" in state:
                config.tie_word_embeddings = False
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
            model.to_empty(device="cpu")
            missing, unexpected = model.load_state_dict(state, strict=False)
            allowed = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
            if unexpected or set(missing) - allowed:
                raise CheckpointError(f"{info['tag_dir']}: weights do not match the base model's config "
                                      f"(missing {sorted(set(missing) - allowed)[:4]}, unexpected "
                                      f"{sorted(unexpected)[:4]})")
            if config.tie_word_embeddings:
                model.tie_weights()
            _rebuild_buffers(model)
            model.to(torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(tok_folder)
    except CheckpointError:
        raise
    except Exception as e:  # corrupt weights, unreadable files, unsupported architecture
        raise CheckpointError(f"--checkpoint {spec!r}: could not be loaded ({_first_line(e)})") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    model.to(device).eval()
    info.update({"dtype": str(torch_dtype).replace("torch.", ""), "device": device,
                 "parameters": sum(p.numel() for p in model.parameters()),
                 "architecture": type(model).__name__})
    return LoadedCheckpoint(model, tokenizer, info, summary)


def _rebuild_buffers(model) -> None:
    """Non-persistent buffers (rotary inverse frequencies) are in no checkpoint, and ``to_empty``
    left them uninitialised: take them from a freshly built copy of each such module."""
    for name, mod in model.named_modules():
        names = [b for b in getattr(mod, "_non_persistent_buffers_set", ()) if mod._buffers.get(b) is not None]
        if not names:
            continue
        cfg = getattr(mod, "config", None)
        if cfg is None:
            raise CheckpointError(f"cannot rebuild the buffers {names} of {name} ({type(mod).__name__})")
        fresh = type(mod)(config=cfg)
        for b in names:
            mod._buffers[b] = fresh._buffers[b].to(mod._buffers[b].device)
