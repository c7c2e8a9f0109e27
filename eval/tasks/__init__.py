"""Task registry: the paper's evaluation table (method notes, section 6) plus offline tasks.

``get_task(name)`` returns a task instance (``ppl:<path>`` builds one for any corpus);
``TASKS`` lists the registered ones in table order.
"""
from __future__ import annotations

from .base import EvalContext, Prepared, Task, TaskError
from .code import MBPP, HumanEval
from .math import GSM8K, GSM8KSynth
from .multiple_choice import ARCChallenge, HellaSwag, MedMCQA, MedQA, QuALITY, SciQ, WinoGrande
from .perplexity import (CodePerplexity, CorpusPerplexity, CppPerplexity, LegalPerplexity,
                         RunHeldoutPerplexity, TechPerplexity)
from .qa import NarrativeQA
from .spider import Spider
from .summarization import CNNDailyMail, XSum

_ORDER = [MedQA, MedMCQA, HumanEval, MBPP, GSM8K, GSM8KSynth, ARCChallenge, SciQ, HellaSwag,
          WinoGrande, CNNDailyMail, XSum, Spider, QuALITY, NarrativeQA, CodePerplexity,
          CppPerplexity, LegalPerplexity, TechPerplexity, RunHeldoutPerplexity]
TASKS: dict[str, Task] = {cls.name: cls() for cls in _ORDER}
DYNAMIC = {"ppl:<path>": "perplexity on every document of a folder of text files or a .jsonl file"}


def get_task(name: str) -> Task:
    name = name.strip()
    if name.startswith("ppl:") and len(name) > 4:
        return CorpusPerplexity(name[4:])
    if name in TASKS:
        return TASKS[name]
    import difflib
    close = difflib.get_close_matches(name, list(TASKS), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise TaskError(f"unknown task {name!r}{hint}; known: {', '.join(TASKS)}, ppl:<path> "
                    "(see --list-tasks)")


__all__ = ["EvalContext", "Prepared", "Task", "TaskError", "TASKS", "get_task"]
