"""The benchmark script's plumbing on the tiny preset (the real numbers come from SmolLM2)."""
import json

from eval.bench import main


def test_bench_writes_json_and_markdown(tmp_path):
    out = tmp_path / "bench"
    assert main(["--model", "tiny", "--prompts", "3", "--max-new-tokens", "6", "--batch-size", "3,2",
                 "--out-dir", str(out)]) == 0
    doc = json.loads((out / "eval.json").read_text())
    g = doc["generation"]
    assert doc["generation_speedup"] > 0 and g["batched"]["tokens"] > 0 and g["naive"]["tokens"] > 0
    assert doc["command"]["generation_speedup"].startswith("python -m eval.bench --model tiny")
    # HumanEval pass@1 from an evaluation results file, generation numbers kept
    res = {"settings": {"command": "python -m eval --checkpoint smollm2-135m --tasks humaneval"},
           "checkpoints": [{"checkpoint": {"path": "smollm2-135m"}, "runs": [{"tasks": {"humaneval": {
               "pass@1": 0.0366, "n": 164, "per_problem": {"HumanEval/0": 1, "HumanEval/1": 0},
               "prompt_mode": "chat", "generation": {"max_new_tokens": 512}, "sandbox": "namespaces",
               "seconds": 600.0, "statuses": {"passed": 6, "failed": 158}}}}]}]}
    (tmp_path / "he.json").write_text(json.dumps(res))
    assert main(["--skip-generation", "--humaneval-results", str(tmp_path / "he.json"), "--out-dir", str(out)]) == 0
    doc2 = json.loads((out / "eval.json").read_text())
    assert doc2["humaneval_pass1_base"] == 0.0366 and doc2["generation_speedup"] == doc["generation_speedup"]
    assert set(doc2["command"]) == {"generation_speedup", "humaneval_pass1_base"}
    md = (out / "eval.md").read_text()
    assert "Speed-up" in md and "pass@1 = **0.0366**" in md
