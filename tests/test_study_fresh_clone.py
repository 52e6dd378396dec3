"""Every study's documented Run command on a fresh clone (issue 48, item 5): no runs/, no kept weights. A finished
plan has nothing to do and needs no start; a stopped or frozen plan says so; neither fails for a start that is not
there, and neither trains anything. `starts.py restore` without the weights is an optimisation missed, not an error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLANS = ROOT / "benchmarks" / "plans"
IN_PROGRESS = {"block-scaleup", "pumba-window-trend"}  # issue 48's re-runs: their missing cells are real work
PUMBA = {"block-long-matched", "block-long", "mdm-tinymath", "pumba-ablations", "pumba-bridges-kept", "pumba-bridges",
         "pumba-reinforce", "pumba-table2-w8", "pumba-table2", "speed-easy"}
TESS2 = {"tess2-ablations", "tess2-adapt-steps", "tess2-adapt", "tess2-medium"}
OTHER = {"pumba-dmask-v2": "mask_discrepancy_study", "pumba-dmask": "mask_discrepancy_study",
         "pumba-overfit": "local_overfitting_study"}


def test_every_plan_is_listed_here():
    assert {p.stem for p in PLANS.glob("*.yaml")} == PUMBA | TESS2 | set(OTHER) | IN_PROGRESS | {
        "tess2-shakespeare-3seed"}


@pytest.mark.parametrize("name", sorted(PUMBA | TESS2 | set(OTHER)))
def test_finished_or_stopped_plans_run_as_documented_on_a_fresh_clone(name, tmp_path, monkeypatch, capsys):
    import importlib

    table = tmp_path / "t.json"
    shutil.copy(ROOT / "docs" / "results" / f"{name}.json", table)
    before = table.read_text()
    monkeypatch.chdir(tmp_path)  # runs/ and every relative start path are absent here
    plan = PLANS / f"{name}.yaml"
    if name in PUMBA:
        import pumba_study

        out = pumba_study.run(plan, table, tmp_path / "runs", max_minutes=30)
        assert out["cells"] == 0
        said = capsys.readouterr().out
        assert "nothing to run" in said or " is STOPPED (" in said or " is FROZEN (" in said
    elif name in TESS2:
        import tess2_tinymath

        tess2_tinymath.main(["study", "--plan", str(plan), "--json", str(table), "--max-minutes", "30"])
        assert "0 cells added; 0 planned cells missing" in capsys.readouterr().out
    else:
        assert importlib.import_module(OTHER[name]).run(plan, table, tmp_path / "runs", max_minutes=30) == 0
    assert not (tmp_path / "runs").exists() and table.read_text() == before  # nothing trained, nothing written


def test_restore_without_the_weights_is_not_an_error(tmp_path):
    from studies.starts import restore

    store = tmp_path / "store"
    (store / "x" / "model").mkdir(parents=True)
    (store / "starts.json").write_text(json.dumps({"x": {"path": "runs/x", "fingerprint": "0" * 16}}))
    absent: list = []
    assert restore(store, tmp_path, absent=absent) == [] and absent == ["x"]
    from dlm.errors import DlmError

    with pytest.raises(DlmError, match="no weights here"):  # the library call without `absent` still says why
        restore(store, tmp_path)
