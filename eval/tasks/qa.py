"""NarrativeQA: free-form answers about a story, scored by SQuAD token F1 (max over references).

The story's summary is the context (the "summaries" setting: full books do not fit a small
model's context); it is cut to 1536 tokens.
"""
from __future__ import annotations

from ..scoring import max_token_f1
from .base import EvalContext, Prepared, Task, TaskError

MAX_CONTEXT_TOKENS = 1536


def _text(v):
    return v["text"] if isinstance(v, dict) else v


class NarrativeQA(Task):
    name, family = "narrativeqa", "long documents"
    metric = "f1"
    source = "hub: deepmind/narrativeqa (test; summaries as context)"
    description = "NarrativeQA over story summaries, token F1"
    max_new_tokens = 32

    def prepare(self, ctx: EvalContext) -> Prepared:
        recs = ctx.hub_records(self.name, "deepmind/narrativeqa", None, "test")
        items = []
        for i, r in enumerate(recs):
            try:
                items.append({"context": r["document"]["summary"]["text"], "question": _text(r["question"]),
                              "answers": [_text(a) for a in r["answers"]]})
            except (KeyError, TypeError) as e:
                raise TaskError(f"{self.name}: record {i} does not have the deepmind/narrativeqa format "
                                f"(missing {e})") from None
        return Prepared(items)

    def evaluate(self, ctx: EvalContext, data: Prepared) -> dict:
        mode = ctx.mode()
        settings = ctx.sampling(self.max_new_tokens)
        prompts = []
        for r in data.records:
            story = ctx.clip(r["context"].strip(), MAX_CONTEXT_TOKENS)
            if mode == "chat":
                prompts.append(ctx.chat_prompt(f"{story}\n\nAnswer the question about the story above "
                                               f"in a few words.\nQuestion: {r['question']}"))
            else:
                prompts.append(f"{story}\n\nQuestion: {r['question']}\nAnswer:")
        gens = ctx.generate(prompts, settings, stop=["\n"] if mode == "raw" else (), chat=mode == "chat",
                            desc=f"{self.name} generate")
        f1 = [max_token_f1(g.text.strip(), r["answers"]) for g, r in zip(gens, data.records)]
        out = {"f1": sum(f1) / max(1, len(f1)), "n": len(f1), "prompt_mode": mode,
               "generation": settings.to_dict()}
        if ctx.save_generations:
            out["generations"] = [g.text for g in gens]
        return out
