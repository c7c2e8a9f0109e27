"""Spider text-to-SQL, scored by execution match against the real SQLite databases.

The hub dataset (``xlangai/spider``) has the questions and gold queries but not the databases:
point ``--spider-db-dir`` (or ``SPIDER_DB_DIR``) at the ``database/`` folder of the Spider release
(``<db_id>/<db_id>.sqlite``). The prompt carries the database's ``CREATE TABLE`` statements. Both
the predicted and the gold query run read-only (an SQLite authorizer allows reads only, and a
progress handler enforces a deadline); results match as multisets, or in order when the gold
query has ORDER BY.
"""
from __future__ import annotations

import os
import sqlite3

from ..scoring import extract_sql, run_sql, sql_execution_match
from .base import EvalContext, Prepared, Task, TaskError
from .code import FENCE_CLOSED

RAW_STOP = [";", "\n\n", "\n--"]


def database_path(root: str, db_id: str) -> str | None:
    for base in (root, os.path.join(root, "database")):
        p = os.path.join(base, db_id, f"{db_id}.sqlite")
        if os.path.isfile(p):
            return p
    return None


def schema_sql(db_path: str) -> str:
    rows = run_sql(db_path, "SELECT sql FROM sqlite_master WHERE type = 'table' AND sql IS NOT NULL "
                            "AND name NOT LIKE 'sqlite_%' ORDER BY rowid")
    return ";\n".join(r[0].strip() for r in rows) + ";"


class Spider(Task):
    name, family = "spider", "SQL"
    metric = "execution_accuracy"
    source = "hub: xlangai/spider (validation) + the Spider release's SQLite databases"
    description = "Spider text-to-SQL, execution match on the real SQLite databases"
    max_new_tokens = {"raw": 128, "chat": 192}

    def prepare(self, ctx: EvalContext) -> Prepared:
        root = ctx.spider_db_dir or os.environ.get("SPIDER_DB_DIR")
        if not root or not os.path.isdir(root):
            raise TaskError("spider: needs the Spider databases (the release's database/ folder with "
                            "<db_id>/<db_id>.sqlite): --spider-db-dir DIR or SPIDER_DB_DIR"
                            + (f" ({root!r} is not a folder)" if root else ""))
        recs = ctx.hub_records(self.name, "xlangai/spider", None, "validation")
        items, schemas = [], {}
        for i, r in enumerate(recs):
            try:
                db_id, question, gold = r["db_id"], r["question"], r["query"]
            except KeyError as e:
                raise TaskError(f"spider: record {i} has no {e} field (xlangai/spider format)") from None
            path = database_path(root, db_id)
            if path is None:
                raise TaskError(f"spider: database {db_id!r} not found under {root} "
                                f"(expected {db_id}/{db_id}.sqlite)")
            if path not in schemas:
                schemas[path] = schema_sql(path)
            items.append({"db": path, "db_id": db_id, "question": question, "query": gold,
                          "schema": schemas[path]})
        return Prepared(items)

    def evaluate(self, ctx: EvalContext, data: Prepared) -> dict:
        mode = ctx.mode()
        settings = ctx.sampling(self.max_new_tokens[mode])
        if mode == "chat":
            prompts = [ctx.chat_prompt(f"Given this SQLite database schema:\n```sql\n{r['schema']}\n```\n"
                                       f"Write one SQLite query that answers: {r['question']}\n"
                                       "Answer with the query in one ```sql code block.")
                       for r in data.records]
            gens = ctx.generate(prompts, settings, stop_regex=FENCE_CLOSED, chat=True, desc="spider generate")
            preds = [extract_sql(g.text) for g in gens]
        else:
            prompts = [f"-- SQLite database schema:\n{r['schema']}\n\n-- Question: {r['question']}\n"
                       f"-- A SQLite query that answers the question:\nSELECT" for r in data.records]
            gens = ctx.generate(prompts, settings, stop=RAW_STOP, desc="spider generate")
            preds = [extract_sql("SELECT" + g.text) for g in gens]
        correct, gold_errors, reasons = [], 0, []
        for r, p in zip(data.records, preds):
            try:
                ok, why = sql_execution_match(p, r["query"], r["db"])
            except sqlite3.Error as e:  # the gold query itself fails here: not the model's fault
                gold_errors += 1
                reasons.append(f"gold failed: {e}")
                continue
            correct.append(ok)
            reasons.append(why)
        out = {"execution_accuracy": sum(correct) / max(1, len(correct)), "n": len(correct),
               "gold_errors": gold_errors, "prompt_mode": mode, "generation": settings.to_dict()}
        if ctx.save_generations:
            out["generations"] = [{"question": r["question"], "prediction": p, "result": w}
                                  for r, p, w in zip(data.records, preds, reasons)]
        return out
