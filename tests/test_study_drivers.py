"""The pre-registered study drivers (issue 17): benchmarks/pumba_study.py end to end on a tiny model, the committed
plans resolve to runnable recipes, W=1 with its carry zeroed is exactly a carry-less model, and the report generator
turns a table into a results section."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from studies.plans import Plan, StudyError
from studies.sections import STUDY_BEGIN, STUDY_END
from studies.tables import StudyTable
from tests.conftest import perturb, tiny_mdm_warm_start, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]
PLANS = [ROOT / "benchmarks" / "plans" / f"{name}.yaml"  # the plans this driver runs
         for name in ("pumba-table2", "block-long", "pumba-bridges", "pumba-ablations", "pumba-reinforce",
                      "pumba-table2-w8", "pumba-bridges-kept", "mdm-tinymath", "block-long-matched", "block-scaleup",
                      "pumba-window-trend")]


@pytest.mark.parametrize("path", PLANS, ids=[p.stem for p in PLANS])
def test_committed_plans_resolve_to_runnable_recipes(path, tmp_path):
    import pumba_study

    plan = Plan.load(path)
    pumba_study.check_plan(plan)
    assert plan.seeds[:3] == (0, 1, 2) and plan.settings["comparisons"]
    for arm in plan.arms:
        spec = plan.settings["arm_specs"][arm]
        if "recipe" in spec:
            recipe = pumba_study.recipe_for(plan, arm, 0, tmp_path / arm)
            assert recipe.train.steps == spec["updates"] and recipe.train.seed == 0
            assert recipe.model.init_from == str(pumba_study.start_path(plan, spec["init"], 0))


def test_table2_controls_match_the_windows_denoiser_passes(tmp_path):
    import pumba_study

    plan = Plan.load(ROOT / "benchmarks" / "plans" / "pumba-table2.yaml")
    passes = {}
    for arm in plan.arms:
        spec = plan.settings["arm_specs"][arm]
        if "recipe" in spec:
            r = pumba_study.recipe_for(plan, arm, 1, tmp_path / arm)
            passes[arm] = r.train.steps * pumba_study.passes_per_update(r)
    assert passes["mdm2"] == passes["w2"] and passes["mdm4"] == passes["w4"] and passes["mdm8"] == passes["w8"]
    assert passes["mdm"] == passes["pu"] == passes["w1"] == passes["ar"] == 200


def test_block_matched_control_has_the_w2_arms_passes_and_takes_block_longs_arms_over(tmp_path):
    """block-long-matched: mdm2 runs as many denoiser passes as block PUMBA W=2, and its other arms are block-long's
    very training runs (the same neutral recipe), so --reuse of block-long's table can take their cells over."""
    import pumba_study

    plans = ROOT / "benchmarks" / "plans"
    plan, long = Plan.load(plans / "block-long-matched.yaml"), Plan.load(plans / "block-long.yaml")
    passes = {}
    for arm in plan.arms:
        r = pumba_study.recipe_for(plan, arm, 2, tmp_path / arm)
        passes[arm] = r.train.steps * pumba_study.passes_per_update(r)
    assert passes["mdm2"] == passes["u16w2"] == passes["u8w2"] == 2 * passes["mdm"] == 2700
    for arm in ("mdm", "u8w2", "u16w2"):
        assert pumba_study.neutral_recipe(plan, arm) == pumba_study.neutral_recipe(long, arm)
        assert plan.settings["arm_specs"][arm] == long.settings["arm_specs"][arm]


def test_reinforce_plan_shares_its_reference_arms_with_pumba_bridges(tmp_path):
    """pumba-reinforce's w2 and nobridge resolve to pumba-bridges' recipes (only the run name differs), and its
    REINFORCE arms are that plan's W=2 recipe with the sampled estimator: what its doc says of them holds."""
    import pumba_study
    from dlm.config import dump_recipe

    new, old = (Plan.load(ROOT / "benchmarks" / "plans" / f"{n}.yaml") for n in ("pumba-reinforce", "pumba-bridges"))

    def resolved(plan, arm):
        recipe = pumba_study.recipe_for(plan, arm, 2, tmp_path / "RUN")
        return dump_recipe(recipe.model_copy(update={"name": "-"}))

    for arm in ("w2", "nobridge"):
        assert resolved(new, arm) == resolved(old, arm)
    for arm, weight in (("reinforce-sampled", 1.0), ("reinforce-sampled-w0.1", 0.1)):
        r = pumba_study.recipe_for(new, arm, 0, tmp_path / arm)
        assert (r.progressive.bridge, r.progressive.reinforce_weight, r.progressive.carry, r.progressive.window) == (
            "reinforce_sampled", weight, False, 2)


def test_bridges_kept_plan_reruns_pumba_bridges_arms(tmp_path):
    """pumba-bridges-kept measures pumba-bridges' arms unchanged (only the run name differs), so its cells answer
    the same Table 1 comparisons on the kept warm start; its w2 and nobridge are pumba-reinforce's training runs, so
    --reuse of that table can take them over."""
    import pumba_study
    from dlm.config import dump_recipe

    kept, old, reinforce = (Plan.load(ROOT / "benchmarks" / "plans" / f"{n}.yaml")
                            for n in ("pumba-bridges-kept", "pumba-bridges", "pumba-reinforce"))

    def resolved(plan, arm):
        return dump_recipe(pumba_study.recipe_for(plan, arm, 1, tmp_path / "RUN").model_copy(update={"name": "-"}))

    assert set(kept.arms) < set(old.arms)
    for arm in kept.arms:
        assert resolved(kept, arm) == resolved(old, arm)
    for arm in ("w2", "nobridge"):
        assert pumba_study.neutral_recipe(kept, arm) == pumba_study.neutral_recipe(reinforce, arm)
    assert kept.settings["starts"]["warm_start"]["path"] == reinforce.settings["starts"]["warm_start"]["path"]
    bridges = {arm: pumba_study.recipe_for(kept, arm, 0, tmp_path / arm).progressive for arm in ("gumbel", "st")}
    assert (bridges["gumbel"].bridge, bridges["gumbel"].carry) == ("gumbel", False)
    assert (bridges["st"].bridge, bridges["st"].carry) == ("straight_through", False)


def test_zeroed_carry_is_a_carry_less_model():
    """w1-zero-carry: zeroing the carry LayerNorm makes the carry input exactly 0 (Eq. 3.1), whatever the carry."""
    from dlm.modeling.carry import CARRY_MODULE, zero_carry_

    with_carry = perturb(tiny_model(40, attention="bidirectional", family="masked", carry=True, mask_token_id=39))
    norm = getattr(with_carry.backbone, CARRY_MODULE)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    plain = tiny_model(40, attention="bidirectional", family="masked", mask_token_id=39)
    state = {k: v for k, v in with_carry.state_dict().items() if CARRY_MODULE not in k}
    plain.load_state_dict(state)
    ids = torch.randint(0, 39, (2, 12), generator=torch.Generator().manual_seed(0))
    ids[:, 6:] = 39
    carry = torch.randn(2, 12, with_carry.config.hidden_size, generator=torch.Generator().manual_seed(1)) * 3
    with torch.no_grad():
        reference = plain(ids)
        assert (with_carry(ids, carry=carry) - reference).abs().max() > 1e-2  # the carry matters before
        zero_carry_(with_carry)
        torch.testing.assert_close(with_carry(ids, carry=carry), reference, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="no carry layer"):
        zero_carry_(plain)


def _smoke_plan(tmp_path, warm, data, w1_updates=2):
    small = ["data.level=easy", "data.n_train=64", "data.n_validation=4", "data.n_test=6", "model.max_length=160",
             "model.label_shift=false", "train.batch_size=4",
             "train.checkpoint_every=1", "train.log_every=1", "eval.n=2", "eval.test_n=2", "eval.max_new_tokens=16",
             "eval.batch_size=4"]
    plan = {"name": "smoke", "arms": ["mdm", "w1"], "seeds": [0], "evals": ["u=4", "u=4/unseen"],
            "settings": {"data": str(data), "n": 3, "max_new_tokens": 16, "eval_batch_size": 4,
                         "starts": {"warm_start": {"path": str(warm), "commands": ["(test fixture)"]}},
                         "overrides": small,
                         "arm_specs": {"mdm": {"recipe": "recipes/tinymath/mdm.yaml", "init": "warm_start",
                                               "updates": 2},
                                       "w1": {"recipe": "recipes/tinymath/pumba-w1.yaml", "init": "warm_start",
                                              "updates": w1_updates}},
                         "comparisons": [{"a": "w1", "b": "mdm", "eval": "u=4", "claim": "smoke"}]}}
    path = tmp_path / f"smoke-{w1_updates}.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


def test_pumba_study_smoke_run_resumes_and_refuses_a_changed_plan(tmp_path, monkeypatch, capsys):
    import pumba_study
    from dlm.training import loop

    warm, data = tiny_mdm_warm_start(tmp_path)
    plan, table_path, runs = _smoke_plan(tmp_path, warm, data), tmp_path / "smoke.json", tmp_path / "runs"
    (data / "test_unseen.jsonl").unlink(missing_ok=True)  # the unseen split arrives later in this test

    assert pumba_study.run(plan, table_path, runs, max_minutes=0) == {"cells": 0, "stopped": True, "waiting": []}
    assert not (runs / "seed0" / "mdm").exists()  # out of time before the first training: nothing started
    # A training cut by the budget stops with a checkpoint and no record; the next call resumes it to the end.
    assert pumba_study.trained_model(Plan.load(plan), "mdm", 0, runs, minutes=1e-6) is None
    assert (runs / "seed0" / "mdm" / "checkpoints" / "latest").is_file()
    assert not (runs / "seed0" / "mdm" / "study_train.json").exists()
    _, record = pumba_study.trained_model(Plan.load(plan), "mdm", 0, runs)
    assert record["resumed"] and record["updates"] == 2
    first = pumba_study.run(plan, table_path, runs, max_minutes=0.0, arms=["mdm"], evals=["u=4"])
    assert first == {"cells": 1, "stopped": True, "waiting": []}  # trained already: its cell, then the budget
    cell = json.loads(table_path.read_text())["cells"][0]
    assert (cell["arm"], cell["seed"], cell["eval"], cell["n"]) == ("mdm", 0, "u=4", 3)
    assert len(cell["correct"]) == 3 and cell["updates"] == 2 and cell["passes"] == 2 and cell["train_seconds"] > 0

    second = pumba_study.run(plan, table_path, runs)
    assert second["cells"] == 1 and second["waiting"] == ["u=4/unseen"]  # w1 u=4; the split is not there yet
    assert "u=4/unseen: waiting for" in capsys.readouterr().out
    shutil.copy(data / "test.jsonl", data / "test_unseen.jsonl")
    monkeypatch.setattr(loop, "train", lambda *a, **k: pytest.fail("a trained arm was trained again"))
    assert pumba_study.run(plan, table_path, runs, evals=["u=4"])["cells"] == 0  # --evals limits: no unseen cell
    third = pumba_study.run(plan, table_path, runs, arms=["w1"], evals=["u=4/unseen"])  # mdm's unseen cell is left
    assert third == {"cells": 1, "stopped": False, "waiting": []}
    assert not StudyTable(table_path, Plan.load(plan)).has("mdm", 0, "u=4/unseen")
    assert pumba_study.run(plan, table_path, runs) == {"cells": 1, "stopped": False, "waiting": []}
    table = StudyTable(table_path, Plan.load(plan))
    assert table.cell("mdm", 0, "u=4") == cell and list(table.missing()) == []
    assert table.pins["warm_start"] and table.cell("w1", 0, "u=4")["model"] != cell["model"]
    assert table.cell("w1", 0, "u=4/unseen")["problems"] == cell["problems"]  # the same problems (a copy)
    assert pumba_study.run(plan, table_path, runs)["cells"] == 0  # nothing redone

    # --reuse: another plan whose arms are the same training runs takes the cells over (train is still patched to
    # fail); an arm with another recipe, or a table pinned to another start, is given nothing
    other = yaml.safe_load(plan.read_text())
    other["name"] = "smoke-b"
    other["settings"]["arm_specs"]["mdm-lr"] = {**other["settings"]["arm_specs"]["mdm"], "set": ["optim.lr=1.0e-4"]}
    other["arms"] = ["mdm", "w1", "mdm-lr"]
    other_path = tmp_path / "smoke-b.yaml"
    other_path.write_text(yaml.safe_dump(other))
    reused = pumba_study.run(other_path, tmp_path / "smoke-b.json", runs, arms=["mdm", "w1"], reuse=[table_path])
    assert reused["cells"] == 4
    b = StudyTable(tmp_path / "smoke-b.json", Plan.load(other_path))
    for arm, key in [("mdm", "u=4"), ("w1", "u=4"), ("w1", "u=4/unseen")]:
        mine, theirs = b.cell(arm, 0, key), table.cell(arm, 0, key)
        assert mine["correct"] == theirs["correct"] and mine["model"] == theirs["model"]
        assert mine["copied_from"] == {"table": "smoke", "arm": arm, "seed": 0, "eval": key}
        assert mine["recipe"] != theirs["recipe"]  # each table keeps its own digest (the run names differ)
    # --take-only: an arm another plan trains is only ever taken over; no donor cell yet means no cell, not a training
    # (the donor table without mdm's unseen cell stands for one that has not reached it yet)
    partial = json.loads(table_path.read_text())
    partial["cells"] = [c for c in partial["cells"] if (c["arm"], c["eval"]) != ("mdm", "u=4/unseen")]
    (tmp_path / "partial.json").write_text(json.dumps(partial))
    took = pumba_study.run(other_path, tmp_path / "smoke-c.json", runs, arms=["mdm"], reuse=[tmp_path / "partial.json"],
                           take_only=["mdm"])
    assert took["cells"] == 1 and not StudyTable(tmp_path / "smoke-c.json", Plan.load(other_path)).has(
        "mdm", 0, "u=4/unseen")
    assert "mdm            u=4/unseen     left missing: no --reuse table has it yet" in capsys.readouterr().out
    with pytest.raises(StudyError, match=r"--take-only \['nope'\] not in the plan's arms"):
        pumba_study.run(other_path, tmp_path / "smoke-d.json", runs, reuse=[table_path], take_only=["nope"])
    assert not (tmp_path / "smoke-d.json").exists()  # refused before the table was written
    with pytest.raises(StudyError, match=r"--take-only \['mdm-lr'\]: no --reuse table has an arm that is the same"):
        pumba_study.run(other_path, tmp_path / "smoke-c.json", runs, reuse=[table_path], take_only=["mdm-lr"])
    donors = pumba_study.Donors(Plan.load(other_path), b, [table_path])
    assert donors.cell("mdm", 0, "u=4", cell["problems"]) is not None
    assert donors.cell("mdm-lr", 0, "u=4", cell["problems"]) is None  # another learning rate: another run
    assert donors.cell("mdm", 0, "u=4", "another-digest") is None  # other problems
    b.pins["warm_start"] = "0" * 16
    assert pumba_study.Donors(Plan.load(other_path), b, [table_path]).cell("mdm", 0, "u=4", cell["problems"]) is None
    b.pins["warm_start/seed0"] = table.pins["warm_start"]  # a seed restarted on the donor's start: its cells match
    assert pumba_study.Donors(Plan.load(other_path), b, [table_path]).cell("mdm", 0, "u=4", cell["problems"])
    with pytest.raises(StudyError, match="not this plan's own"):
        pumba_study.Donors(Plan.load(plan), table, [table_path])

    data_json = json.loads(table_path.read_text())  # drop one cell, then change the split under it
    data_json["cells"] = [c for c in data_json["cells"] if (c["arm"], c["eval"]) != ("w1", "u=4/unseen")]
    table_path.write_text(json.dumps(data_json))
    lines = (data / "test_unseen.jsonl").read_text().splitlines(keepends=True)
    (data / "test_unseen.jsonl").write_text("".join(lines[::-1]))
    with pytest.raises(StudyError, match="problems changed since the u=4/unseen cells"):
        pumba_study.run(plan, table_path, runs)
    with pytest.raises(StudyError, match="another plan"):  # w1 given more updates: a new plan, refused
        pumba_study.run(_smoke_plan(tmp_path, warm, data, w1_updates=3), table_path, runs)
    with pytest.raises(StudyError, match="trained for 2 updates, the plan gives w1 3"):  # nor its trained runs
        pumba_study.run(_smoke_plan(tmp_path, warm, data, w1_updates=3), tmp_path / "new.json", runs)
    with pytest.raises(StudyError, match="only orders or limits"):
        pumba_study.run(plan, table_path, runs, seeds=[0, 5])
    with pytest.raises(StudyError, match="only orders or limits"):
        pumba_study.run(plan, table_path, runs, arms=["w1", "w9"])
    with pytest.raises(StudyError, match="only orders or limits"):
        pumba_study.run(plan, table_path, runs, evals=["u=4", "u=9"])


def test_pin_starts_refuses_rebuilt_starts_unless_the_seed_is_restarted(tmp_path, capsys):
    """A start rebuilt with other bits is refused for a seed that has cells from the old one, naming the way out;
    --restart-seeds retires that seed's cells (no other seed's) and runs it from the rebuilt start, once."""
    import pumba_study

    plan = Plan.load(_smoke_plan(tmp_path, tmp_path / "warm", tmp_path / "data"))
    t = StudyTable(tmp_path / "t.json", plan)
    pumba_study.pin_starts(t, {"warm_start": "old"}, [0])
    t.add("mdm", 0, "u=4", {"samples": [{"correct": 1}]}, problems="p")
    with pytest.raises(StudyError, match="seed 0's cells came from warm_start old .* --restart-seeds 0"):
        pumba_study.pin_starts(t, {"warm_start": "new"}, [0])
    pumba_study.pin_starts(t, {"warm_start": "new"}, [0], restart_seeds=[0])
    assert "seed 0 restarted" in capsys.readouterr().out and "warm_start old -> new" in t.retired[0]["retired"]
    assert not t.has("mdm", 0, "u=4") and t.pinned("warm_start", 0) == "new" and t.pins["warm_start"] == "old"
    t.add("mdm", 0, "u=4", {"samples": [{"correct": 0}]}, problems="p")
    pumba_study.pin_starts(t, {"warm_start": "new"}, [0], restart_seeds=[0])  # the same starts: nothing retired
    assert t.has("mdm", 0, "u=4") and len(t.retired) == 1


REPORT_PLAN = """name: synthetic
arms: [a, b, c]
seeds: [0, 1, 2]
evals: [u=2, u=8]
settings:
  comparisons:
    - {a: a, b: b, eval: u=2, claim: "a above b"}
    - {a: b, b: c, eval: u=2, claim: "b above c"}
    - {a: c, b: a, eval: u=2, claim: "c above a"}
    - {a: a, b: c, eval: u=8, claim: "a above c at u=8"}
    - {a: b, b: c, eval: u=2, expect: not_lower, margin: 2, claim: "b matches c"}
    - {a: c, b: a, eval: u=2, expect: not_lower, margin: 2, claim: "c matches a"}
"""


def test_study_report_writes_the_marked_section_from_a_synthetic_table(tmp_path):
    import statistics

    import numpy as np

    import study_report
    from studies.stats import compare_seeds, format_seed_comparison, seed_verdict

    plan_path = tmp_path / "synthetic.yaml"
    plan_path.write_text(REPORT_PLAN)
    plan = Plan.load(plan_path)
    table = StudyTable(tmp_path / "synthetic.json", plan)
    rng = np.random.default_rng(0)
    share = {"a": 0.8, "b": 0.5, "c": 0.5}
    outcomes = {}
    for seed in (0, 1, 2):
        for arm in ("a", "b", "c"):
            for key in ("u=2", "u=8"):
                if (arm, seed, key) == ("c", 2, "u=8"):
                    continue  # one missing cell
                correct = (rng.random(200) < share[arm]).tolist()
                outcomes[arm, seed, key] = correct
                table.add(arm, seed, key, {"mean_nfe": 34.0 if key == "u=2" else 9.0,
                                           "samples": [{"correct": x} for x in correct]},
                          problems="p", updates=200, passes=400 if arm == "a" else 200, train_seconds=10.0 + seed,
                          model="retrained" if (arm, seed, key) == ("b", 1, "u=8") else f"{arm}{seed}")
    doc = tmp_path / "doc.md"
    doc.write_text("# Hand-written title\n\nA reading that must stay.\n")
    out = str(doc)
    for _ in range(2):  # regenerating replaces the section, once
        study_report.main([str(plan_path), "--json", str(tmp_path / "synthetic.json"), "--out", out,
                           "--plot", str(tmp_path / "p.png")])
    text = doc.read_text()
    assert text.startswith("# Hand-written title\n\nA reading that must stay.\n")
    assert text.count(STUDY_BEGIN) == 1 and text.count(STUDY_END) == 1
    acc = [sum(outcomes["a", s, "u=2"]) / 200 for s in (0, 1, 2)]
    want = (f"{100 * statistics.mean(acc):.1f} ± {100 * statistics.stdev(acc):.1f} "
            f"[{', '.join(f'{100 * x:.1f}' for x in acc)}]")
    row = next(line for line in text.splitlines() if line.startswith("| a | 200 | 400 | 11 | 3/3 |"))
    assert want in row
    assert "| c | 200 | 200 | 11 | 2/3 |" in text  # seed 2 lacks u=8
    lines = {line.split(" | ")[1]: line for line in text.splitlines()  # same-direction claims, by "a vs b @ e"
             if line.startswith("| ") and " vs " in line and "matches" not in line}
    matches = {line.split(" | ")[0][2:]: line for line in text.splitlines() if " matches " in line}
    result = compare_seeds([outcomes["a", s, "u=2"] for s in (0, 1, 2)], [outcomes["b", s, "u=2"] for s in (0, 1, 2)])
    assert format_seed_comparison(result) in lines["a vs b @ u=2"] and "**reproduced**" in lines["a vs b @ u=2"]
    even = compare_seeds([outcomes["b", s, "u=2"] for s in (0, 1, 2)], [outcomes["c", s, "u=2"] for s in (0, 1, 2)])
    assert even["low"] < 0 < even["high"] and f"**{seed_verdict(even)}**" in lines["b vs c @ u=2"]
    assert "**not (CI excludes 0)**" in lines["c vs a @ u=2"]
    # 2 seeds: the CI over seeds (t with 1 degree of freedom) holds 0 and the 5-point effect of interest
    assert "**inconclusive (provisional: 2 of 3 seeds)**" in lines["a vs c @ u=8"]
    # "matches" comparisons read the margin: b and c are even (the CI's ends inside +-2 points or not decides
    # reproduced vs partly), c is ~30 points below a: not
    want = "reproduced" if even["low"] > -0.02 else "inconclusive" if even["high"] >= 0 else "partly"
    assert matches["b matches c"].endswith(f"**{want} (match within 2 points)** |")
    assert matches["c matches a"].endswith("**not (match within 2 points)** |")
    assert "Missing cells (1):\n- seed 2: c (u=8)" in text and "Seeds complete: 0, 1 of 0, 1, 2" in text
    assert "not bitwise equal): b seed 1." in text  # two weights behind one (arm, seed)
    assert (tmp_path / "p.png").stat().st_size > 10_000
    # a doc and plot in folders not made yet: made, and the links run from the doc's own folder
    study_report.main([str(plan_path), "--json", str(tmp_path / "synthetic.json"), "--out",
                       str(tmp_path / "new" / "doc.md"), "--plot", str(tmp_path / "pics" / "p.png")])
    moved = (tmp_path / "new" / "doc.md").read_text()
    assert "](../pics/p.png)" in moved and "](../synthetic.json)" in moved and "](../synthetic.yaml)" in moved


def test_study_report_writes_no_empty_plot_before_any_cell(tmp_path, capsys):
    import study_report

    plan_path = tmp_path / "synthetic.yaml"
    plan_path.write_text(REPORT_PLAN)
    out, png = tmp_path / "doc.md", tmp_path / "p.png"
    study_report.main([str(plan_path), "--json", str(tmp_path / "none.json"), "--out", str(out), "--plot", str(png),
                       "--curves", str(tmp_path / "c.png")])
    assert not png.exists() and not (tmp_path / "c.png").exists() and "p.png" not in out.read_text()
    assert "no cell yet: no plot written" in capsys.readouterr().out and "0 of " in out.read_text()


def test_study_report_names_a_restarted_seeds_retired_cells(tmp_path):
    from studies import report

    plan_path = tmp_path / "synthetic.yaml"
    plan_path.write_text(REPORT_PLAN)
    table = StudyTable(tmp_path / "synthetic.json", Plan.load(plan_path))
    for arm, correct in (("a", [1, 1, 1, 0]), ("b", [1, 0, 1, 0])):
        for seed in (0, 1):
            table.add(arm, seed, "u=2", {"samples": [{"correct": x} for x in correct]}, problems="p")
    table.restart(1, {"start": "rebuilt"}, "its start was rebuilt")
    text = report.section(table, str(plan_path), str(tmp_path / "synthetic.json"), str(tmp_path / "d.md"))
    assert ("**Seed 1 was run again.** Its start was rebuilt. Its 2 earlier cells are retired (kept under `retired` "
            "in the table, out of every number below); at u=2 they scored a 75.0, b 50.0.") in text
    assert "| a | – | – | – | 0/3 | 75.0 [75.0] |" in text  # seed 0 alone


def test_random_initial_masking_is_refused_where_it_would_do_nothing():
    """The stage construction never reads progressive.random_initial_masking (only the threshold construction does):
    a PU+ ablation on it would silently train the reference arm."""
    from dlm.config import RecipeError, load_recipe

    with pytest.raises(RecipeError, match="random_initial_masking is for construction 'threshold'"):
        load_recipe(ROOT / "recipes" / "tinymath" / "pu.yaml", ["progressive.random_initial_masking=true"])
    r = load_recipe(ROOT / "recipes" / "tinymath" / "pu.yaml",
                    ["progressive.random_initial_masking=true", "progressive.construction=threshold"])
    assert r.progressive.random_initial_masking


def test_two_drivers_fill_one_table_without_losing_cells(tmp_path):
    """One driver per core on the same table: each write takes in the cells the other wrote."""
    plan_path = tmp_path / "synthetic.yaml"
    plan_path.write_text(REPORT_PLAN)
    plan = Plan.load(plan_path)
    one, two = StudyTable(tmp_path / "t.json", plan), StudyTable(tmp_path / "t.json", plan)
    result = {"samples": [{"correct": True}, {"correct": False}]}
    one.pin("warm_start", "abc")
    one.add("a", 0, "u=2", result, problems="p")
    two.add("b", 1, "u=2", result, problems="p")
    one.add("c", 2, "u=8", result, problems="p")
    with pytest.raises(StudyError, match="already exists"):
        two.add("a", 0, "u=2", result, problems="p")  # written by the other driver
    with pytest.raises(StudyError, match="warm_start"):
        two.pin("warm_start", "def")
    cells = json.loads((tmp_path / "t.json").read_text())["cells"]
    assert sorted((c["arm"], c["seed"]) for c in cells) == [("a", 0), ("b", 1), ("c", 2)]


def test_unseen_report_pairs_each_arms_unseen_cells_with_its_seen_ones(tmp_path):
    import statistics

    import unseen_report

    assert [unseen_report.seen_key(k) for k in ("u=2/unseen", "unseen", "tau=0.9/unseen", "u=2")] == \
        ["u=2", "test", "tau=0.9", None]
    plan_path = tmp_path / "syn.yaml"
    plan_path.write_text("name: syn\narms: [a, b]\nseeds: [0, 1, 2]\nevals: [u=2, u=8, u=2/unseen]\n")
    table = StudyTable(tmp_path / "syn.json", Plan.load(plan_path))
    seen = {0: [1, 1, 0, 1], 1: [1, 0, 0, 1]}
    unseen = {0: [0, 0, 0, 1], 1: [0, 0, 1, 1]}
    for s in (0, 1):
        table.add("a", s, "u=2", {"samples": [{"correct": x} for x in seen[s]]}, problems="seen")
        table.add("a", s, "u=2/unseen", {"samples": [{"correct": x} for x in unseen[s]]}, problems="unseen")
        table.add("b", s, "u=2", {"samples": [{"correct": x} for x in seen[s]]}, problems="seen")
    doc = tmp_path / "unseen.md"
    unseen_report.main([str(plan_path), "--results", str(tmp_path), "--out", str(doc)])
    row = next(line for line in doc.read_text().splitlines() if line.startswith("| syn | a |"))
    sd = 100 * statistics.stdev([0.75, 0.5])  # seen 3/4 and 2/4, unseen 1/4 and 2/4: the same sd
    assert f"| u=2 | 62.5 ± {sd:.1f} % [" in row and f"| 37.5 ± {sd:.1f} % [" in row and row.count("2/3 seeds") == 2
    low, high = (float(x) for x in row.split(f"| 37.5 ± {sd:.1f} % [")[1].split("]")[0].split(", "))
    assert 0 <= low < 37.5 < high <= 100  # a bootstrap CI over 4 problems: wide, around the mean
    assert "| syn | no unseen cell yet: b |" in doc.read_text()


def test_plot_series_keep_top_u_and_threshold_apart_and_draw_an_ar_once(tmp_path):
    from studies import report

    plan_path = tmp_path / "mixed.yaml"
    plan_path.write_text("name: mixed\narms: [mdm, ar]\nseeds: [0]\nevals: [u=1, u=4, tau=0.9, tau=0.9/unseen]\n"
                         "settings: {}\n")
    table = StudyTable(tmp_path / "mixed.json", Plan.load(plan_path))
    cells = (("u=1", 0.9, 36.0), ("u=4", 0.8, 9.0), ("tau=0.9", 0.85, 3.0), ("tau=0.9/unseen", 0.1, 5.0))
    for key, share, nfe in cells:
        table.add("mdm", 0, key, {"mean_nfe": nfe, "samples": [{"correct": i < 100 * share} for i in range(100)]},
                  problems=key)
        table.add("ar", 0, key, {"mean_nfe": 27.0, "samples": [{"correct": i < 99} for i in range(100)]},
                  problems=key)
    lines = dict(report.series(table))
    assert sorted(lines) == ["ar", "mdm (threshold)", "mdm (top-u)"]  # the unseen split is not on the plot
    assert lines["mdm (top-u)"] == [(9.0, 80.0, 0.0), (36.0, 90.0, 0.0)]
    assert lines["mdm (threshold)"] == [(3.0, 85.0, 0.0)]
    assert lines["ar"] == [(27.0, 99.0, 0.0)]


def test_zero_carry_copy_is_the_model_with_its_carry_zeroed(tmp_path, tiny_tokenizer):
    """benchmarks/zero_carry.py: the saved copy reloads with a zero carry LayerNorm and every other weight bitwise
    the source's, so it computes what the source computes with its carry zeroed in memory; an existing destination
    and a model without a carry are refused in one line."""
    from dlm.errors import DlmError
    from dlm.modeling.build import save_model
    from dlm.modeling.carry import CARRY_MODULE, zero_carry_
    from dlm.sampling import load_for_inference
    from zero_carry import write_zero_carry

    vocab, mask = len(tiny_tokenizer), tiny_tokenizer.mask_token_id
    src = perturb(tiny_model(vocab, attention="bidirectional", family="masked", carry=True, mask_token_id=mask))
    with torch.no_grad():
        getattr(src.backbone, CARRY_MODULE).weight.normal_()
        getattr(src.backbone, CARRY_MODULE).bias.normal_()
    save_model(src, tmp_path / "src")
    tiny_tokenizer.save_pretrained(tmp_path / "src")
    dest = write_zero_carry(tmp_path / "src", tmp_path / "copy")
    copy, _ = load_for_inference(dest)
    before, after = src.state_dict(), copy.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        if CARRY_MODULE in k:
            assert after[k].abs().max() == 0 and before[k].abs().max() > 0
        else:
            assert torch.equal(before[k], after[k]), k
    ids = torch.randint(0, vocab - 1, (2, 10), generator=torch.Generator().manual_seed(0))
    carry = torch.randn(2, 10, src.config.hidden_size, generator=torch.Generator().manual_seed(1))
    zero_carry_(src)
    with torch.no_grad():
        torch.testing.assert_close(copy(ids, carry=carry), src(ids, carry=carry), rtol=0, atol=0)
    assert json.loads((dest / "zero_carry.json").read_text())["source"].endswith("src")
    with pytest.raises(DlmError, match="already exists"):
        write_zero_carry(tmp_path / "src", dest)
    plain = tiny_model(vocab, attention="bidirectional", family="masked", mask_token_id=mask)
    save_model(plain, tmp_path / "plain")
    tiny_tokenizer.save_pretrained(tmp_path / "plain")
    with pytest.raises(DlmError, match="no carry layer"):
        write_zero_carry(tmp_path / "plain", tmp_path / "plain-copy")
    assert not (tmp_path / "plain-copy").exists() and not (tmp_path / "plain-copy.tmp").exists()


def _seeded_plan(tmp_path, data):
    """A plan whose warm start is built per seed by a `dlm train` command (a tiny MDM, 2 updates), with one trained
    arm and a curve point read from its checkpoint after 1 update."""
    small = ["data.level=easy", "data.n_train=64", "data.n_validation=4", "data.n_test=6", "model.max_length=160",
             "model.label_shift=false", "train.batch_size=4", "train.checkpoint_every=1", "train.keep_checkpoints=3",
             "train.log_every=1", "eval.n=2", "eval.test_n=2", "eval.max_new_tokens=16", "eval.batch_size=4"]
    build = (f"dlm train recipes/tinymath/mdm.yaml --set data.dir={data} --set data.level=easy --set data.n_train=64 "
             "--set data.n_validation=4 --set data.n_test=6 --set model.init_from=null --set model.preset=tiny "
             "--set model.vocab_size=300 --set model.max_length=160 --set model.label_shift=false "
             "--set train.batch_size=4 --set train.steps=2 --set eval.n=2 --set eval.test_n=2 "
             f"--set eval.max_new_tokens=16 --set train.seed={{seed}} --out-dir {tmp_path}/starts/seed{{seed}}/warm")
    plan = {"name": "seeded", "arms": ["mdm", "mdm@1"], "seeds": [0, 1], "evals": ["u=4"],
            "settings": {"data": str(data), "n": 3, "max_new_tokens": 16, "eval_batch_size": 4,
                         "starts": {"warm": {"path": f"{tmp_path}/starts/seed{{seed}}/warm", "commands": [build]}},
                         "overrides": small,
                         "arm_specs": {"mdm": {"recipe": "recipes/tinymath/mdm.yaml", "init": "warm", "updates": 2},
                                       "mdm@1": {"curve_of": "mdm", "at": 1}}}}
    path = tmp_path / "seeded.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


def test_independent_starts_are_built_per_seed_and_rebuilt_to_the_same_bits(tmp_path, capsys, monkeypatch):
    """Each seed builds its own start with the plan's command (other bits per seed), the table pins each seed's
    fingerprint, a curve point is its arm's checkpoint, and a start rebuilt on the same machine and thread count
    has the same bits, so the table takes the rebuilt seed's cells; a start with other bits is refused."""
    import pumba_study
    from studies.plans import fingerprint

    _, data = tiny_mdm_warm_start(tmp_path)
    path = _seeded_plan(tmp_path, data)
    monkeypatch.setattr("studies.seeded.CURVE_POINTS", 1)  # one curve point keeps this test small
    out = pumba_study.run(path, tmp_path / "seeded.json", tmp_path / "runs")
    assert out == {"cells": 4, "stopped": False, "waiting": []}
    table = StudyTable(tmp_path / "seeded.json", Plan.load(path))
    assert table.pins["warm/seed0"] != table.pins["warm/seed1"] and "warm" not in table.pins
    for seed in (0, 1):
        start = tmp_path / "starts" / f"seed{seed}" / "warm" / "model"
        assert fingerprint(start) == table.pins[f"warm/seed{seed}"]
        point, end = table.cell("mdm@1", seed, "u=4"), table.cell("mdm", seed, "u=4")
        assert (point["updates"], end["updates"]) == (1, 2) and point["model"] != end["model"]
        ckpt = tmp_path / "runs" / f"seed{seed}" / "mdm" / "checkpoints" / "step_0000001" / "model"
        assert point["model"] == fingerprint(ckpt)
    assert "building start warm" in capsys.readouterr().out
    # seed 0's start lost and rebuilt by the plan's command: the same bits, so the table accepts it
    shutil.rmtree(tmp_path / "starts" / "seed0")
    shutil.rmtree(tmp_path / "runs" / "seed0")
    first = json.loads((tmp_path / "seeded.json").read_text())
    first["cells"] = [c for c in first["cells"] if c["seed"] != 0]
    (tmp_path / "seeded.json").write_text(json.dumps(first))
    from studies.seeded import build_start

    assert build_start(Plan.load(path), "warm", 0)
    # a run stopped on a budget after 1 update: its curve point is read from the checkpoint it left, and that is the
    # checkpoint the uninterrupted run of the first phase had (the same bits)
    assert pumba_study.trained_model(Plan.load(path), "mdm", 0, tmp_path / "runs", minutes=1e-6) is None
    part = pumba_study.run(path, tmp_path / "seeded.json", tmp_path / "runs", seeds=[0], arms=["mdm@1"])
    assert part["cells"] == 1 and not (tmp_path / "runs" / "seed0" / "mdm" / "study_train.json").exists()
    early = StudyTable(tmp_path / "seeded.json", Plan.load(path)).cell("mdm@1", 0, "u=4")
    assert early["model"] == table.cell("mdm@1", 0, "u=4")["model"] and early["updates"] == 1
    again = pumba_study.run(path, tmp_path / "seeded.json", tmp_path / "runs", seeds=[0])
    assert again["cells"] == 1
    rebuilt = StudyTable(tmp_path / "seeded.json", Plan.load(path))
    assert rebuilt.cell("mdm", 0, "u=4")["model"] == table.cell("mdm", 0, "u=4")["model"]
    assert rebuilt.cell("mdm", 0, "u=4")["correct"] == table.cell("mdm", 0, "u=4")["correct"]
    # other bits in place of seed 1's start: refused, naming --restart-seeds
    from safetensors.torch import load_file, save_file

    weights = next((tmp_path / "starts" / "seed1" / "warm" / "model").glob("*.safetensors"))
    state = load_file(weights)
    save_file({k: v + 1 if i == 0 else v for i, (k, v) in enumerate(state.items())}, weights, metadata={"format": "pt"})
    first = json.loads((tmp_path / "seeded.json").read_text())
    first["cells"] = [c for c in first["cells"] if (c["seed"], c["arm"]) != (1, "mdm@1")]
    (tmp_path / "seeded.json").write_text(json.dumps(first))
    with pytest.raises(StudyError, match="--restart-seeds 1"):
        pumba_study.run(path, tmp_path / "seeded.json", tmp_path / "runs", seeds=[1])


def test_curve_points_must_be_saved_and_kept(tmp_path, monkeypatch):
    import pumba_study

    _, data = tiny_mdm_warm_start(tmp_path)
    raw = yaml.safe_load(_seeded_plan(tmp_path, data).read_text())
    with pytest.raises(StudyError, match=r"read at 1 checkpoint\(s\); a plan on independent starts"):
        pumba_study.check_plan(Plan.load(_seeded_plan(tmp_path, data)))  # the smoke plan's one point is too few
    monkeypatch.setattr("studies.seeded.CURVE_POINTS", 1)
    for at, overrides, match in [(2, [], "between 0 and mdm's 2"), (1, ["train.checkpoint_every=2"], "not at 1")]:
        raw["settings"]["arm_specs"]["mdm@1"]["at"] = at
        raw["settings"]["arm_specs"]["mdm"]["set"] = overrides
        bad = tmp_path / "bad.yaml"
        bad.write_text(yaml.safe_dump(raw))
        with pytest.raises(StudyError, match=match):
            pumba_study.check_plan(Plan.load(bad))
    # a recipe that keeps too few checkpoints for its curve is given enough (and a margin for budget stops)
    raw["settings"]["arm_specs"]["mdm@1"]["at"] = 1
    raw["settings"]["arm_specs"]["mdm"]["set"] = ["train.keep_checkpoints=1"]
    bad.write_text(yaml.safe_dump(raw))
    recipe = pumba_study.recipe_for(Plan.load(bad), "mdm", 0, tmp_path / "r")
    assert recipe.train.keep_checkpoints == (2 - 1) // 1 + 1 + 3
