"""The end-of-run export (issue 24): each pipeline stage writes its own shard of a sharded
safetensors folder, so no weight crosses a link; rank 0 writes config, tokenizer and index. The
index is complete and exact, ``from_pretrained`` reads the folder as one model, multi-node
folders merge, and what crosses (nothing on a shared folder; names and sizes otherwise) is
counted as ``wire_bytes.export``."""
import json
import os
import subprocess
import sys

import pytest
import torch

from ds_twocircuit import export as ex

STAGE0 = ("model.embed_tokens.", "model.layers.0.", "model.layers.1.")


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM
    from ds_twocircuit.models.presets import resolve_model
    folder = resolve_model("tiny")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    state = {}
    for k, v in model.state_dict().items():   # distinct values: a name mixed up in a shard shows
        state[k] = (v + 0.01 * torch.randn(v.shape, generator=g)).contiguous()
    assert model.config.tie_word_embeddings and set(state) >= {ex.TIED_NAME, ex.HEAD_NAME}
    return folder, state


def _stages(state):
    """Two stages as the pipeline splits the tiny model: embedding and layers 0-1, then 2-3,
    the norm and the head."""
    s0 = {k: v for k, v in state.items() if k.startswith(STAGE0)}
    s1 = {k: v for k, v in state.items() if k not in s0}
    return {0: s0, 1: s1}


def _write(folder, states, out, tied_mode):
    """The steps adapters/export.py runs across ranks, in one process."""
    partial = str(out) + ".partial"
    stages = len(states)
    tied_kept = tied_mode in ("sync", "freeze")
    written = {s: ex.write_shard(ex.owned_state(st, s, tied_kept), partial, s, stages) for s, st in states.items()}
    by_stage = {s: ex.shard_entries(os.path.join(partial, ex.shard_name(s, stages))) for s in range(stages)}
    assert by_stage == written                     # the header says what the writer wrote
    index = ex.build_index(by_stage, stages)
    ex.write_model_files(partial, index, ex.hf_config(folder, True, tied_mode, torch.float32), folder)
    ex.publish(partial, str(out))
    assert not os.path.exists(partial)
    return index


def _load(folder):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)


def test_shard_names_are_fixed_by_the_stage():
    assert ex.shard_name(0, 2) == "model-00001-of-00002.safetensors"
    assert ex.shard_name(3, 4) == "model-00004-of-00004.safetensors"
    with pytest.raises(ValueError, match="stage 2 is not one of the 2"):
        ex.shard_name(2, 2)


def test_untied_index_is_complete_and_from_pretrained_reads_the_shards(tiny, tmp_path):
    folder, state = tiny
    out = tmp_path / "hf"
    index = _write(folder, _stages(state), out, "untie")
    wm = index["weight_map"]
    assert set(wm) == set(state)                                   # every tensor, lm_head included
    assert set(wm.values()) == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in state.values())
    held = {fn: set(ex.shard_entries(str(out / fn))) for fn in set(wm.values())}
    assert sum(len(n) for n in held.values()) == len(wm)          # no tensor in two shards
    assert all(name in held[fn] for name, fn in wm.items())
    assert sorted(os.listdir(out)) == sorted(["config.json", ex.INDEX, *held, "tokenizer.json",
                                              "tokenizer_config.json", "generation_config.json"])
    cfg = json.load(open(out / "config.json"))
    assert cfg["tie_word_embeddings"] is False and cfg["dtype"] == "float32"
    loaded = _load(out).state_dict()
    assert set(loaded) == set(state)
    for k, v in state.items():
        assert torch.equal(loaded[k], v), k
    assert not torch.equal(loaded[ex.HEAD_NAME], loaded[ex.TIED_NAME])   # two weights
    assert ex.read_state(str(out)).keys() == state.keys()


@pytest.mark.parametrize("mode", ["sync", "freeze"])
def test_tied_embeddings_are_written_once_by_stage_0(tiny, tmp_path, mode):
    folder, state = tiny
    states = _stages(state)
    states[1][ex.TIED_NAME] = states[0][ex.TIED_NAME]   # the last stage's tied head holds it too
    states[1].pop(ex.HEAD_NAME)
    out = tmp_path / "hf"
    index = _write(folder, states, out, mode)
    assert ex.HEAD_NAME not in index["weight_map"]
    assert index["weight_map"][ex.TIED_NAME] == "model-00001-of-00002.safetensors"
    assert set(index["weight_map"]) == set(state) - {ex.HEAD_NAME}
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for k, v in state.items() if k != ex.HEAD_NAME)
    assert json.load(open(out / "config.json"))["tie_word_embeddings"] is True
    loaded = _load(out).state_dict()
    assert torch.equal(loaded[ex.HEAD_NAME], state[ex.TIED_NAME])      # tied again on load
    for k in index["weight_map"]:
        assert torch.equal(loaded[k], state[k]), k


def test_index_refuses_a_tensor_in_two_shards_and_missing_stages():
    t = {"a": 4, "b": 8}
    with pytest.raises(ex.ExportError, match="'b' is in two shards, model-00001-of-00002.safetensors and "
                                             "model-00002-of-00002.safetensors"):
        ex.build_index({0: t, 1: {"b": 8}}, 2)
    with pytest.raises(ex.ExportError, match=r"entries for stages \[0\], expected 0..1"):
        ex.build_index({0: t}, 2)
    assert ex.build_index({0: t, 1: {}}, 2) == {"metadata": {"total_size": 12},
                                                  "weight_map": {"a": "model-00001-of-00002.safetensors",
                                                                 "b": "model-00001-of-00002.safetensors"}}


def test_metadata_and_adapter_payloads_round_trip():
    entries = {"model.layers.3.mlp.up_proj.weight": 32768, "model.norm.weight": 256}
    payload = ex.encode_entries(entries)
    assert ex.decode_entries(payload) == entries
    assert payload == b'{"model.layers.3.mlp.up_proj.weight":32768,"model.norm.weight":256}'
    state = {"x.lora_A.weight": torch.randn(4, 64), "x.lora_B.weight": torch.zeros(64, 4)}
    back = ex.decode_state(ex.encode_state(state))
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def _split_like_two_nodes(folder, state, tmp_path):
    """What a run without a shared output folder leaves: node 0's hf/ with index, config,
    tokenizer and shard 1; node 1's hf/ with shard 2."""
    full = tmp_path / "full"
    _write(folder, _stages(state), full, "untie")
    node0, node1 = tmp_path / "node0" / "hf", tmp_path / "node1" / "hf"
    node0.mkdir(parents=True)
    node1.mkdir(parents=True)
    for fn in os.listdir(full):
        dst = node1 if fn == "model-00002-of-00002.safetensors" else node0
        os.link(full / fn, dst / fn)
    return node0, node1


def test_merge_puts_the_nodes_shards_into_one_folder(tiny, tmp_path):
    folder, state = tiny
    node0, node1 = _split_like_two_nodes(folder, state, tmp_path)
    assert ex.missing_shards(str(node0)) == ["model-00002-of-00002.safetensors"]
    with pytest.raises(ex.ExportError, match="model-00002-of-00002.safetensors named by .* missing.*merge"):
        ex.read_state(str(node0))
    from eval.checkpoint import CheckpointError, load_checkpoint
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors named by its index missing"):
        load_checkpoint(str(node0))
    merged = tmp_path / "merged"
    p = subprocess.run([sys.executable, "-m", "ds_twocircuit.export", "merge", str(node1), str(node0),
                        "--out", str(merged)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert f"{len(state)} tensors in 2 shards" in p.stdout
    assert ex.missing_shards(str(merged)) == [] and not os.path.exists(str(merged) + ".partial")
    loaded = _load(merged).state_dict()
    for k, v in state.items():
        assert torch.equal(loaded[k], v), k
    evaluated = load_checkpoint(str(merged), dtype="float32").model.state_dict()
    assert all(torch.equal(evaluated[k], v) for k, v in state.items())
    # refused: an existing --out, a missing node, a shard of another run, no index at all
    assert ex.main(["merge", str(node0), str(node1), "--out", str(merged)]) == 2
    with pytest.raises(ex.ExportError, match="model-00002-of-00002.safetensors: in none of"):
        ex.merge([str(node0)], str(tmp_path / "m2"))
    with pytest.raises(ex.ExportError, match="holds model.safetensors.index.json"):
        ex.merge([str(node1)], str(tmp_path / "m3"))
    other = tmp_path / "other"
    other.mkdir()
    ex.write_shard({"model.norm.weight": torch.ones(64)}, str(other), 1, 2)
    with pytest.raises(ex.ExportError, match="does not hold what model.safetensors.index.json says"):
        ex.merge([str(node0), str(other)], str(tmp_path / "m4"))
    assert not any(os.path.exists(tmp_path / m) for m in ("m2", "m3", "m4", "m4.partial"))


def test_launch_helpers_read_a_sharded_folder(tiny, tmp_path):
    from launch_helpers import read_weights
    folder, state = tiny
    _write(folder, _stages(state), tmp_path / "hf", "untie")
    got = read_weights(str(tmp_path / "hf"))
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)


# ------------------------------------------------------------------------------------------------
# real runs

def _ds_state(out, num_layers):
    """HF-named weights from the run's DeepSpeed checkpoint (what the pipeline trained)."""
    import glob
    from eval.checkpoint import read_pipeline_state
    tags = sorted(glob.glob(os.path.join(out, "checkpoint", "global_step*")))
    return read_pipeline_state(tags[-1], num_layers)


TRAIN_ARGS = ["--model", "tiny", "--pp", "2", "--steps", "2", "--seq-len", "32", "--eval-sequences", "0",
              "--save-checkpoint"]


def _config(tmp_path, tied):
    from launch_helpers import CONFIGS
    cfg = json.load(open(os.path.join(CONFIGS, "dense.json")))
    cfg["twocircuit"]["tied_embeddings"] = tied
    path = tmp_path / f"dense_{tied}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.multiproc
@pytest.mark.parametrize("tied", ["untie", "sync"])
def test_pp2_run_writes_one_shard_per_stage_and_sends_no_weight(tmp_path, tied):
    from launch_helpers import read_summary, torchrun
    out = str(tmp_path / "run")
    p = torchrun(2, [*TRAIN_ARGS, "--deepspeed", _config(tmp_path, tied), "--output-dir", out])
    s = read_summary(out)
    hf = os.path.join(out, "hf")
    assert s["hf_folder"] == hf and s["wire_bytes"]["export"] == 0     # shared folder: nothing crosses
    assert "export 0 B" in p.stdout
    index = json.load(open(os.path.join(hf, ex.INDEX)))
    assert set(index["weight_map"].values()) == {ex.shard_name(0, 2), ex.shard_name(1, 2)}
    assert not os.path.exists(hf + ".partial")
    model = _load(hf)
    loaded = model.state_dict()
    trained = _ds_state(out, model.config.num_hidden_layers)
    assert set(trained) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in trained.values())
    for k, v in trained.items():
        assert torch.equal(loaded[k], v), k
    assert model.config.tie_word_embeddings is (tied == "sync")
    if tied == "sync":
        assert ex.HEAD_NAME not in trained and torch.equal(loaded[ex.HEAD_NAME], trained[ex.TIED_NAME])
    else:
        assert not torch.equal(loaded[ex.HEAD_NAME], loaded[ex.TIED_NAME])


@pytest.mark.multiproc
def test_two_nodes_without_a_shared_folder_send_names_and_sizes_then_merge(tmp_path):
    """Two torchrun launches on this host as two nodes (--nnodes 2), each with its own output
    folder: stage 1's shard stays on node 1, rank 0 gets its names and sizes (counted, exactly),
    and the merge gives the model the pipeline trained."""
    from launch_helpers import ROOT, env, read_summary, torchrun_nodes
    cfg = _config(tmp_path, "untie")
    outs = [str(tmp_path / f"node{k}") for k in range(2)]
    logs = torchrun_nodes(1, [[*TRAIN_ARGS, "--deepspeed", cfg, "--output-dir", o] for o in outs])
    hf0, hf1 = (os.path.join(o, "hf") for o in outs)
    assert ex.missing_shards(hf0) == [ex.shard_name(1, 2)]
    assert os.listdir(hf1) == [ex.shard_name(1, 2)] and not os.path.exists(hf1 + ".partial")
    assert "merge" in logs[0][0]                                        # rank 0 says what to do
    sent = ex.encode_entries(ex.shard_entries(os.path.join(hf1, ex.shard_name(1, 2))))
    assert 500 < len(sent) < 10_000
    assert read_summary(outs[0])["wire_bytes"]["export"] == 8 + len(sent)   # length + payload, once
    merged = str(tmp_path / "merged")
    p = subprocess.run([sys.executable, "-m", "ds_twocircuit.export", "merge", hf0, hf1, "--out", merged],
                       cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    model = _load(merged)
    loaded = model.state_dict()
    # what the pipeline trained: each node holds its own stage's layer files of the checkpoint
    import glob
    from eval.checkpoint import read_pipeline_state
    tag = tmp_path / "tag"
    tag.mkdir()
    for o in outs:
        for f in glob.glob(os.path.join(sorted(glob.glob(os.path.join(o, "checkpoint", "global_step*")))[-1],
                                        "layer_*")):
            os.link(f, tag / os.path.basename(f))
    trained = read_pipeline_state(str(tag), model.config.num_hidden_layers)
    assert set(trained) == set(json.load(open(os.path.join(merged, ex.INDEX)))["weight_map"])
    for k, v in trained.items():
        assert torch.equal(loaded[k], v), k
