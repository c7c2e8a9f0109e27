"""launch/bench_dp.py keeps the rows it did not re-measure only from a dp.json of the same protocol."""
import json
import os
import sys

from launch_helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "launch"))
import bench_dp  # noqa: E402

PROTOCOL = {"steps": 40, "model": "smollm2-135m", "data": "sympy", "micro_batch_size": 1, "grad_accum": 2,
            "eval_sequences": 512}


def test_rows_not_measured_are_kept_only_under_the_same_protocol(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_dp, "OUT", str(tmp_path))
    old = {"protocol": PROTOCOL, "command": "python launch/bench_dp.py",
           "entries": [{"backend": b, "loss": 2.0} for b in ("allreduce", "diloco", "powersgd+streaming_diloco")]}
    (tmp_path / "dp.json").write_text(json.dumps(old))
    new = [{"backend": "diloco", "loss": 3.0}, {"backend": "powersgd+streaming_avg", "loss": 2.5}]
    rows = bench_dp._merge_with_kept_rows([dict(e) for e in new], PROTOCOL)
    # in the order of the benchmark's table; the new diloco row replaces the old one
    assert [(e["backend"], e["loss"]) for e in rows] == [
        ("allreduce", 2.0), ("diloco", 3.0), ("powersgd+streaming_diloco", 2.0), ("powersgd+streaming_avg", 2.5)]
    assert rows[0]["measured_by"] == "python launch/bench_dp.py" and "measured_by" not in rows[1]
    # another step count (or corpus, batch, held-out set): nothing is kept
    other = dict(PROTOCOL, steps=80)
    assert [e["backend"] for e in bench_dp._merge_with_kept_rows([dict(e) for e in new], other)] == \
        ["diloco", "powersgd+streaming_avg"]
