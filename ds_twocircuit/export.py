"""The trained model as a Hugging Face folder, written where its weights are.

Each pipeline stage holds a slice of the model. Gathering the slices on rank 0 to write one
``model.safetensors`` sent every weight across the slow links once more at the end of a run
(measured: 384.6 MB from stage 1 of a 4-step SmolLM2-135M run whose training sent 1.45 MB, none
of it counted; issue 24). Instead every stage (its first data-parallel replica) writes its own
shard of a sharded safetensors checkpoint, named by its stage id, so no weight crosses a link::

    hf/model-00001-of-00002.safetensors    stage 0's weights
    hf/model-00002-of-00002.safetensors    stage 1's weights
    hf/model.safetensors.index.json        weight_map (name -> shard file), metadata.total_size
    hf/config.json, the tokenizer files

which ``transformers``' ``from_pretrained`` reads as one model. Rank 0 writes config, tokenizer
and index; the index needs only each tensor's name and byte size, which rank 0 reads from the
shards' headers when it sees the files (an output folder shared by the nodes), else the stages
send them (a few KB, counted as wire kind ``export``). Without a shared folder each node's
``hf/`` holds its own stages' shards, and::

    python -m ds_twocircuit.export merge <node0>/hf <node1>/hf ... --out <folder>

puts them into one folder, checked against the index (copying the shard files into rank 0's
``hf/`` works too). This module is the file side (no process group); ``adapters/export.py``
runs it across the ranks.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import sys

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json", "tokenizer.model", "vocab.json",
                   "merges.txt")
SHARD_RE = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")
TIED_NAME = "model.embed_tokens.weight"     # held by stage 0 (and, tied, by the last stage's head)
HEAD_NAME = "lm_head.weight"
MERGE_HINT = ("the other nodes' <output_dir>/hf hold them: python -m ds_twocircuit.export merge "
              "<this hf> <each other node's hf> --out <folder>")


class ExportError(ValueError):
    """A folder cannot be written or merged: the message names the file and what was expected."""


def shard_name(stage: int, stages: int) -> str:
    """The shard file of pipeline stage ``stage`` (0-based) of ``stages``: fixed by the stage id,
    so a stage names its file without asking anyone."""
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is not one of the {stages} pipeline stages")
    return f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"


def owned_state(state: dict, stage: int, tied_kept: bool) -> dict:
    """The tensors stage ``stage`` writes: every name lives in exactly one shard. With the
    embeddings kept tied (``tied_embeddings`` ``sync``/``freeze``) the last stage's head is the
    embedding itself, which stage 0 already writes, and there is no ``lm_head.weight`` (the
    config keeps ``tie_word_embeddings``)."""
    if not tied_kept:
        return dict(state)
    return {k: v for k, v in state.items() if k != HEAD_NAME and not (stage > 0 and k == TIED_NAME)}


def tensor_entries(state: dict) -> dict[str, int]:
    """name -> bytes of each tensor (what the index needs)."""
    return {k: v.numel() * v.element_size() for k, v in state.items()}


def write_shard(state: dict, folder: str, stage: int, stages: int) -> dict[str, int]:
    """Write ``state`` as stage ``stage``'s shard into ``folder``; return its index entries."""
    from safetensors.torch import save_file
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, shard_name(stage, stages))
    try:
        save_file({k: v.contiguous() for k, v in state.items()}, path, metadata={"format": "pt"})
    except BaseException:
        if os.path.exists(path):
            os.remove(path)
        raise
    return tensor_entries(state)


def shard_entries(path: str) -> dict[str, int]:
    """name -> bytes of each tensor in a safetensors file, from its header alone (8-byte
    little-endian header length, then the JSON header: no tensor data is read)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        return {k: int(v["data_offsets"][1]) - int(v["data_offsets"][0])
                for k, v in header.items() if k != "__metadata__"}
    except (OSError, struct.error, ValueError, KeyError, TypeError) as e:
        raise ExportError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None


def encode_entries(entries: dict[str, int]) -> bytes:
    """What a stage sends when rank 0 cannot see its shard: names and byte sizes, compact JSON."""
    return json.dumps(entries, sort_keys=True, separators=(",", ":")).encode()


def decode_entries(payload: bytes) -> dict[str, int]:
    return {k: int(v) for k, v in json.loads(payload.decode()).items()}


def encode_state(state: dict) -> bytes:
    """Tensors as safetensors bytes (LoRA adapters on their way to rank 0)."""
    from safetensors.torch import save
    return save({k: v.contiguous() for k, v in state.items()})


def decode_state(payload: bytes) -> dict:
    from safetensors.torch import load
    return load(payload)


def build_index(entries_by_stage: dict[int, dict[str, int]], stages: int) -> dict:
    """``model.safetensors.index.json`` of the shards of ``stages`` stages, from each stage's
    name -> bytes entries: every name maps to exactly one shard; ``total_size`` is the bytes of
    all tensors."""
    if sorted(entries_by_stage) != list(range(stages)):
        raise ExportError(f"index: entries for stages {sorted(entries_by_stage)}, expected 0..{stages - 1}")
    weight_map, total = {}, 0
    for stage in range(stages):
        fn = shard_name(stage, stages)
        for name, nbytes in entries_by_stage[stage].items():
            if name in weight_map:
                raise ExportError(f"index: {name!r} is in two shards, {weight_map[name]} and {fn}")
            weight_map[name] = fn
            total += int(nbytes)
    if not weight_map:
        raise ExportError("index: no tensors in any shard")
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}


def hf_config(model_folder: str, tied_model: bool, tied_mode: str, dtype) -> dict:
    """The base model's ``config.json`` for the trained weights: ``tie_word_embeddings`` false
    when the run untied them (both weights saved), else as the base; ``dtype`` the weights'."""
    with open(os.path.join(model_folder, "config.json")) as f:
        cfg = json.load(f)
    if tied_model and tied_mode not in ("sync", "freeze"):
        cfg["tie_word_embeddings"] = False
    cfg["dtype"] = str(dtype).replace("torch.", "")
    return cfg


def copy_tokenizer(model_folder: str, out: str) -> None:
    for fn in TOKENIZER_FILES:
        src = os.path.join(model_folder, fn)
        if os.path.isfile(src):
            shutil.copy(src, out)


def write_model_files(folder: str, index: dict, config: dict, model_folder: str) -> None:
    """Rank 0's part next to the shards: index, config, tokenizer."""
    with open(os.path.join(folder, INDEX), "w") as f:
        json.dump(index, f, indent=2)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    copy_tokenizer(model_folder, folder)


def publish(partial: str, out: str) -> None:
    """Replace ``out`` by the finished ``partial`` folder (one rename: ``out`` is never half
    written)."""
    if os.path.exists(out):
        shutil.rmtree(out)
    os.replace(partial, out)


def missing_shards(folder: str) -> list[str]:
    """The shard files the folder's index names that are not in the folder (a multi-node run
    without a shared output folder, before the merge)."""
    path = os.path.join(folder, INDEX)
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        files = set(json.load(f)["weight_map"].values())
    return sorted(fn for fn in files if not os.path.isfile(os.path.join(folder, fn)))


def read_state(folder: str) -> dict:
    """Every tensor of a Hugging Face folder: one ``model.safetensors`` or the shards its index
    names."""
    from safetensors.torch import load_file
    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        missing = missing_shards(folder)
        if missing:
            raise ExportError(f"{folder}: {', '.join(missing)} named by {INDEX} missing; {MERGE_HINT}")
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        state = {}
        for fn in files:
            state.update(load_file(os.path.join(folder, fn)))
        return state
    if os.path.isfile(os.path.join(folder, SINGLE)):
        return load_file(os.path.join(folder, SINGLE))
    raise ExportError(f"{folder}: no {INDEX} or {SINGLE}")



def merge(folders: list[str], out: str) -> dict:
    """One folder from the ``hf/`` folders of every node: the files of the folder holding the
    index (config, tokenizer, index, its shards) plus every shard the index names, each checked
    against the index (its tensor names, and the total size). Written as ``<out>.partial``, then
    renamed. Returns the index."""
    if os.path.exists(out):
        raise ExportError(f"--out {out}: exists; merge writes a new folder (remove it or pick another)")
    for f in folders:
        if not os.path.isdir(f):
            raise ExportError(f"{f}: not a folder")
    homes = [f for f in folders if os.path.isfile(os.path.join(f, INDEX))]
    if not homes:
        raise ExportError(f"none of {', '.join(folders)} holds {INDEX} (rank 0's node's <output_dir>/hf has it)")
    indices = []
    for f in homes:
        with open(os.path.join(f, INDEX)) as fh:
            indices.append(json.load(fh))
    for f, idx in zip(homes[1:], indices[1:]):
        if idx != indices[0]:
            raise ExportError(f"{os.path.join(f, INDEX)} differs from {os.path.join(homes[0], INDEX)}: "
                              "folders of different runs")
    home, index = homes[0], indices[0]
    wanted: dict[str, set] = {}
    for name, fn in index["weight_map"].items():
        wanted.setdefault(fn, set()).add(name)
    sources, total = {}, 0
    for fn in sorted(wanted):
        found = [os.path.join(f, fn) for f in folders if os.path.isfile(os.path.join(f, fn))]
        if not found:
            raise ExportError(f"{fn}: in none of {', '.join(folders)} (the index names it; pass the hf/ "
                              "folder of the node that ran its stage)")
        entries = shard_entries(found[0])
        if set(entries) != wanted[fn]:
            extra, lacking = sorted(set(entries) - wanted[fn]), sorted(wanted[fn] - set(entries))
            raise ExportError(f"{found[0]}: does not hold what {INDEX} says (missing {lacking[:3]}, "
                              f"not in the index {extra[:3]}): a shard of another run?")
        for other in found[1:]:
            if shard_entries(other) != entries or os.path.getsize(other) != os.path.getsize(found[0]):
                raise ExportError(f"{found[0]} and {other}: two different copies of one shard")
        sources[fn] = found[0]
        total += sum(entries.values())
    if total != index["metadata"]["total_size"]:
        raise ExportError(f"{os.path.join(home, INDEX)}: metadata.total_size {index['metadata']['total_size']} "
                          f"but its shards hold {total} bytes")
    tmp = out.rstrip("/") + ".partial"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    try:
        for fn in sorted(os.listdir(home)):
            if os.path.isfile(os.path.join(home, fn)) and not SHARD_RE.match(fn):
                shutil.copy2(os.path.join(home, fn), tmp)
        for fn, src in sources.items():
            shutil.copy2(src, tmp)
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return index


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ds_twocircuit.export",
                                description="Put the Hugging Face shards of a multi-node run into one folder.")
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="merge the hf/ folders of every node (one holds the index) into --out")
    m.add_argument("folders", nargs="+", help="each node's <output_dir>/hf")
    m.add_argument("--out", required=True, help="the merged folder (must not exist)")
    args = p.parse_args(argv)
    try:
        index = merge(args.folders, args.out)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    shards = sorted(set(index["weight_map"].values()))
    print(f"{args.out}: {len(index['weight_map'])} tensors in {len(shards)} shards, "
          f"{index['metadata']['total_size']:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
