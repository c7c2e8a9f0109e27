"""Multiple choice by log-likelihood: MedQA, MedMCQA, ARC-Challenge, SciQ, HellaSwag, WinoGrande,
QuALITY.

Each record becomes a list of (context, continuation) pairs and a gold index; the prediction is
the argmax of the summed continuation log-probabilities (``acc``) and of the same divided by the
continuation's length in characters (``acc_norm``), as in lm-evaluation-harness. Question formats
follow that harness: answer text as the continuation (ARC, SciQ, HellaSwag), the partial
evaluation of WinoGrande (the option fills the blank in the context, the rest of the sentence is
scored), and answer letters after lettered options (MedQA, MedMCQA, QuALITY).
"""
from __future__ import annotations

import re

from ..scoring import mc_argmax
from .base import EvalContext, Prepared, Task, TaskError

LETTERS = "ABCDEFGHIJ"


def lettered(question: str, options: list[str], context: str = "") -> list[tuple[str, str]]:
    head = f"{context}\n\n" if context else ""
    body = "\n".join(f"{LETTERS[i]}. {o}" for i, o in enumerate(options))
    ctx = f"{head}Question: {question}\n{body}\nAnswer:"
    return [(ctx, f" {LETTERS[i]}") for i in range(len(options))]


class MultipleChoice(Task):
    metric = "acc"
    hub: tuple[str, str | None, str] = ("", None, "")
    max_context_tokens: int | None = None   # long-document tasks cut the context from the left

    def choices(self, rec: dict) -> tuple[list[tuple[str, str]], int]:
        raise NotImplementedError

    def prepare(self, ctx: EvalContext) -> Prepared:
        recs = ctx.hub_records(self.name, *self.hub)
        items = []
        for i, r in enumerate(recs):
            try:
                items.append(self.choices(r))
            except (KeyError, ValueError, TypeError, IndexError) as e:
                raise TaskError(f"{self.name}: record {i} does not have the {self.hub[0]} format "
                                f"({type(e).__name__}: {e})") from None
        return Prepared(items)

    def evaluate(self, ctx: EvalContext, data: Prepared) -> dict:
        requests, spans = [], []
        for pairs, _ in data.records:
            spans.append((len(requests), len(pairs)))
            for c, x in pairs:
                c_ids = ctx.encode(c, special=True)
                if self.max_context_tokens:
                    c_ids = c_ids[-self.max_context_tokens:]
                requests.append((c_ids, ctx.encode(x)))
        scores = ctx.loglikelihoods(requests, desc=f"{self.name} log-likelihood")
        acc, acc_norm = [], []
        for (pairs, gold), (s, n) in zip(data.records, spans):
            ll = [scores[s + j][0] for j in range(n)]
            norm = [v / max(1, len(pairs[j][1])) for j, v in enumerate(ll)]
            acc.append(mc_argmax(ll) == gold)
            acc_norm.append(mc_argmax(norm) == gold)
        k = max(1, len(acc))
        return {"acc": sum(acc) / k, "acc_norm": sum(acc_norm) / k, "n": len(acc),
                "primary": self.metric}


class MedQA(MultipleChoice):
    name, family = "medqa", "medical"
    source = "hub: GBaker/MedQA-USMLE-4-options (test)"
    hub = ("GBaker/MedQA-USMLE-4-options", None, "test")
    description = "MedQA (USMLE, 4 options), accuracy"

    def choices(self, rec):
        keys = sorted(rec["options"])
        return lettered(rec["question"], [rec["options"][k] for k in keys]), keys.index(rec["answer_idx"])


class MedMCQA(MultipleChoice):
    name, family = "medmcqa", "medical"
    source = "hub: openlifescienceai/medmcqa (validation)"
    hub = ("openlifescienceai/medmcqa", None, "validation")
    description = "MedMCQA (4 options), accuracy"

    def choices(self, rec):
        return lettered(rec["question"], [rec["opa"], rec["opb"], rec["opc"], rec["opd"]]), int(rec["cop"])


class ARCChallenge(MultipleChoice):
    name, family = "arc-challenge", "science"
    source = "hub: allenai/ai2_arc (ARC-Challenge, test)"
    hub = ("allenai/ai2_arc", "ARC-Challenge", "test")
    description = "ARC-Challenge, accuracy"

    def choices(self, rec):
        ctx = f"Question: {rec['question']}\nAnswer:"
        ch = rec["choices"]
        return [(ctx, f" {t}") for t in ch["text"]], list(ch["label"]).index(rec["answerKey"])


class SciQ(MultipleChoice):
    name, family = "sciq", "science"
    source = "hub: allenai/sciq (test)"
    hub = ("allenai/sciq", None, "test")
    description = "SciQ, accuracy"

    def choices(self, rec):
        ctx = f"{rec.get('support', '').lstrip()}\nQuestion: {rec['question']}\nAnswer:".lstrip("\n")
        opts = [rec["distractor1"], rec["distractor2"], rec["distractor3"], rec["correct_answer"]]
        return [(ctx, f" {o}") for o in opts], 3


def _hellaswag_clean(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


class HellaSwag(MultipleChoice):
    name, family = "hellaswag", "commonsense"
    metric = "acc_norm"
    source = "hub: Rowan/hellaswag (validation)"
    hub = ("Rowan/hellaswag", None, "validation")
    description = "HellaSwag, length-normalised accuracy"

    def choices(self, rec):
        ctx = _hellaswag_clean(f"{rec['activity_label']}: {rec['ctx_a']} {rec['ctx_b'].capitalize()}")
        return [(ctx, " " + _hellaswag_clean(e)) for e in rec["endings"]], int(rec["label"])


class WinoGrande(MultipleChoice):
    name, family = "winogrande", "commonsense"
    source = "hub: allenai/winogrande (winogrande_xl, validation)"
    hub = ("allenai/winogrande", "winogrande_xl", "validation")
    description = "WinoGrande (partial evaluation), accuracy"

    def choices(self, rec):
        s = rec["sentence"]
        i = s.index("_")
        rest = " " + s[i + 1:].strip()
        return [(s[:i] + rec["option1"], rest), (s[:i] + rec["option2"], rest)], int(rec["answer"]) - 1


class QuALITY(MultipleChoice):
    name, family = "quality", "long documents"
    source = "hub: emozilla/quality (validation)"
    hub = ("emozilla/quality", None, "validation")
    description = "QuALITY (long articles, context cut to the last 2048 tokens), accuracy"
    max_context_tokens = 2048

    def choices(self, rec):
        return lettered(rec["question"], list(rec["options"]), context=rec["article"]), int(rec["answer"])
