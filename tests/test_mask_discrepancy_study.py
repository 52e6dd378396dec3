"""benchmarks/mask_discrepancy_study.py (issue 17): the pre-registered D_mask study on tiny models end to end: cells
keep every problem's D_mask(t), a rerun trains and measures nothing again, and the report pairs arms by problem with
the docs/results verdict rule in the claimed direction."""

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from studies.plans import Plan, StudyError
from studies.tables import StudyTable
from tests.conftest import tiny_mdm_warm_start

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]


def _plan(tmp_path, warm, data, **extra) -> Path:
    small = ["data.level=easy", "data.n_train=64", "data.n_validation=4", "data.n_test=6", "model.max_length=160",
             "model.label_shift=false", "train.batch_size=4", "train.checkpoint_every=1", "train.log_every=1",
             "eval.n=2", "eval.test_n=2", "eval.max_new_tokens=16", "eval.batch_size=4"]
    plan = {"name": "dmask-smoke", "arms": ["mdm", "pu"], "seeds": [0, 1], "evals": ["u=2"],
            "settings": {"data": str(data), "split": "validation.jsonl", "n": 3, "n_train_masks": 4, "pu_pools": 1,
                         "starts": {"warm_start": {"path": str(warm), "commands": ["(test fixture)"]}},
                         "overrides": small,
                         "arm_specs": {"mdm": {"recipe": "recipes/tinymath/mdm.yaml", "init": "warm_start",
                                               "updates": 2},
                                       "pu": {"recipe": "recipes/tinymath/pu.yaml", "init": "warm_start",
                                              "updates": 2}},
                         "comparisons": [{"a": "pu", "b": "mdm", "eval": "u=2", "expect": "lower",
                                          "claim": "smoke"}], **extra}}
    path = tmp_path / "dmask.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


def test_mask_discrepancy_study_runs_resumes_and_reports(tmp_path, monkeypatch):
    import mask_discrepancy_study as study
    from dlm.training import loop

    warm, data = tiny_mdm_warm_start(tmp_path)
    plan, table_path, runs = _plan(tmp_path, warm, data), tmp_path / "dmask.json", tmp_path / "runs"
    assert study.run(plan, table_path, runs, seeds=[0]) == 2
    assert study.run(plan, table_path, runs) == 2  # seed 1 only
    table = StudyTable(table_path, Plan.load(plan))
    assert list(table.missing()) == [] and table.pins["warm_start"]
    for arm in ("mdm", "pu"):
        for seed in (0, 1):
            c = table.cell(arm, seed, "u=2")
            assert c["training"] == arm and c["n"] == 3 and all(len(v) == 9 for v in c["values"])
            for i, t in enumerate(study.GRID):  # the stored means are the per-problem values' means
                vals = [v[i] for v in c["values"] if v[i] is not None]
                if vals:
                    assert c["d_mask"][str(t)] == pytest.approx(np.mean(vals))
    assert table.cell("pu", 0, "u=2")["construction_step"] == 2
    assert table.cell("mdm", 0, "u=2")["values"] != table.cell("mdm", 1, "u=2")["values"]  # another seed's masks
    monkeypatch.setattr(loop, "train", lambda *a, **k: pytest.fail("a trained arm was trained again"))
    assert study.run(plan, table_path, runs) == 0

    doc = tmp_path / "doc.md"
    doc.write_text("# smoke\n\nby hand\n<!-- study:begin -->\nold\n<!-- study:end -->\n\n## Reading\nkept\n")
    study.main(["report", "--plan", str(plan), "--json", str(table_path), "--doc", str(doc)])
    text = doc.read_text()
    assert "old" not in text and "## Reading\nkept" in text and (tmp_path / "doc.png").stat().st_size > 0
    r = study.compare(table, {"a": "pu", "b": "mdm", "eval": "u=2", "expect": "lower"})
    assert r["n_seeds"] == 2 and f"{r['difference']:+.3f}, 95 % CI [{r['low']:+.3f}" in text
    assert f"→ **{r['verdict']}**" in text and r["verdict"] in ("partly", "not")  # 2 seeds: never reproduced
    # the pairing: each problem's mean over the ratios both arms have, then averaged over seeds
    from studies import measures as measure_study

    a, b = measure_study._paired(table, "pu", "mdm", "u=2", [0, 1])
    assert r["difference"] == pytest.approx(float(np.nanmean(np.nanmean(a - b, axis=0))))


def test_verdict_follows_the_claimed_direction():
    import mask_discrepancy_study as study

    base = {"n_seeds": 3, "same_sign": True}
    assert study.verdict({**base, "difference": -0.1, "low": -0.15, "high": -0.05}, "lower") == "reproduced"
    assert study.verdict({**base, "difference": -0.1, "low": -0.15, "high": 0.01}, "lower") == "partly"
    assert study.verdict({**base, "difference": -0.1, "low": -0.15, "high": -0.05, "same_sign": False},
                         "lower") == "partly"
    assert study.verdict({**base, "difference": 0.1, "low": 0.05, "high": 0.15}, "lower") == "not"
    assert study.verdict({**base, "difference": 0.1, "low": 0.05, "high": 0.15}, "higher") == "reproduced"
    assert study.verdict({**base, "n_seeds": 2, "difference": -0.1, "low": -0.15, "high": -0.05},
                         "lower") == "partly"


def test_plan_errors_name_the_field(tmp_path):
    import mask_discrepancy_study as study

    path = _plan(tmp_path, tmp_path, tmp_path)
    plan = yaml.safe_load(path.read_text())
    plan["settings"]["comparisons"][0]["expect"] = "above"
    path.write_text(yaml.safe_dump(plan))
    with pytest.raises(StudyError, match="expect is lower"):
        study.check_plan(Plan.load(path))
    plan["settings"]["comparisons"][0]["expect"] = "lower"
    plan["evals"] = ["tau=0.9"]
    plan["settings"]["comparisons"] = []
    path.write_text(yaml.safe_dump(plan))
    with pytest.raises(StudyError, match="u=N"):
        study.check_plan(Plan.load(path))
    for name in ("pumba-dmask", "pumba-dmask-v2"):  # the committed plans: v2 differs in the measurement's size only
        committed = Plan.load(ROOT / "benchmarks" / "plans" / f"{name}.yaml")
        study.check_plan(committed)
        assert json.loads(json.dumps(committed.settings["comparisons"]))[0]["expect"] == "lower"
    plans = ROOT / "benchmarks" / "plans"
    v1, v2 = (Plan.load(plans / f"{n}.yaml").settings for n in ("pumba-dmask", "pumba-dmask-v2"))
    size = {"n", "n_train_masks", "pu_pools", "pu_steps"}
    assert {k: v for k, v in v1.items() if k not in size} == {k: v for k, v in v2.items() if k not in size}
