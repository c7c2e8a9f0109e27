"""``code_eval`` (pass@k of model-written Python against test code) with the programs run in this
project's sandbox (``eval.sandbox``: no network, own PID namespace, read-only mounts, resource
limits, a wall-clock deadline) instead of in the host process.

A drop-in for ``evaluate.load("code_eval")``: the same inputs (``predictions``: one list of
candidate programs per problem; ``references``: one test program per problem; ``k``,
``num_workers``, ``timeout``) and the same outputs (``pass_at_k`` = ``{"pass@k": mean}`` for
every ``k`` all problems have enough candidates for; ``results`` = ``{problem index:
[(completion_id, {"task_id", "passed", "result", "completion_id"}), ...]}`` in completion order,
``result`` being ``"passed"``, ``"timed out"`` or ``"failed: ..."``). Differences: no
``HF_ALLOW_CODE_EVAL`` opt-in (the code does not run in this process), and a program passes only
if it runs to its end (an early ``exit(0)`` in a candidate is a failure).

    import evaluate
    from eval.metrics import CODE_EVAL_SANDBOXED
    code_eval = evaluate.load(CODE_EVAL_SANDBOXED)
    pass_at_k, results = code_eval.compute(references=["assert add(2, 3) == 5"],
                                           predictions=[["def add(a, b): return a * b",
                                                         "def add(a, b): return a + b"]], k=[1, 2])
    # pass_at_k == {"pass@1": 0.5, "pass@2": 1.0}
"""
from collections import defaultdict

import datasets
import evaluate
import numpy as np

_CITATION = """@article{chen2021codex, title={Evaluating Large Language Models Trained on Code},
author={Mark Chen and others}, year={2021}, eprint={2107.03374}, archivePrefix={arXiv}}"""


def estimate_pass_at_k(total, correct, k: int) -> np.ndarray:
    """Unbiased pass@k per problem (n samples, c correct): 1 - C(n - c, k) / C(n, k)."""
    from eval.scoring import pass_at_k
    return np.array([pass_at_k(int(n), int(c), k) for n, c in zip(total, correct)])


def _result_text(res) -> str:
    if res.status == "passed":
        return "passed"
    if res.status == "timed out":
        return "timed out"
    lines = [ln for ln in (res.stderr or "").strip().splitlines() if ln.strip()]
    return "failed: " + (lines[-1] if lines else f"exit status {res.returncode}")


@evaluate.utils.file_utils.add_start_docstrings(__doc__)
class CodeEvalSandboxed(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__, citation=_CITATION, inputs_description=__doc__,
            features=datasets.Features({"predictions": datasets.Sequence(datasets.Value("string")),
                                        "references": datasets.Value("string")}),
            homepage="https://github.com/openai/human-eval", codebase_urls=[], reference_urls=[],
            license="Apache-2.0")

    def _compute(self, predictions, references, k=(1, 10, 100), num_workers=4, timeout=3.0):
        from eval.sandbox import Limits, Sandbox

        sandbox = Sandbox(Limits(timeout_s=float(timeout)))
        programs, owners = [], []
        for task_id, (candidates, test_case) in enumerate(zip(predictions, references)):
            for completion_id, candidate in enumerate(candidates):
                programs.append(candidate + "\n" + test_case)
                owners.append((task_id, completion_id))
        outcomes = sandbox.run_many(programs, workers=num_workers, desc="code_eval (sandboxed)")
        results = defaultdict(list)
        for (task_id, completion_id), res in zip(owners, outcomes):
            results[task_id].append((completion_id, {"task_id": task_id, "passed": res.passed,
                                                     "result": _result_text(res),
                                                     "completion_id": completion_id}))
        total, correct = [], []
        for result in results.values():
            result.sort(key=lambda r: r[0])
            total.append(len(result))
            correct.append(sum(r[1]["passed"] for r in result))
        total, correct = np.array(total), np.array(correct)
        ks = k if isinstance(k, (list, tuple)) else [k]
        pass_at_k = {f"pass@{kk}": estimate_pass_at_k(total, correct, kk).mean()
                     for kk in ks if (total >= kk).all()}
        return pass_at_k, results
