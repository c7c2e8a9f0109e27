"""Summarisation: CNN/DailyMail and XSum, scored by ROUGE-1 F1 against the reference summary.

The article is cut to the tokens that fit next to the answer: the model's positions minus the
answer budget, and at most 1536 tokens, so CPU runs stay short.
Prompts: ``raw``: the article then ``TL;DR:``; ``chat``: an instruction with the sentence count.
"""
from __future__ import annotations

from ..scoring import rouge1
from .base import EvalContext, Prepared, Task

MAX_ARTICLE_TOKENS = 1536


class Summarization(Task):
    metric = "rouge1"
    hub: tuple[str, str | None, str] = ("", None, "")
    fields = ("article", "highlights")
    sentences = "three sentences"
    max_new_tokens = 128
    raw_stop = ["\n\n"]

    def prepare(self, ctx: EvalContext) -> Prepared:
        return Prepared(ctx.hub_records(self.name, *self.hub))

    def evaluate(self, ctx: EvalContext, data: Prepared) -> dict:
        mode = ctx.mode()
        settings = ctx.sampling(self.max_new_tokens)
        room = min(MAX_ARTICLE_TOKENS, ctx.max_positions() - settings.max_new_tokens - 64)
        doc_key, ref_key = self.fields
        prompts = []
        for r in data.records:
            article = ctx.clip(r[doc_key].strip(), room)
            if mode == "chat":
                prompts.append(ctx.chat_prompt(f"Summarize the following article in {self.sentences}."
                                               f"\n\n{article}"))
            else:
                prompts.append(f"{article}\n\nTL;DR:")
        gens = ctx.generate(prompts, settings, stop=self.raw_stop if mode == "raw" else (),
                            chat=mode == "chat", desc=f"{self.name} generate")
        scores = [rouge1(g.text.strip(), r[ref_key]) for g, r in zip(gens, data.records)]
        k = max(1, len(scores))
        out = {"rouge1": sum(s["f1"] for s in scores) / k,
               "rouge1_precision": sum(s["precision"] for s in scores) / k,
               "rouge1_recall": sum(s["recall"] for s in scores) / k,
               "n": len(scores), "prompt_mode": mode, "generation": settings.to_dict(),
               "article_tokens_max": room}
        if ctx.save_generations:
            out["generations"] = [g.text for g in gens]
        return out


class CNNDailyMail(Summarization):
    name, family = "cnn-dailymail", "summarisation"
    source = "hub: abisee/cnn_dailymail (3.0.0, test)"
    hub = ("abisee/cnn_dailymail", "3.0.0", "test")
    description = "CNN/DailyMail, ROUGE-1 F1"


class XSum(Summarization):
    name, family = "xsum", "summarisation"
    source = "hub: EdinburghNLP/xsum (test)"
    hub = ("EdinburghNLP/xsum", None, "test")
    fields = ("document", "summary")
    sentences = "one sentence"
    max_new_tokens = 64
    raw_stop = ["\n"]
    description = "XSum, ROUGE-1 F1"
