"""What every task needs: the :class:`Task` interface, the :class:`EvalContext` it runs in, and
record loading (Hugging Face hub via ``datasets``, or local JSON Lines in the same format).

A task never touches the model directly: it asks the context to ``generate`` text, score
``loglikelihoods``, compute ``windows_nll`` or ``execute`` programs. Tests replace those methods
with scripted answers to check a task's prompt building and scoring without a model.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

from ..generation import SamplingSettings


class TaskError(RuntimeError):
    """A task cannot run here (data unavailable, missing database, ...): one clear line."""


@dataclasses.dataclass
class Prepared:
    """A task's data, loaded once per checkpoint and reused at every sparsity."""
    records: list
    info: dict = dataclasses.field(default_factory=dict)


class Task:
    name: str = ""
    family: str = ""
    metric: str = ""                 # the primary metric (a key of the result dict)
    higher_is_better: bool = True
    source: str = ""                 # where the data comes from, for --list-tasks and the JSON
    offline: bool = False            # runs with no hub access
    description: str = ""

    def prepare(self, ctx: "EvalContext") -> Prepared:
        raise NotImplementedError

    def evaluate(self, ctx: "EvalContext", data: Prepared) -> dict[str, Any]:
        """Metrics (the primary one under ``self.metric``), ``n`` and task settings."""
        raise NotImplementedError

    def __repr__(self):
        return f"<task {self.name}>"


def read_jsonl(path: str, task: str) -> list[dict]:
    if not os.path.isfile(path):
        raise TaskError(f"{task}: --task-data file {path!r} does not exist")
    out = []
    with open(path, encoding="utf-8") as f:
        if path.endswith(".json"):
            data = json.load(f)
            return list(data if isinstance(data, list) else data.get("data", []))
        for i, line in enumerate(f):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise TaskError(f"{task}: {path} line {i + 1} is not valid JSON ({e})") from None
    return out


@dataclasses.dataclass
class EvalContext:
    model: Any = None
    tokenizer: Any = None
    batch_size: int = 8
    limit: int | None = None
    prompt_mode: str = "auto"                     # auto | chat | raw
    samples: int = 1                              # completions per problem (pass@k)
    pass_k: tuple[int, ...] = (1,)
    temperature: float = 0.8
    top_p: float = 0.95
    seed: int = 0
    max_new_tokens: int | None = None             # override of each task's default
    ppl_tokens: int = 16384
    ppl_seq_len: int = 1024
    task_data: dict[str, str] = dataclasses.field(default_factory=dict)
    spider_db_dir: str | None = None
    training_data: str | None = None              # the run's --data (for heldout-ppl)
    exec_timeout: float = 10.0
    exec_workers: int = 2
    sandbox_isolation: str = "auto"
    save_generations: bool = False
    progress: bool = True
    _sandbox: Any = None

    # ------------------------------------------------------------------ prompting
    def mode(self) -> str:
        if self.prompt_mode != "auto":
            return self.prompt_mode
        return "chat" if getattr(self.tokenizer, "chat_template", None) else "raw"

    def chat_prompt(self, user: str, system: str | None = None) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise TaskError("--prompt-mode chat: this model's tokenizer has no chat template; "
                            "use --prompt-mode raw")
        msgs = ([{"role": "system", "content": system}] if system else []) + \
               [{"role": "user", "content": user}]
        return self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)

    def encode(self, text: str, special: bool = False) -> list[int]:
        return self.tokenizer(text, add_special_tokens=special, verbose=False)["input_ids"]

    def clip(self, text: str, max_tokens: int) -> str:
        """The first ``max_tokens`` tokens of ``text`` (long articles in a limited context)."""
        ids = self.encode(text)
        return text if len(ids) <= max_tokens else self.tokenizer.decode(ids[:max_tokens])

    def max_positions(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 4096)

    def sampling(self, default_max_new_tokens: int, samples: int = 1) -> SamplingSettings:
        return SamplingSettings(max_new_tokens=self.max_new_tokens or default_max_new_tokens,
                                do_sample=samples > 1, temperature=self.temperature,
                                top_p=self.top_p, seed=self.seed)

    def cap(self, records: list) -> list:
        return records[: self.limit] if self.limit else records

    # ------------------------------------------------------------------ model calls
    def generate(self, prompts: Sequence[str], settings: SamplingSettings, stop: Sequence[str] = (),
                 stop_regex: str | None = None, chat: bool = False, desc: str = "generating"):
        from ..generation import generate
        return generate(self.model, self.tokenizer, prompts, settings, stop=stop, stop_regex=stop_regex,
                        batch_size=self.batch_size, add_special_tokens=not chat, desc=desc,
                        progress=self.progress)

    def loglikelihoods(self, requests, desc: str = "log-likelihood"):
        from ..likelihood import loglikelihoods
        return loglikelihoods(self.model, requests, batch_size=self.batch_size, desc=desc,
                              progress=self.progress)

    def windows_nll(self, windows, desc: str = "perplexity"):
        from ..likelihood import windows_nll
        return windows_nll(self.model, windows, batch_size=max(1, self.batch_size // 2), desc=desc,
                           progress=self.progress)

    @property
    def sandbox(self):
        if self._sandbox is None:
            from ..sandbox import Limits, Sandbox
            self._sandbox = Sandbox(Limits(timeout_s=self.exec_timeout), isolation=self.sandbox_isolation)
        return self._sandbox

    def execute(self, programs: list[str], desc: str = "executing"):
        return self.sandbox.run_many(programs, workers=self.exec_workers, check=True, desc=desc,
                                     progress=self.progress)

    # ------------------------------------------------------------------ data
    def hub_records(self, task: str, hub_id: str, config: str | None, split: str) -> list[dict]:
        """Local records (``--task-data task=FILE``) or the hub dataset, capped by ``--limit``."""
        if task in self.task_data:
            return self.cap(read_jsonl(self.task_data[task], task))
        where = f"{hub_id}" + (f" ({config})" if config else "") + f", split {split}"
        hint = f"or pass local records in the same format: --task-data {task}=FILE.jsonl"
        try:
            import datasets
        except ImportError:
            raise TaskError(f"{task}: needs the 'datasets' package and Hugging Face hub access to "
                            f"load {where} (pip install datasets), {hint}") from None
        try:
            ds = datasets.load_dataset(hub_id, config, split=split)
        except Exception as e:  # offline, gated, renamed: all end here with one line
            first = (str(e).strip().splitlines() or [""])[0][:200]
            raise TaskError(f"{task}: could not load {where} from the Hugging Face hub "
                            f"({type(e).__name__}: {first}); {hint}") from None
        if self.limit:
            ds = ds.select(range(min(self.limit, len(ds))))
        return [dict(r) for r in ds]
