"""Grade-school math: GSM8K (hub) and ``gsm8k-synth``, an offline stand-in.

``gsm8k-synth`` draws multi-step arithmetic word problems from templates with a fixed seed, so
every machine gets the same problems; each record has GSM8K's format (``question``, and an
``answer`` with the worked solution ending in ``#### <number>``), so both tasks share prompting
and scoring: exact match of the final number (``1,000`` == ``1000.0``).

Prompts: ``raw``: four worked examples (written for this project, not taken from GSM8K's test
set) then ``Question: ...\\nAnswer:``; ``chat``: the question with an instruction to reason step
by step and end with "The answer is N".
"""
from __future__ import annotations

import random

from ..scoring import extract_final_number, gsm8k_reference, numbers_equal
from .base import EvalContext, Prepared, Task

FEW_SHOT = [
    ("A baker makes 24 muffins in the morning and 18 in the afternoon. He sells 30 of them. How "
     "many muffins are left?",
     "He makes 24 + 18 = 42 muffins. After selling 30, 42 - 30 = 12 are left.\n#### 12"),
    ("Maria buys 3 notebooks at $4 each and a pen for $2. She pays with a $20 bill. How much change "
     "does she get?",
     "The notebooks cost 3 * 4 = $12. With the pen she spends 12 + 2 = $14. Her change is "
     "20 - 14 = $6.\n#### 6"),
    ("A train travels 60 miles per hour for 3 hours and then 40 miles per hour for 2 hours. How far "
     "does it travel in total?",
     "First part: 60 * 3 = 180 miles. Second part: 40 * 2 = 80 miles. Total: 180 + 80 = 260 "
     "miles.\n#### 260"),
    ("Sam shares 45 stickers equally among 5 friends and keeps none. Each friend then gives 2 "
     "stickers away. How many stickers does each friend have?",
     "Each friend gets 45 / 5 = 9 stickers. After giving 2 away, each has 9 - 2 = 7.\n#### 7"),
]
CHAT_INSTRUCTION = ("{question}\n\nSolve the problem step by step, then finish with a final line "
                    "of the form \"The answer is N\".")
RAW_STOP = ["\n\nQuestion:", "\nQuestion:", "\n\n\n"]
MAX_NEW_TOKENS = {"raw": 256, "chat": 384}


def gsm_prompt(ctx: EvalContext, question: str, mode: str) -> str:
    if mode == "chat":
        return ctx.chat_prompt(CHAT_INSTRUCTION.format(question=question))
    shots = "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in FEW_SHOT)
    return f"{shots}Question: {question}\nAnswer:"


def score_gsm(ctx: EvalContext, records: list[dict], task: str) -> dict:
    mode = ctx.mode()
    settings = ctx.sampling(MAX_NEW_TOKENS[mode])
    prompts = [gsm_prompt(ctx, r["question"], mode) for r in records]
    gens = ctx.generate(prompts, settings, stop=RAW_STOP if mode == "raw" else (), chat=mode == "chat",
                        desc=f"{task} generate")
    correct, preds = [], []
    for r, g in zip(records, gens):
        pred = extract_final_number(g.text)
        preds.append(pred)
        correct.append(numbers_equal(pred, gsm8k_reference(r["answer"])))
    out = {"exact_match": sum(correct) / max(1, len(correct)), "n": len(records), "prompt_mode": mode,
           "generation": settings.to_dict()}
    if ctx.save_generations:
        out["generations"] = [{"text": g.text, "prediction": p, "correct": c}
                              for g, p, c in zip(gens, preds, correct)]
    return out


class GSM8K(Task):
    name = "gsm8k"
    family = "math"
    metric = "exact_match"
    source = "hub: openai/gsm8k (main, test)"
    description = "GSM8K exact match of the final number (offline stand-in: gsm8k-synth)"

    def prepare(self, ctx: EvalContext) -> Prepared:
        return Prepared(ctx.hub_records(self.name, "openai/gsm8k", "main", "test"))

    def evaluate(self, ctx: EvalContext, data: Prepared) -> dict:
        return score_gsm(ctx, data.records, self.name)


# --------------------------------------------------------------------------- the generator
NAMES = ["Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Isla", "Jamal", "Kira",
         "Liam", "Maya", "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sven", "Tara"]
ITEMS = ["apples", "marbles", "stickers", "pencils", "cookies", "stamps", "cards", "shells"]


def _p_shop(r: random.Random):
    n, a, pa, b, pb = r.choice(NAMES), r.randint(2, 9), r.randint(2, 15), r.randint(2, 9), r.randint(2, 15)
    paid = 10 * ((a * pa + b * pb) // 10 + r.randint(1, 5))
    ans = paid - a * pa - b * pb
    q = (f"{n} buys {a} shirts at ${pa} each and {b} hats at ${pb} each. {n} pays with ${paid}. "
         f"How much change does {n} get, in dollars?")
    sol = (f"Shirts: {a} * {pa} = {a * pa}. Hats: {b} * {pb} = {b * pb}. Total: {a * pa} + {b * pb} = "
           f"{a * pa + b * pb}. Change: {paid} - {a * pa + b * pb} = {ans}.")
    return q, sol, ans


def _p_collect(r: random.Random):
    n, m, it = r.choice(NAMES), r.choice(NAMES), r.choice(ITEMS)
    start, bags, per, give = r.randint(5, 40), r.randint(2, 8), r.randint(3, 12), r.randint(1, 15)
    ans = start + bags * per - give
    q = (f"{n} has {start} {it}. {n} buys {bags} packs with {per} {it} in each pack, then gives "
         f"{give} {it} to {m}. How many {it} does {n} have now?")
    sol = (f"The packs hold {bags} * {per} = {bags * per}. {start} + {bags * per} = {start + bags * per}. "
           f"After giving {give}: {start + bags * per} - {give} = {ans}.")
    return q, sol, ans


def _p_share(r: random.Random):
    n, it = r.choice(NAMES), r.choice(ITEMS)
    friends, each, extra = r.randint(2, 9), r.randint(3, 12), r.randint(1, 20)
    total = friends * each
    ans = each + extra
    q = (f"{n} shares {total} {it} equally among {friends} friends. Later each friend receives "
         f"{extra} more {it}. How many {it} does each friend have?")
    sol = f"Each friend first gets {total} / {friends} = {each}. Then {each} + {extra} = {ans}."
    return q, sol, ans


def _p_speed(r: random.Random):
    n = r.choice(NAMES)
    s1, h1, s2, h2 = r.randint(20, 80), r.randint(1, 5), r.randint(10, 60), r.randint(1, 4)
    ans = s1 * h1 + s2 * h2
    q = (f"{n} drives at {s1} miles per hour for {h1} hours, then at {s2} miles per hour for {h2} "
         f"hours. How many miles does {n} drive in total?")
    sol = f"{s1} * {h1} = {s1 * h1}. {s2} * {h2} = {s2 * h2}. {s1 * h1} + {s2 * h2} = {ans}."
    return q, sol, ans


def _p_percent(r: random.Random):
    n = r.choice(NAMES)
    price = 20 * r.randint(2, 30)
    pct = r.choice([10, 15, 20, 25, 30, 40, 50])
    qty = r.randint(1, 4)
    off = price * pct // 100
    ans = qty * (price - off)
    q = (f"A jacket costs ${price}. It is on sale for {pct}% off. {n} buys {qty} of them at the sale "
         f"price. How many dollars does {n} spend?")
    sol = (f"The discount is {pct}% of {price} = {off}. Sale price: {price} - {off} = {price - off}. "
           f"For {qty}: {qty} * {price - off} = {ans}.")
    return q, sol, ans


def _p_time(r: random.Random):
    n = r.choice(NAMES)
    days, per_day, weeks = r.randint(2, 6), r.randint(15, 90), r.randint(2, 6)
    ans = days * per_day * weeks
    q = (f"{n} practises piano {per_day} minutes a day, {days} days a week. How many minutes does "
         f"{n} practise in {weeks} weeks?")
    sol = f"Per week: {per_day} * {days} = {per_day * days}. In {weeks} weeks: {per_day * days} * {weeks} = {ans}."
    return q, sol, ans


def _p_garden(r: random.Random):
    n = r.choice(NAMES)
    rows, per_row, eaten, pick_days = r.randint(3, 12), r.randint(4, 15), r.randint(1, 10), r.randint(2, 5)
    total = rows * per_row
    eaten = min(eaten, total - pick_days)
    left = total - eaten
    left -= left % pick_days
    eaten = total - left
    ans = left // pick_days
    q = (f"{n} plants {rows} rows of tomato plants with {per_row} plants in each row. Rabbits eat "
         f"{eaten} plants. {n} picks the remaining plants' tomatoes over {pick_days} days, the same "
         f"number of plants each day. From how many plants does {n} pick each day?")
    sol = (f"{rows} * {per_row} = {total} plants. {total} - {eaten} = {left} remain. "
           f"{left} / {pick_days} = {ans}.")
    return q, sol, ans


def _p_age(r: random.Random):
    a, b = r.sample(NAMES, 2)
    age_b, diff, years = r.randint(4, 30), r.randint(2, 25), r.randint(2, 15)
    ans = 2 * age_b + diff + 2 * years
    q = (f"{b} is {age_b} years old. {a} is {diff} years older than {b}. What will the sum of their "
         f"ages be in {years} years?")
    sol = (f"{a} is {age_b} + {diff} = {age_b + diff}. Now the sum is {age_b} + {age_b + diff} = "
           f"{2 * age_b + diff}. In {years} years each is {years} older: {2 * age_b + diff} + 2 * {years} = {ans}.")
    return q, sol, ans


TEMPLATES = [_p_shop, _p_collect, _p_share, _p_speed, _p_percent, _p_time, _p_garden, _p_age]
SYNTH_VERSION = 1


def synthetic_problems(count: int = 250, seed: int = 1234) -> list[dict]:
    """GSM8K-format records: ``question``, ``answer`` (worked solution + ``#### N``)."""
    r = random.Random(seed)
    out = []
    for i in range(count):
        q, sol, ans = TEMPLATES[i % len(TEMPLATES)](r)
        out.append({"question": q, "answer": f"{sol}\n#### {ans}", "template": TEMPLATES[i % len(TEMPLATES)].__name__[3:]})
    return out


class GSM8KSynth(Task):
    name = "gsm8k-synth"
    family = "math"
    metric = "exact_match"
    source = f"offline generator (250 problems, seed 1234, version {SYNTH_VERSION})"
    offline = True
    description = "grade-school arithmetic word problems, exact match (offline GSM8K stand-in)"

    def prepare(self, ctx: EvalContext) -> Prepared:
        return Prepared(ctx.cap(synthetic_problems()), {"version": SYNTH_VERSION})

    def evaluate(self, ctx: EvalContext, data: Prepared) -> dict:
        return {**score_gsm(ctx, data.records, self.name), "generator_version": SYNTH_VERSION}
