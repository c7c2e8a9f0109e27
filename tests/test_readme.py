"""The README's two set-up commands: .ci/run runs the test command verbatim, and the main-job
command really adapts the embedded default model (slow; part of CI)."""
import json
import os
import re
import shlex

import pytest

from launch_helpers import ROOT, deepspeed_launch, read_metrics, read_summary

README = os.path.join(ROOT, "README.md")


def _commands():
    text = open(README).read()
    blocks = re.findall(r"```\n(.*?)\n```", text, flags=re.S)
    return blocks[0].strip(), blocks[1].strip()


def test_readme_has_the_two_commands_and_ci_runs_the_test_one():
    run_cmd, test_cmd = _commands()
    assert run_cmd.endswith("deepspeed --num_gpus 2 launch/train.py --deepspeed ds_configs/lowrank.json")
    assert "pytest" in test_cmd and "pip install" in test_cmd
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert test_cmd in ci.splitlines()


@pytest.mark.slow
@pytest.mark.multiproc
def test_readme_main_job_adapts_the_default_model(tmp_path):
    run_cmd, _ = _commands()
    launch = shlex.split(run_cmd.split("&&")[-1])
    assert launch[:4] == ["deepspeed", "--num_gpus", "2", "launch/train.py"]
    out = str(tmp_path / "lowrank")
    # deepspeed_launch supplies the launcher and the script; pass the README's own arguments
    deepspeed_launch(2, launch[4:] + ["--output-dir", out], timeout=2700)
    s = read_summary(out)
    assert s["config"]["model"] == "smollm2-135m" and s["mesh"] == {**s["mesh"], "pp": 2, "dp": 1}
    assert s["steps"] == 30 and s["tokens"] == 30 * 8 * 128
    assert len(read_metrics(out)) == 30
    # the pinned default corpus, the same bytes on every machine, and a held-out set of 64k tokens
    from ds_twocircuit.data import PINNED
    d = s["data"]
    assert d["spec"] == "sympy" and d["fingerprint"] == PINNED["sympy"].fingerprint
    assert d["documents"] == 1532 and d["train_tokens"] > 5_000_000 and d["heldout_scored_tokens"] == 512 * 128
    # 30 steps through the codec improve the model as users score it, by more than the held-out
    # noise (dense inference: measured 2.629 -> 2.346, standard error 0.026), and the model as the
    # mesh serves it gets much better (through the codec: 3.01 -> 2.41)
    se = max(s["heldout_loss_first_se"], s["heldout_loss_se"])
    assert 0.005 < se < 0.1
    assert s["heldout_loss"] < s["heldout_loss_first"] - 2 * se
    assert s["heldout_loss_masked"] < s["heldout_loss_masked_first"] - 0.3
    # 224 coefficients per token, both ways, at 4 bits + one bf16 scale = 114 bytes
    tokens = 30 * 8 * 128
    assert s["wire_bytes"]["pp_activations"] == tokens * 114
    assert s["wire_bytes"]["pp_gradients"] == tokens * 114
    # mean (576), basis (576 x 224) and coefficient scales (224) in bf16, shipped at steps 0, 2
    # and 8 (the fourth refresh, step 32, lies beyond 30 steps)
    assert s["wire_bytes"]["pp_codec_state"] == 3 * 2 * (576 + 576 * 224 + 224)
    dense = 2 * tokens * 576 * 4
    pp = sum(s["wire_bytes"][k] for k in ("pp_activations", "pp_gradients", "pp_codec_state"))
    assert dense / pp > 18  # 20.2x on the payload; the early state costs more over 30 steps than over 80
    from transformers import AutoModelForCausalLM
    import torch
    model = AutoModelForCausalLM.from_pretrained(os.path.join(out, "hf"))
    x = torch.tensor([[1, 2, 3, 4]])
    assert torch.isfinite(model(input_ids=x).logits).all()
    assert json.load(open(os.path.join(out, "hf", "config.json")))["tie_word_embeddings"] is False


def test_multinode_lines_are_what_the_mesh_test_runs():
    """tests/test_multinode.py runs launch/mesh.py's per-node commands; they are the README's
    multi-node lines (flags for flags; the emulation only adds --local-addr / is_host, which the
    README explains)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("mesh", os.path.join(ROOT, "launch", "mesh.py"))
    mesh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mesh)
    text = open(README).read()
    section = text.split("## Meshes: multi-node", 1)[1].split("\n## ", 1)[0]
    lines = [l for l in section.splitlines() if l.startswith(("deepspeed ", "torchrun "))]
    forms = {"deepspeed": [l for l in lines if "--no_ssh" in l],
             "torchrun": [l for l in lines if "--master_addr" in l and l.startswith("torchrun")],
             "torchrun-c10d": [l for l in lines if "--rdzv-backend c10d" in l]}
    for launcher, found in forms.items():
        assert found, launcher
        cmd = mesh.node_command(launcher, 1, 2, 29600, ["launch/train.py"], "hostfile", {})
        flags = {a for a in cmd if a.startswith("--")} - {"--local-addr", "--rdzv-conf"}
        for line in found:
            assert flags <= set(shlex.split(line.split("#")[0])), (launcher, flags, line)
    for f in ("--local-addr", "--rdzv-conf is_host=1", "Num nodes is >1 but no extra nodes available via hostfile"):
        assert f in section
