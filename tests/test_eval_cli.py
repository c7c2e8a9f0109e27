"""The evaluation CLI end to end on the tiny preset: tables, JSON, plots, comparison, masked
inference, and clear one-line errors (no traceback) with a non-zero exit for bad input."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from eval.cli import EXIT_BAD_INPUT, EXIT_OK, EXIT_TASKS_FAILED, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data", "eval")
FAST = ["--ppl-tokens", "300", "--ppl-seq-len", "64", "--no-progress", "--batch-size", "4"]


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def perturbed_run(tmp_path_factory):
    """A run folder (hf/ + summary.json) holding a slightly different tiny model."""
    from transformers import AutoModelForCausalLM
    from ds_twocircuit.models.presets import resolve_model
    folder = resolve_model("tiny")
    run = tmp_path_factory.mktemp("runs") / "m90"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    model.save_pretrained(run / "hf")
    for fn in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(folder, fn), run / "hf")
    summary = {"config": {"model": "tiny", "model_folder": folder, "data": "stdlib", "mask_seed": 5,
                          "twocircuit": {"mode": "random", "mask_rate": 0.9, "partition": "type"}},
               "mesh": {"pp": 2, "dp": 1}, "steps": 10}
    (run / "summary.json").write_text(json.dumps(summary))
    return str(run)


def test_list_tasks(capsys):
    code, out, _ = _run(capsys, "--list-tasks")
    assert code == EXIT_OK
    for name in ("humaneval", "gsm8k", "gsm8k-synth", "medqa", "spider", "code-ppl", "tech-ppl", "ppl:<path>"):
        assert name in out


def test_tasks_table_and_json(capsys, tmp_path):
    out_json = tmp_path / "r.json"
    code, out, err = _run(capsys, "--checkpoint", "tiny", "--tasks", "code-ppl,gsm8k-synth,humaneval,medqa",
                          "--task-data", f"medqa={DATA}/medqa.jsonl", "--limit", "3", "--max-new-tokens", "8",
                          "--out", str(out_json), *FAST)
    assert code == EXIT_OK, err
    for t in ("code-ppl", "gsm8k-synth", "humaneval", "medqa"):
        assert t in out
    r = json.loads(out_json.read_text())
    s = r["settings"]
    assert s["command"].startswith("python -m eval --checkpoint tiny")
    assert s["limit"] == 3 and s["versions"]["torch"] and s["sparsities"] == [0.0]
    tasks = r["checkpoints"][0]["runs"][0]["tasks"]
    assert set(tasks) == {"code-ppl", "gsm8k-synth", "humaneval", "medqa"}
    assert tasks["humaneval"]["n"] == 3 and tasks["humaneval"]["prompt_mode"] == "raw"
    assert tasks["humaneval"]["sandbox"] in ("namespaces", "userns", "none")
    assert tasks["code-ppl"]["metric"] == "perplexity" and tasks["code-ppl"]["score"] > 1
    assert 0.0 <= tasks["medqa"]["score"] <= 1.0 and tasks["medqa"]["n"] == 3
    assert r["checkpoints"][0]["checkpoint"]["kind"] == "preset"
    assert not os.path.exists(tmp_path / "r.png")  # no sweep, no plot


def test_pruning_sweep_writes_plot_and_relative_drops(capsys, tmp_path):
    out_json = tmp_path / "sweep.json"
    code, out, err = _run(capsys, "--checkpoint", "tiny", "--pruning", "0.1,0.5", "--pruning-scope", "global",
                          "--tasks", "code-ppl,legal-ppl", "--out", str(out_json), *FAST)
    assert code == EXIT_OK, err
    r = json.loads(out_json.read_text())
    runs = r["checkpoints"][0]["runs"]
    assert [x["sparsity"] for x in runs] == [0.0, 0.1, 0.5]
    for x in runs[1:]:
        assert x["pruning"]["achieved"] == pytest.approx(x["sparsity"], abs=1e-3)
        assert x["pruning"]["scope"] == "global"
    summ = r["summary"]["tiny"]["tasks"]["code-ppl"]
    base = summ[0]["score"]
    for e in summ[1:]:
        assert e["relative_drop"] == pytest.approx((e["score"] - base) / base)
    assert "mean quality change" in out and "0.50" in out
    png = tmp_path / "sweep.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_two_checkpoints(capsys, tmp_path, perturbed_run):
    out_json = tmp_path / "cmp.json"
    plot = tmp_path / "cmp_plot.png"
    code, out, err = _run(capsys, "--compare", "tiny", perturbed_run, "--pruning", "0.3", "--tasks", "code-ppl",
                          "--out", str(out_json), "--plot", str(plot), *FAST)
    assert code == EXIT_OK, err
    r = json.loads(out_json.read_text())
    assert [c["label"] for c in r["checkpoints"]] == ["tiny", "m90"]
    a, b = (c["runs"][0]["tasks"]["code-ppl"]["score"] for c in r["checkpoints"])
    assert a != b
    header = out.splitlines()[0]
    assert "tiny" in header and "m90" in header
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_masked_inference_from_summary_and_flags(capsys, tmp_path, perturbed_run):
    dense_json, masked_json = tmp_path / "d.json", tmp_path / "m.json"
    assert _run(capsys, "--checkpoint", perturbed_run, "--tasks", "code-ppl", "--out", str(dense_json), *FAST)[0] == 0
    code, _, err = _run(capsys, "--checkpoint", perturbed_run, "--masked", "--tasks", "code-ppl",
                        "--out", str(masked_json), *FAST)
    assert code == EXIT_OK, err
    d, m = json.loads(dense_json.read_text()), json.loads(masked_json.read_text())
    ms = m["checkpoints"][0]["masked"]
    assert (ms["pp"], ms["mask_rate"], ms["seed"]) == (2, 0.9, 5)
    score = lambda r: r["checkpoints"][0]["runs"][0]["tasks"]["code-ppl"]["score"]  # noqa: E731
    assert score(m) != score(d)
    # tiny has no summary: flags are required, and then work
    code, _, err = _run(capsys, "--checkpoint", "tiny", "--masked", "--tasks", "code-ppl",
                        "--out", str(tmp_path / "x.json"), *FAST)
    assert code == EXIT_BAD_INPUT and "--pp --mask-rate --mask-seed" in err
    code, _, err = _run(capsys, "--checkpoint", "tiny", "--masked", "--pp", "2", "--mask-rate", "0.95",
                        "--mask-seed", "0", "--tasks", "code-ppl", "--out", str(tmp_path / "y.json"), *FAST)
    assert code == EXIT_OK, err


@pytest.mark.parametrize("argv,needle", [
    (["--checkpoint", "/nonexistent/run/hf"], "does not exist"),
    (["--checkpoint", "tiny", "--tasks", "code-ppl,nosuchtask"], "unknown task 'nosuchtask'"),
    (["--checkpoint", "tiny", "--pruning", "0.2,1.0"], "outside [0, 1)"),
    (["--checkpoint", "tiny", "--pruning", "-0.1"], "outside [0, 1)"),
    (["--checkpoint", "tiny", "--pruning", "half"], "comma-separated numbers"),
    (["--checkpoint", "tiny", "--pass-k", "5"], "--samples >= 5"),
    (["--checkpoint", "tiny", "--tasks", "ppl:/no/such/corpus"], "does not exist"),
    (["--checkpoint", "tiny", "--task-data", "medqa"], "TASK=FILE"),
    (["--checkpoint", "tiny", "--mask-rate", "1.5"], "outside [0, 1)"),
    ([], "nothing to evaluate"),
    (["--checkpoint", "tiny", "--compare", "a", "b"], "not both"),
])
def test_bad_input_is_one_clear_line(capsys, argv, needle):
    code, out, err = _run(capsys, *argv)
    assert code == EXIT_BAD_INPUT
    assert needle in err and err.startswith("error: ") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_unreadable_checkpoints(capsys, tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"garbage")
    code, _, err = _run(capsys, "--checkpoint", str(tmp_path / "weights.safetensors"))
    assert code == EXIT_BAD_INPUT and "is a file" in err
    code, _, err = _run(capsys, "--checkpoint", str(tmp_path))
    assert code == EXIT_BAD_INPUT and "not a checkpoint" in err
    bad = tmp_path / "hf"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "llama"}')
    (bad / "model.safetensors").write_bytes(b"garbage")
    code, _, err = _run(capsys, "--checkpoint", str(bad), "--out", str(tmp_path / "r.json"), *FAST)
    assert code == EXIT_BAD_INPUT and "could not be loaded" in err and "Traceback" not in err


def test_all_tasks_failing_exits_non_zero(capsys, tmp_path, monkeypatch):
    from launch_helpers import hub_offline
    hub_offline(monkeypatch)
    code, out, err = _run(capsys, "--checkpoint", "tiny", "--tasks", "gsm8k,mbpp", "--out", str(tmp_path / "r.json"),
                          *FAST)
    assert code == EXIT_TASKS_FAILED
    assert "failed: gsm8k" in err and "Traceback" not in err
    r = json.loads((tmp_path / "r.json").read_text())
    assert set(r["checkpoints"][0]["errors"]) == {"gsm8k", "mbpp"}
    # one task works, one fails: exit 0, or 1 with --strict
    argv = ["--checkpoint", "tiny", "--tasks", "gsm8k,code-ppl", "--out", str(tmp_path / "s.json"), *FAST]
    assert _run(capsys, *argv)[0] == EXIT_OK
    assert _run(capsys, *argv, "--strict")[0] == EXIT_TASKS_FAILED


def test_python_dash_m_entry_point(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "eval", "--checkpoint", "tiny", "--tasks", "code-ppl",
                        "--out", str(tmp_path / "r.json"), *FAST], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "code-ppl" in p.stdout and (tmp_path / "r.json").is_file()
    p = subprocess.run([sys.executable, "-m", "eval", "--checkpoint", "tiny", "--pruning", "2"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "outside [0, 1)" in p.stderr


def test_compare_without_a_sweep_draws_bars_not_a_pruning_figure(tmp_path, monkeypatch):
    """--compare A B without --pruning: a side-by-side bar chart titled as a comparison."""
    from eval import report
    run = lambda score: {"sparsity": 0.0, "tasks": {"code-ppl": {"metric": "perplexity", "score": score,  # noqa: E731
                                                                 "higher_is_better": False}}}
    results = {"settings": {"masked": False},
               "checkpoints": [{"label": "dense", "runs": [run(5.0)]}, {"label": "m95", "runs": [run(7.5)]}]}
    assert report.plot_kind(results) == "comparison"
    titles, bars = [], []
    import matplotlib.figure
    real_savefig = matplotlib.figure.Figure.savefig

    def spy(fig, path, **kw):
        titles.append(fig._suptitle.get_text())
        bars.extend(p.get_height() for ax in fig.axes for p in ax.patches)
        return real_savefig(fig, path, **kw)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    path = report.plot(results, str(tmp_path / "cmp.png"))
    assert open(path, "rb").read(4) == b"\x89PNG"
    assert titles == ["Comparison: dense vs m95"] and bars == [5.0, 7.5]
    sweep = {"settings": {"masked": False, "pruning_scope": "global"},
             "checkpoints": [{"label": "dense", "runs": [run(5.0), {**run(6.0), "sparsity": 0.3}]}]}
    assert report.plot_kind(sweep) == "sweep"
    report.plot(sweep, str(tmp_path / "sweep.png"))
    assert titles[-1].startswith("Magnitude-pruning robustness")
