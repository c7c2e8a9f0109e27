"""The README's two set-up commands: .ci/run runs the test command verbatim, and the main-job
command really adapts the embedded default model (slow; part of CI)."""
import json
import os
import re
import shlex
import subprocess
import sys

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
    # deepspeed_launch supplies the launcher and the script; pass the README's own arguments. The
    # training is the README's; the held-out loss is scored on the first 64 of its 512 windows (an
    # eighth of the evaluation, which was most of the command's time on 2 cores; the standard error
    # grows to ~0.07, a quarter of the improvement measured in docs/benchmarks/default_run.md, 0.283)
    deepspeed_launch(2, launch[4:] + ["--output-dir", out, "--eval-sequences", "64"], timeout=2700)
    s = read_summary(out)
    assert s["config"]["model"] == "smollm2-135m" and s["mesh"] == {**s["mesh"], "pp": 2, "dp": 1}
    assert s["steps"] == 30 and s["tokens"] == 30 * 8 * 128
    assert len(read_metrics(out)) == 30
    # the pinned default corpus, the same bytes on every machine, and a held-out set of 64k tokens
    from ds_twocircuit.data import PINNED
    d = s["data"]
    assert d["spec"] == "sympy" and d["fingerprint"] == PINNED["sympy"].fingerprint
    assert d["documents"] == 1532 and d["train_tokens"] > 5_000_000 and d["heldout_tokens"] > 64 * 1024
    assert d["heldout_scored_tokens"] == 64 * 128
    # 30 steps through the codec improve the model as users score it, by more than the held-out
    # noise (dense inference: measured 2.629 -> 2.346, standard error 0.026), and the model as the
    # mesh serves it gets much better (through the codec: 3.01 -> 2.41)
    se = max(s["heldout_loss_first_se"], s["heldout_loss_se"])
    assert 0.005 < se < 0.2
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


# --- what the README tells users to type exists --------------------------------------------------
# The README is checked for its commands, flags and links, not for its prose.

def _readme():
    return open(README).read()


def _section(text, heading):
    return text.split(heading, 1)[1].split("\n## ", 1)[0]


def _command_snippets(text):
    """Every line of a fenced block and every inline code span: where the README writes commands."""
    blocks = re.findall(r"```[^\n]*\n(.*?)\n```", text, flags=re.S)
    outside = re.sub(r"```[^\n]*\n.*?\n```", "", text, flags=re.S)
    lines = [line for b in blocks for line in b.splitlines()]
    return lines + [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", outside)]


FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
# what each command's own --help is asked with
HELP = {"eval": [sys.executable, "-m", "eval", "--help"],
        "ds_twocircuit.export": [sys.executable, "-m", "ds_twocircuit.export", "merge", "--help"],
        "launch/mesh.py": [sys.executable, "launch/mesh.py", "--help", "--", "launch/train.py"]}
# flags a script reads before argparse, so its --help does not list them
NOT_IN_HELP = {"launch/train.py": {"--deepspeed"},        # DeepSpeed's own spelling of --deepspeed_config
               "launch/mesh.py": {"--remove-stale"}}      # a mode of its own: `mesh.py --remove-stale`


def _flags_by_command(text):
    """{command: flags the README passes it}: in a command line, the flags after ``launch/X.py`` (or
    ``python -m eval`` / ``ds_twocircuit.export``) up to the next script are that script's (the
    launcher's own come before it); in the sections about launch/train.py's options, an inline
    span that starts with a flag is one of launch/train.py's."""
    found = {}
    for snippet in _command_snippets(text):
        try:
            tokens = shlex.split(snippet.split(" #")[0])
        except ValueError:
            continue
        script = None
        for i, tok in enumerate(tokens):
            if re.fullmatch(r"(launch|examples)/\w+\.py", tok):
                script = tok
                found.setdefault(script, set())
            elif tok in ("eval", "ds_twocircuit.export") and i and tokens[i - 1] == "-m":
                script = tok
                found.setdefault(script, set())
            elif script and FLAG.fullmatch(tok.split("=")[0]):
                found[script].add(tok.split("=")[0])
    for heading in ("## What the default run does", "## Configs and flags", "## Faults and resume"):
        for span in re.findall(r"`(--[^`\n]+)`", _section(text, heading)):
            found.setdefault("launch/train.py", set()).update(FLAG.findall(span))
    return found


def test_every_script_the_readme_names_exists():
    text = _readme()
    # scripts, configs and tests (docs/ are links, checked below; docs/benchmarks/*.json may be outputs)
    paths = set(re.findall(r"(?<![\w/.])((?:launch|examples|ds_configs|tests|eval)/[\w./-]+\.(?:py|json|yaml|md))",
                           text))
    assert {"launch/train.py", "launch/mesh.py", "launch/bench_quality.py"} <= paths
    missing = sorted(p for p in paths if not os.path.isfile(os.path.join(ROOT, p)))
    assert not missing, missing
    # every adapters/<file>.py the layout names is a module (test_structure checks the converse)
    for name in re.findall(r"adapters/(\w+\.py)", text):
        assert os.path.isfile(os.path.join(ROOT, "ds_twocircuit", "adapters", name)), name


def test_every_flag_the_readme_passes_a_script_is_in_its_help():
    found = _flags_by_command(_readme())
    # the new launch/train.py options are documented, and so are the study scripts' main ones
    assert {"--set", "--eval-every", "--engine", "--pace-mbit", "--resume", "--deepspeed"} <= found["launch/train.py"]
    assert {"--configs", "--seeds", "--set", "--report"} <= found["launch/bench_quality.py"]
    assert {"--configs"} <= found["launch/screen_quality.py"]
    assert {"--checkpoint", "--tasks", "--compare", "--pruning", "--masked"} <= found["eval"]
    for script, flags in sorted(found.items()):
        if script.startswith("examples/"):
            continue        # run under accelerate launch, with their own settings
        cmd = HELP.get(script, [sys.executable, script, "--help"])
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, (script, p.stderr[-2000:])
        listed = set(FLAG.findall(p.stdout)) | NOT_IN_HELP.get(script, set())
        unknown = sorted(flags - listed)
        assert not unknown, f"README passes {script} {unknown}, which its --help does not list"


def _slug(heading):
    """GitHub's anchor of a Markdown heading."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def _anchors(path):
    text = re.sub(r"```.*?```", "", open(path).read(), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("doc", ["README.md", "docs/notes.md", "docs/benchmarks/README.md"])
def test_every_relative_link_resolves(doc):
    """Links to files exist (the results table's docs/benchmarks/ notes included), and a link to a
    section names a heading of the file it points to."""
    path = os.path.join(ROOT, doc)
    text = re.sub(r"```.*?```", "", open(path).read(), flags=re.S)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    bad = []
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        target, _, anchor = link.partition("#")
        file = os.path.normpath(os.path.join(os.path.dirname(path), target)) if target else path
        if not os.path.exists(file):
            bad.append(f"{link}: no such file")
        elif anchor and file.endswith(".md") and anchor not in _anchors(file):
            bad.append(f"{link}: no such heading")
    assert not bad, bad
    if doc == "README.md":
        assert sum(l.startswith("docs/benchmarks/") for l in links) >= 8   # the results table
