"""Pure metric functions: no model, no dataset, no I/O except the SQLite file of ``sql_execution_match``.

* exact match with SQuAD normalisation (lower case, no punctuation, no articles, single spaces);
* GSM8K: final-number extraction (``#### 42``, "the answer is 42", else the last number) and
  numeric equality (``1,000`` == ``1000.00``);
* multiple choice: argmax of per-choice log-likelihoods (first index on ties);
* ROUGE-1 (unigram precision/recall/F1 with the ``rouge-score`` package's tokenisation:
  lower case, non-alphanumerics as separators, no stemming);
* token F1 (SQuAD / NarrativeQA), max over references;
* pass@k, the unbiased estimator of Chen et al. (2021);
* SQL execution match (Spider): both queries run read-only against the real SQLite database,
  results compared as multisets, or as lists when the gold query has ORDER BY;
* code / SQL extraction from chat answers (fenced blocks).
"""
from __future__ import annotations

import collections
import math
import re
import sqlite3
import string
import time
from decimal import Decimal, InvalidOperation

# ------------------------------------------------------------------------- text normalisation
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD's normalisation: lower case, drop punctuation and articles, collapse whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def exact_match(prediction: str, reference: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(reference))


# ------------------------------------------------------------------------- numbers (GSM8K)
_NUMBER = re.compile(r"-?\$?\s?\d[\d,]*(?:\.\d+)?|-?\$?\s?\.\d+")


def _clean_number(tok: str) -> str | None:
    t = tok.replace("$", "").replace(",", "").replace(" ", "").rstrip(".")
    try:
        d = Decimal(t)
    except InvalidOperation:
        return None
    d = d.normalize()
    s = format(d, "f")
    return "0" if s in ("-0", "") else s


def gsm8k_reference(answer_field: str) -> str:
    """The gold number of a GSM8K ``answer`` field (the text after ``####``)."""
    tail = answer_field.rsplit("####", 1)[-1]
    nums = _NUMBER.findall(tail)
    got = _clean_number(nums[0]) if nums else None
    if got is None:
        raise ValueError(f"no final number in GSM8K answer {answer_field[-80:]!r}")
    return got


def extract_final_number(text: str) -> str | None:
    """The model's final answer: after ``####``, else after "answer is"/"answer:" (last such
    marker, any case), else the last number in the text."""
    low = text.lower()
    for marker in ("####", "answer is", "answer:"):
        at = low.rfind(marker)
        if at >= 0:
            nums = _NUMBER.findall(text[at + len(marker):])
            if nums:
                return _clean_number(nums[0])
    nums = _NUMBER.findall(text)
    return _clean_number(nums[-1]) if nums else None


def numbers_equal(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return False
    try:
        return Decimal(a) == Decimal(b)
    except InvalidOperation:
        return False


# ------------------------------------------------------------------------- multiple choice
def mc_argmax(scores: list[float]) -> int:
    """Index of the highest score; the first one on ties (deterministic)."""
    if not scores:
        raise ValueError("no choices to score")
    best = 0
    for i, s in enumerate(scores):
        if s > scores[best]:
            best = i
    return best


# ------------------------------------------------------------------------- ROUGE-1 / token F1
_NON_ALNUM = re.compile(r"[^a-z0-9]+")


def rouge_tokens(text: str) -> list[str]:
    return [t for t in _NON_ALNUM.sub(" ", text.lower()).split() if t]


def _prf(overlap: int, n_pred: int, n_ref: int) -> dict[str, float]:
    p = overlap / n_pred if n_pred else 0.0
    r = overlap / n_ref if n_ref else 0.0
    f = 2 * p * r / (p + r) if p + r else 0.0
    return {"precision": p, "recall": r, "f1": f}


def rouge1(prediction: str, reference: str) -> dict[str, float]:
    """ROUGE-1 precision, recall and F1 (unigram overlap, clipped counts)."""
    pc, rc = collections.Counter(rouge_tokens(prediction)), collections.Counter(rouge_tokens(reference))
    return _prf(sum((pc & rc).values()), sum(pc.values()), sum(rc.values()))


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD token F1 after :func:`normalize_answer`; two empty strings score 1."""
    p, r = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not p or not r:
        return float(p == r)
    return _prf(sum((collections.Counter(p) & collections.Counter(r)).values()), len(p), len(r))["f1"]


def max_token_f1(prediction: str, references: list[str]) -> float:
    return max((token_f1(prediction, r) for r in references), default=0.0)


# ------------------------------------------------------------------------- pass@k
def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples (drawn from n, c correct) passes."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


# ------------------------------------------------------------------------- extraction
_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(text: str, language: str = "python") -> str:
    """The first fenced block tagged ``language`` (else the first fenced block, else the text)."""
    blocks = _FENCE.findall(text)
    for lang, body in blocks:
        if lang.lower() in (language, language[:2]):
            return body
    if blocks:
        return blocks[0][1]
    return text


def extract_sql(text: str) -> str:
    """A single SQL statement from a chat answer or a raw completion."""
    body = extract_code(text, "sql")
    m = re.search(r"\b(SELECT|WITH)\b", body, re.IGNORECASE)
    if m:
        body = body[m.start():]
    return body.split(";")[0].strip()


# ------------------------------------------------------------------------- SQL (Spider)
_ALLOWED_SQL_ACTIONS = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION,
                        getattr(sqlite3, "SQLITE_RECURSIVE", 33)}


def _authorizer(action, *_):
    # Only reads: no ATTACH (which could create files), no PRAGMA, no writes of any kind.
    return sqlite3.SQLITE_OK if action in _ALLOWED_SQL_ACTIONS else sqlite3.SQLITE_DENY


def run_sql(db_path: str, sql: str, timeout_s: float = 10.0, max_rows: int = 100_000) -> list[tuple]:
    """Run one query read-only; raises ``sqlite3.Error`` on any failure or timeout."""
    uri = "file:" + db_path.replace("?", "%3f").replace("#", "%23") + "?mode=ro"
    conn = sqlite3.connect(uri, uri=True, timeout=timeout_s, check_same_thread=False)
    try:
        conn.text_factory = lambda b: b.decode("utf-8", "replace")
        deadline = time.monotonic() + timeout_s
        conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
        conn.set_authorizer(_authorizer)
        cur = conn.execute(sql)
        rows = cur.fetchmany(max_rows + 1)
        if len(rows) > max_rows:
            raise sqlite3.OperationalError(f"more than {max_rows} rows")
        return rows
    finally:
        conn.close()


def _norm_value(v):
    if isinstance(v, float):
        return round(v, 6) if math.isfinite(v) else v
    if isinstance(v, bytes):
        return v.hex()
    return v


def sql_execution_match(prediction: str, reference: str, db_path: str,
                        timeout_s: float = 10.0) -> tuple[bool, str]:
    """(match, reason). Rows compared as multisets, or in order when the gold query sorts."""
    gold = [tuple(map(_norm_value, r)) for r in run_sql(db_path, reference, timeout_s)]
    try:
        pred = [tuple(map(_norm_value, r)) for r in run_sql(db_path, prediction, timeout_s)]
    except (sqlite3.Error, ValueError, OverflowError) as e:
        return False, f"prediction failed: {type(e).__name__}: {e}"
    if re.search(r"\border\s+by\b", reference, re.IGNORECASE):
        ok = pred == gold
    else:
        ok = collections.Counter(pred) == collections.Counter(gold)
    return ok, "match" if ok else "different result"
