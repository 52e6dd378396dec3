"""benchmarks/sweep_report.py: a `dlm eval --sweep --out` table written into a doc's named markers, the rest of the doc
kept; a file that is not such a table is one line naming it."""

import json
from pathlib import Path

import pytest

import sweep_report
from dlm.evaluation.sweeps import paired_rows

ROOT = Path(__file__).resolve().parents[1]


def test_sweep_table_and_paired_rows_land_between_the_markers(tmp_path):
    a2, a4 = [True] * 6 + [False] * 4, [True] * 3 + [False] * 7
    b2, b4 = [True] * 9 + [False], [True] * 3 + [False] * 7
    rows = [{"model": "runs/x/mdm", "family": "masked", "reveal_count": u, "accuracy": sum(o) / 10, "mean_nfe": nfe}
            for u, o, nfe in ((2, a2, 26.0), (4, a4, 13.0))]
    rows += [{"model": "runs/x/w2", "family": "masked", "reveal_count": u, "accuracy": sum(o) / 10, "mean_nfe": nfe}
             for u, o, nfe in ((2, b2, 26.5), (4, b4, 13.1))]
    result = {"task": "tinymath", "n": 10, "sweep": "u=2,4", "dtype": "float32", "rows": rows,
              "paired": paired_rows(rows, [a2, a4, b2, b4], "reveal_count")}
    table = tmp_path / "sweep.json"
    table.write_text(json.dumps(result))
    doc = tmp_path / "doc.md"
    doc.write_text("# d\n\nreading by hand\n<!-- study:begin topu -->\nold\n<!-- study:end topu -->\ntail\n")
    sweep_report.main([str(table), "--doc", str(doc), "--name", "topu"])
    text = doc.read_text()
    assert text.startswith("# d\n\nreading by hand\n") and text.endswith("<!-- study:end topu -->\ntail\n")
    assert "old" not in text and "| model | u=2 | u=4 |" in text
    assert "| mdm | 60.0 % (26.0) | 30.0 % (13.0) |" in text and "| w2 | 90.0 % (26.5) | 30.0 % (13.1) |" in text
    assert "| w2 | u=2 | +30.0 | [" in text and "| 3 / 0 |" in text
    assert "| w2 | u=4 | +0.0 | [+0.0, +0.0] | 1.0 | 0 / 0 |" in text


def test_an_ar_model_beside_a_sweep_gets_its_own_column_and_same_names_keep_their_paths(tmp_path):
    rows = [{"model": f"runs/{m}/model", "family": "masked", "reveal_count": u, "accuracy": 0.5, "mean_nfe": 4.0}
            for m in ("a", "b") for u in (2, 4)]
    rows.append({"model": "runs/ar/model", "family": "autoregressive", "accuracy": 0.75, "mean_nfe": 20.0})
    table = tmp_path / "sweep.json"
    table.write_text(json.dumps({"task": "tinymath", "n": 4, "sweep": "u=2,4", "rows": rows}))
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- study:begin s -->\n<!-- study:end s -->\n")
    sweep_report.main([str(table), "--doc", str(doc), "--name", "s"])
    text = doc.read_text()
    assert "| model | u=2 | u=4 | other models |" in text
    assert "| runs/ar/model | — | — | 75.0 % (20.0) |" in text
    assert "| runs/a/model | 50.0 % (4.0) | 50.0 % (4.0) | — |" in text


@pytest.mark.parametrize("content", [{"cells": []}, {"rows": []}, {"rows": [{"model": "m"}], "n": 1, "task": "t"}])
def test_a_file_that_is_not_a_sweep_table_is_one_line(tmp_path, content):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(content))
    with pytest.raises(SystemExit, match=r"bad.json: no 'rows'|bad.json: not a `dlm eval --out` table"):
        sweep_report.main([str(bad), "--doc", str(tmp_path / "d.md"), "--name", "x"])


def test_outcomes_from_a_samples_file_fill_each_row_or_are_refused(tmp_path):
    """--outcomes-from: each row gains the per-problem outcomes of its model and settings from the run's samples
    file, in order, and the JSON is rewritten; samples that do not add up to a row's n and accuracy are refused."""
    a, b = [1, 0, 1, 1], [0, 0, 1, 0]
    rows = [{"model": "m", "family": "masked", "reveal_count": u, "accuracy": sum(o) / 4, "n": 4, "mean_nfe": 2.0}
            for u, o in ((1, a), (16, b))]
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"task": "tinymath", "n": 4, "sweep": "u=1,16", "rows": rows, "paired": []}))
    samples = tmp_path / "s.jsonl"
    samples.write_text("".join(json.dumps({"model": "m", "family": "masked", "reveal_count": u, "prompt": str(i),
                                           "correct": bool(x)}) + "\n" for u, o in ((1, a), (16, b))
                               for i, x in enumerate(o)))
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- study:begin x -->\n<!-- study:end x -->\n")
    sweep_report.main([str(table), "--doc", str(doc), "--name", "x", "--outcomes-from", str(samples)])
    assert [r["correct"] for r in json.loads(table.read_text())["rows"]] == [a, b]
    rows[1]["accuracy"] = 0.5  # not this run's samples
    table.write_text(json.dumps({"task": "tinymath", "n": 4, "sweep": "u=1,16", "rows": rows, "paired": []}))
    with pytest.raises(SystemExit, match="not the samples of this run"):
        sweep_report.main([str(table), "--doc", str(doc), "--name", "x", "--outcomes-from", str(samples)])
