"""The TESS 2 study driver and the tinymath-levels report end to end on tiny models (issue 17): every trained model
is pinned, cells keep per-problem outcomes, a rerun trains and evaluates nothing already done, an evaluation file that
appears later fills only its own cells, and the docs' numbers are regenerated between their markers."""

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["model.preset=tiny", "model.max_length=160", "train.batch_size=4", "train.steps=2", "train.log_every=1",
        "train.eval_every=null", "train.checkpoint_every=null", "optim.warmup_steps=0", "eval.test_n=2",
        "eval.max_new_tokens=16", "eval.inference_steps=2"]
DATA = ["data.level=easy", "data.n_train=48", "data.n_validation=4", "data.n_test=6", "model.vocab_size=600"]


def _plan(tmp_path) -> Path:
    def entry(recipe, seed=0, init=None, extra=()):
        return {"recipe": f"recipes/tinymath/{recipe}.yaml", "seed": seed, **({"init_from": init} if init else {}),
                "set": [*TINY, *DATA, *extra]}

    plan = {
        "name": "tess2-smoke", "arms": ["ar", "steps-2", "steps-4", "eta-1", "top-p"], "seeds": [0, 1],
        "evals": ["test", "unseen"],
        "settings": {
            "data_dir": str(tmp_path / "runs" / "ar" / "data"), "runs_dir": str(tmp_path / "runs"), "n": 3,
            "max_new_tokens": 16, "batch_size": 3,
            "eval_files": {"test": "test.jsonl", "unseen": "late_unseen.jsonl"},  # a file the generator never writes
            "eval_arms": {"unseen": ["ar", "steps-2"]},
            "train": {"ar": entry("ar"), "adapt": entry("tess2-adapt", init="ar"),
                      "reward": entry("reward", init="ar"), "sft": entry("tess2-sft", seed="study", init="adapt")},
            "arm_settings": {"ar": {"model": "ar"}, "steps-2": {"model": "sft", "inference_steps": 2},
                             "steps-4": {"model": "sft", "inference_steps": 4},
                             "eta-1": {"model": "sft", "inference_steps": 2, "reward_model": "reward",
                                       "guidance_scale": 1.0},
                             "top-p": {"model": "sft", "inference_steps": 4, "top_p": 0.9}},
            "reward_scorer": "reward", "guidance_baseline": "steps-2",
            "comparisons": [["steps-4", "steps-2"], ["eta-1", "steps-2"], ["top-p", "steps-4"], ["steps-2", "ar"]]}}
    path = tmp_path / "plan.yaml"
    path.write_text(json.dumps(plan))  # JSON is YAML
    return path


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """The smoke plan run once without an unseen file, then again after one appears; calls counted."""
    import tess2_tinymath

    tmp = tmp_path_factory.mktemp("tess2study")
    plan, table = _plan(tmp), tmp / "table.json"
    calls = {"train": [], "evaluate": 0}
    train, evaluate = tess2_tinymath._train, tess2_tinymath.evaluate

    def counted_train(recipe, resume):
        calls["train"].append(Path(recipe.out_dir).name)
        train(recipe, resume)

    def counted_evaluate(*a, **k):
        calls["evaluate"] += 1
        return evaluate(*a, **k)

    mp = pytest.MonkeyPatch()
    mp.setattr(tess2_tinymath, "_train", counted_train)
    mp.setattr(tess2_tinymath, "evaluate", counted_evaluate)
    cli = ["--plan", str(plan), "--json", str(table)]
    tess2_tinymath.main(["study", *cli])
    first = {"train": list(calls["train"]), "evaluate": calls["evaluate"], "cells": json.loads(table.read_text())}
    calls["train"].clear()
    calls["evaluate"] = 0
    tess2_tinymath.main(["study", *cli])  # nothing left to do: no training, no evaluation
    second = {"train": list(calls["train"]), "evaluate": calls["evaluate"]}
    data = tmp / "runs" / "ar" / "data"
    (data / "late_unseen.jsonl").write_text((data / "validation.jsonl").read_text())  # an evaluation file appears
    tess2_tinymath.main(["study", *cli])
    third = {"train": list(calls["train"]), "evaluate": calls["evaluate"] - second["evaluate"]}
    mp.undo()
    doc = tmp / "doc.md"
    doc.write_text("# smoke\n\nwritten by hand\n<!-- study:begin -->\nold numbers\n<!-- study:end -->\n\n## Reading\n")
    tess2_tinymath.main(["report", *cli, "--doc", str(doc)])
    return {"tmp": tmp, "plan": plan, "table": table, "first": first, "second": second, "third": third, "doc": doc}


def test_study_trains_each_model_once_and_records_per_problem_cells(study):
    first = study["first"]
    # each model once, when a cell first needs it (the reward scorer with the first cell), parents first
    assert first["train"] == ["ar", "reward", "adapt", "sft-seed0", "sft-seed1"]
    cells = first["cells"]["cells"]
    # 5 arms x 2 seeds, test only (no unseen file yet); the greedy AR's seed-1 cell is its seed-0 measurement again
    assert len(cells) == 5 * 2 and first["evaluate"] == len(cells) - 1
    assert [(c["seed"], c["arm"]) for c in cells][:5] == [(0, a) for a in ["ar", "steps-2", "steps-4", "eta-1",
                                                                          "top-p"]]  # seed-major
    for c in cells:
        assert c["eval"] == "test" and c["n"] == 3 and len(c["correct"]) == 3
        assert c["accuracy"] == sum(c["correct"]) / 3
    by = {(c["arm"], c["seed"]): c for c in cells}
    assert by[("steps-4", 1)]["mean_nfe"] <= 4 and by[("steps-2", 0)]["mean_nfe"] <= 2
    assert by[("eta-1", 0)]["options"]["guidance_scale"] == 1.0 and "mean_reward" in by[("eta-1", 0)]
    assert "mean_reward" not in by[("ar", 0)]  # the scorer reads simplex outputs only
    assert by[("steps-2", 0)]["run"].endswith("sft-seed0/model") and by[("steps-2", 1)]["run"].endswith(
        "sft-seed1/model")
    pins = first["cells"]["pins"]
    assert set(pins) == {"ar", "adapt", "reward", "sft/seed0", "sft/seed1"} and pins["sft/seed0"] != pins["sft/seed1"]
    # each cell names the weights it decoded and how; the sampling seed belongs to a simplex decoding, not to greedy AR
    assert by[("steps-2", 1)]["model"] == pins["sft/seed1"] and by[("ar", 0)]["model"] == by[("ar", 1)]["model"]
    assert by[("steps-2", 0)]["decode"].endswith(f"seed=0/scorer={pins['reward']}") and "seed=" not in by[("ar", 0)][
        "decode"]
    assert by[("ar", 1)]["copied_from"] == ["ar", 0, "test"] and by[("ar", 1)]["correct"] == by[("ar", 0)]["correct"]
    assert "copied_from" not in by[("steps-2", 1)]


def test_rerun_skips_done_cells_and_fills_a_new_evaluation_file_only(study):
    assert study["second"] == {"train": [], "evaluate": 0}
    assert study["third"] == {"train": [], "evaluate": 2 * 2 - 1}  # eval_arms: unseen on ar and steps-2 only
    cells = json.loads(study["table"].read_text())["cells"]
    assert len(cells) == 14 and cells[:10] == study["first"]["cells"]["cells"]  # the earlier cells untouched
    unseen = [c for c in cells if c["eval"] == "unseen"]
    assert len({c["problems"] for c in unseen}) == 1 and unseen[0]["problems"] != cells[0]["problems"]


def test_cells_written_before_weights_were_recorded_are_backfilled_from_the_pins(study, tmp_path):
    """An older table (each cell's `model` a run path, no decode signature) gains the fingerprint and signature a new
    cell has, from the table's own pins; the summary then counts the greedy AR once, and cells that share weights and
    decoding but disagree problem by problem are refused (the signature would be missing something)."""
    import tess2_tinymath
    from studies.plans import Plan, StudyError
    from studies.tables import StudyTable

    data = json.loads(study["table"].read_text())
    new = {(c["arm"], c["seed"], c["eval"]): dict(c) for c in data["cells"]}
    for c in data["cells"]:  # the old layout
        c["model"] = c.pop("run")
        for k in ("decode", "copied_from"):
            c.pop(k, None)
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    plan = Plan.load(study["plan"])
    table = StudyTable(old, plan)
    assert table.summary("ar", "test")["seeds"] == [0, 1]  # nothing says the two AR cells are one measurement
    assert tess2_tinymath.backfill_measurements(plan, table) == len(data["cells"])
    for c in StudyTable(old, plan).cells:
        n = new[(c["arm"], c["seed"], c["eval"])]
        assert (c["model"], c["decode"], c["run"]) == (n["model"], n["decode"], n["run"])
    assert StudyTable(old, plan).summary("ar", "test")["seeds"] == [0]
    assert tess2_tinymath.backfill_measurements(plan, StudyTable(old, plan)) == 0  # idempotent
    bad = json.loads(old.read_text())
    ar1 = next(c for c in bad["cells"] if (c["arm"], c["seed"], c["eval"]) == ("ar", 1, "test"))
    ar1["correct"] = [1 - x for x in ar1["correct"]]
    ar1["accuracy"] = sum(ar1["correct"]) / len(ar1["correct"])
    old.write_text(json.dumps(bad))
    with pytest.raises(StudyError, match="decode the same weights the same way but their outcomes differ"):
        tess2_tinymath.backfill_measurements(plan, StudyTable(old, plan))
    with pytest.raises(StudyError, match=r"would change what it measured \(correct\)"):
        StudyTable(old, plan).annotate(lambda c: {"correct": []})


def test_seeds_limits_a_run_to_its_seeds_and_refuses_one_not_planned(study, capsys):
    """--seeds (one driver per core): a run fills only its seeds' cells (the models are trained already, so nothing
    trains), and a seed the plan does not list is one error line, not a traceback."""
    import tess2_tinymath

    table = study["tmp"] / "seed1-only.json"
    cli = ["study", "--plan", str(study["plan"]), "--json", str(table)]
    tess2_tinymath.main([*cli, "--seeds", "1"])
    cells = json.loads(table.read_text())["cells"]
    assert {c["seed"] for c in cells} == {1} and len(cells) == 5 + 2  # 5 arms on test, 2 on the unseen file
    with pytest.raises(SystemExit) as e:
        tess2_tinymath.main([*cli, "--seeds", "1,3"])
    assert "--seeds [3] not in the plan's seeds [0, 1]" in str(e.value)
    assert len(json.loads(table.read_text())["cells"]) == 7  # nothing added by the refused run
    tess2_tinymath.main([*cli, "--seeds", "0", "--arms", "top-p,ar"])  # --arms: these arms only, in this order
    added = json.loads(table.read_text())["cells"][7:]
    assert [(c["arm"], c["seed"], c["eval"]) for c in added] == [("top-p", 0, "test"), ("ar", 0, "test"),
                                                                 ("ar", 0, "unseen")]


def test_a_pin_no_cell_used_is_replaced_when_the_model_is_trained_again(study):
    """A per-seed model pinned in a session that ended before any of its cells (and retrained to other bits in the
    next) is pinned anew; a pin that cells rest on still refuses other weights."""
    import tess2_tinymath

    data = json.loads(study["table"].read_text())
    table = study["tmp"] / "repin.json"
    data["cells"] = [c for c in data["cells"] if c["seed"] == 0]
    real = data["pins"]["sft/seed1"]
    data["pins"]["sft/seed1"] = "0" * 16  # what the lost session's sft seed 1 was
    table.write_text(json.dumps(data))
    cli = ["study", "--plan", str(study["plan"]), "--json", str(table)]
    tess2_tinymath.main([*cli, "--seeds", "1"])
    after = json.loads(table.read_text())
    assert after["pins"]["sft/seed1"] == real and {c["seed"] for c in after["cells"]} == {0, 1}
    after["pins"]["sft/seed0"] = "0" * 16  # seed 0's cells rest on it: refused
    after["cells"] = [c for c in after["cells"] if not (c["seed"] == 0 and c["arm"] == "top-p")]
    table.write_text(json.dumps(after))
    with pytest.raises(SystemExit, match="pinned sft/seed0"):
        tess2_tinymath.main([*cli, "--seeds", "0"])


def test_report_regenerates_only_the_marked_part(study):
    import tess2_tinymath

    text = study["doc"].read_text()
    assert text.startswith("# smoke\n\nwritten by hand\n<!-- study:begin -->\n") and text.endswith(
        "<!-- study:end -->\n\n## Reading\n")
    assert "old numbers" not in text and "14 of 14 planned cells" in text
    table = json.loads(study["table"].read_text())
    c = [x for x in table["cells"] if x["arm"] == "steps-4" and x["eval"] == "test"]
    mean = 100 * sum(x["accuracy"] for x in c) / 2
    assert f"| steps-4 | sft | inference_steps=4 | {mean:.1f} ± " in text
    assert text.count("- steps-4 vs steps-2: ") == 1 and text.count("- steps-2 vs ar: ") == 2  # test; test, unseen
    assert "(n=3, 2 seeds)" in text and "; mean NFE 4.0 vs 2.0" in text
    assert "chosen after the fact" in text  # the best η vs η = 0 line is marked post hoc
    assert study["doc"].with_suffix(".png").stat().st_size > 10_000
    with pytest.raises(SystemExit, match="no '<!-- study:begin -->'"):
        study["doc"].write_text("# no markers\n")
        tess2_tinymath.main(["report", "--plan", str(study["plan"]), "--json", str(study["table"]),
                             "--doc", str(study["doc"])])


def test_a_plan_naming_an_unknown_model_is_refused_in_one_line(study, tmp_path):
    import tess2_tinymath

    text = json.loads(study["plan"].read_text())
    text["settings"]["arm_settings"]["top-p"]["model"] = "sft2"
    bad = tmp_path / "bad.yaml"
    bad.write_text(json.dumps(text))
    with pytest.raises(SystemExit, match=r"bad.yaml: settings.arm_settings.top-p must name a model") as e:
        tess2_tinymath.main(["study", "--plan", str(bad), "--json", str(tmp_path / "t.json")])
    assert "\n" not in str(e.value)


def test_levels_json_has_per_problem_outcomes_and_regenerates_the_table(study, tmp_path):
    import tinymath_levels

    run = study["tmp"] / "runs" / "ar"
    doc = tmp_path / "levels.md"
    doc.write_text("# levels\n<!-- study:begin -->\n<!-- study:end -->\n\n## Reading\nkept\n")
    out = tmp_path / "levels.json"
    tinymath_levels.main([str(run), "--json", str(out), "--doc", str(doc)])
    data = json.loads(out.read_text())
    (cell,) = data["cells"]
    samples = [json.loads(x) for x in (run / "test_samples.jsonl").read_text().splitlines()]
    assert cell["arm"] == "easy" and cell["correct"] == [int(s["correct"]) for s in samples] and cell["n"] == 2
    first = doc.read_text()
    assert f"| easy | **{100 * cell['accuracy']:.1f} %** (n=2) |" in first and first.endswith("## Reading\nkept\n")
    doc.write_text(first.replace("| easy |", "| edited |"))
    tinymath_levels.main(["--json", str(out), "--doc", str(doc)])  # from the JSON alone
    assert doc.read_text() == first


def test_easy_study_sections_merge_into_one_json(study, tmp_path):
    """Every section of the easy doc writes its own key of one JSON (no hand assembly); steps and guidance keep every
    problem's outcome."""
    import tess2_tinymath

    runs, out = study["tmp"] / "runs", tmp_path / "easy.json"
    data = str(runs / "ar" / "data" / "test.jsonl")
    common = ["--data", data, "--n", "3", "--gen-length", "16", "--json", str(out)]
    tess2_tinymath.main(["init", str(tmp_path / "ar-as-simplex"), "--set", f"model.init_from={runs / 'ar' / 'model'}",
                         "--set", "model.max_length=160", "--json", str(out), "--key", "init-ar"])
    tess2_tinymath.main(["loss", str(tmp_path / "ar-as-simplex"), str(runs / "adapt"), *common, "--key", "loss-adapt",
                         "--values", "0", "--out", str(tmp_path / "loss.json")])  # as tess2-shakespeare.md runs it
    tess2_tinymath.main(["steps", str(runs / "sft-seed0"), *common, "--values", "2,4", "--key", "steps-sft"])
    tess2_tinymath.main(["guidance", str(runs / "sft-seed0"), *common, "--values", "0,1", "--steps", "2",
                         "--reward-model", str(runs / "reward")])
    tess2_tinymath.main(["intrinsic", str(runs / "sft-seed0"), *common, "--steps", "2", "--no-mauve",
                         "--reference-model", str(runs / "ar")])
    tess2_tinymath.main(["test-eval", str(runs / "adapt"), str(runs / "reward"), "--json", str(out), "--key",
                         "test_eval"])
    result = json.loads(out.read_text())
    assert list(result) == ["init-ar", "loss-adapt", "steps-sft", "guidance", "intrinsic", "test_eval"]
    assert json.loads((tmp_path / "loss.json").read_text()) == result["loss-adapt"]
    loss = result["loss-adapt"]["result"]
    assert [r["model"] for r in loss] == [str(tmp_path / "ar-as-simplex"), str(runs / "adapt")]
    steps = result["steps-sft"]["result"]
    assert [r["inference_steps"] for r in steps] == [2, 4] and all(len(r["correct"]) == 3 for r in steps)
    assert all(r["accuracy"] == sum(r["correct"]) / 3 for r in steps + result["guidance"]["result"])
    assert [r["eta"] for r in result["guidance"]["result"]] == [0.0, 1.0]
    assert [r["model"] for r in result["intrinsic"]["rows"]] == ["references", str(runs / "sft-seed0")]
    assert set(result["test_eval"]) == {"adapt", "reward"}
    assert result["test_eval"]["adapt"] == json.loads((runs / "adapt" / "eval.json").read_text())


def test_max_minutes_stops_resumably_before_the_next_cell(study, tmp_path, capsys):
    import tess2_tinymath

    table = tmp_path / "t.json"
    tess2_tinymath.main(["study", "--plan", str(study["plan"]), "--json", str(table), "--max-minutes", "1e-9"])
    out = capsys.readouterr().out
    assert "--max-minutes reached; the next call resumes here" in out and "0 cells added; 14 planned cells" in out
    assert not table.exists()


def test_levels_name_the_settings_their_runs_differ_in():
    from tinymath_levels import recipe_differences

    recipes = {"easy": {"model": {"max_length": 224, "preset": "small"}, "data": {"level": "easy", "dir": "a"}},
               "medium": {"model": {"max_length": 192, "preset": "small"}, "data": {"level": "medium", "dir": "b"}}}
    assert recipe_differences(recipes) == ["model.max_length easy 224, medium 192"]
    assert recipe_differences({"easy": recipes["easy"]}) == []


def test_ablation_plan_trains_each_variant_as_specified_and_samples_it(tmp_path):
    """benchmarks/plans/tess2-ablations.yaml on tiny models, one seed: every ablated pipeline (UL2 -> prefix-only,
    no label shift, causal attention, no self-conditioning) trains in both stages, its saved model carries the
    ablated choice, and the simplex sampler runs on it."""
    import yaml

    import tess2_tinymath
    from dlm.sampling import load_for_inference
    from studies.plans import Plan

    root = Path(__file__).resolve().parents[1]
    plan = yaml.safe_load((root / "benchmarks" / "plans" / "tess2-ablations.yaml").read_text())
    assert plan["settings"]["comparisons"] == [["full", a] for a in plan["arms"][2:]]
    tess2_tinymath.check_plan(Plan.load(root / "benchmarks" / "plans" / "tess2-ablations.yaml"))
    ablated = ("simplex.masking", "model.label_shift", "model.attention", "simplex.self_condition_prob")
    for entry in plan["settings"]["train"].values():
        entry["set"] = [*TINY, *DATA, *[o for o in entry["set"] if o.split("=")[0] in ablated]]
        entry.pop("out_dir", None)
    plan["seeds"] = [0]
    plan["settings"].update(data_dir=str(tmp_path / "runs" / "ar" / "data"), runs_dir=str(tmp_path / "runs"), n=3,
                            max_new_tokens=16, batch_size=3)
    path = tmp_path / "ablations.yaml"
    path.write_text(yaml.safe_dump(plan))
    table = tmp_path / "table.json"
    tess2_tinymath.main(["study", "--plan", str(path), "--json", str(table)])
    cells = {c["arm"]: c for c in json.loads(table.read_text())["cells"]}
    assert sorted(cells) == sorted(plan["arms"]) and all(c["n"] == 3 for c in cells.values())
    specs = {arm: load_for_inference(Path(cells[arm]["run"]))[0].spec for arm in plan["arms"][1:]}
    assert [specs[a].attention for a in ("full", "causal")] == ["bidirectional", "causal"]
    assert [specs[a].label_shift for a in ("full", "no-label-shift")] == [True, False]
    assert [specs[a].self_conditioning for a in ("full", "no-self-cond")] == [True, False]
    recipes = {p.parent.name: yaml.safe_load(p.read_text()) for p in (tmp_path / "runs").glob("*/recipe.yaml")}
    assert recipes["adapt-prefix-seed0"]["simplex"]["masking"] == "prefix_lm"
    assert recipes["adapt-full-seed0"]["simplex"]["masking"] == "ul2"
    assert all(cells[a]["mean_nfe"] == 25 for a in plan["arms"][1:])  # 25 steps each (inference_steps)
    doc = tmp_path / "doc.md"
    doc.write_text("# ablations\n<!-- study:begin -->\n<!-- study:end -->\n")
    tess2_tinymath.main(["report", "--plan", str(path), "--json", str(table), "--doc", str(doc)])
    text = doc.read_text()
    assert all(f"- full vs {a}: " in text for a in plan["arms"][2:]) and (tmp_path / "doc.png").stat().st_size > 0


def test_adapt_plan_trains_the_scratch_arm_without_the_ar_weights(tmp_path):
    """benchmarks/plans/tess2-adapt.yaml on tiny models, one seed: the adapted arm starts from the AR parent's
    weights, the scratch arm from random ones with the parent's tokenizer and architecture, and both are sampled."""
    import yaml

    import tess2_tinymath
    from dlm.sampling import load_for_inference
    from studies.plans import Plan

    root = Path(__file__).resolve().parents[1]
    source = root / "benchmarks" / "plans" / "tess2-adapt.yaml"
    tess2_tinymath.check_plan(Plan.load(source))
    plan = yaml.safe_load(source.read_text())
    assert plan["settings"]["comparisons"] == [["adapted", "scratch"]]
    train = plan["settings"]["train"]
    kept = ("model.init_from", "model.tokenizer")
    assert [o for o in train["adapt-scratch"]["set"] if o.split("=")[0] in kept] == [
        "model.init_from=null", "model.tokenizer=runs/calib-ar-medium/model"]
    # the two pipelines differ in the start only: the same overrides otherwise, stage by stage
    assert [o for o in train["adapt-scratch"]["set"] if not o.startswith("model.") or "max_length" in o] == \
        train["adapt-ar"]["set"] and train["sft-scratch"]["set"] == train["sft-ar"]["set"]
    runs = tmp_path / "runs"
    for entry in train.values():
        extra = [o for o in entry["set"] if o.split("=")[0] in kept]
        extra = [o.replace("runs/calib-ar-medium", str(runs / "ar")) for o in extra]
        entry["set"] = [*TINY, *DATA, *extra]
        entry.pop("out_dir", None)
    plan["seeds"] = [0]
    plan["settings"].update(data_dir=str(runs / "ar" / "data"), runs_dir=str(runs), n=3, max_new_tokens=16,
                            batch_size=3)
    path = tmp_path / "adapt.yaml"
    path.write_text(yaml.safe_dump(plan))
    table = tmp_path / "table.json"
    tess2_tinymath.main(["study", "--plan", str(path), "--json", str(table)])
    cells = {c["arm"]: c for c in json.loads(table.read_text())["cells"]}
    assert sorted(cells) == ["adapted", "ar", "scratch"] and all(c["n"] == 3 for c in cells.values())
    recipes = {p.parent.name: yaml.safe_load(p.read_text()) for p in runs.glob("*/recipe.yaml")}
    assert recipes["adapt-scratch-seed0"]["model"]["init_from"] is None
    assert recipes["adapt-ar-seed0"]["model"]["init_from"] == str(runs / "ar" / "model")
    ar = load_for_inference(runs / "ar" / "model")[0].state_dict()
    scratch = load_for_inference(Path(cells["scratch"]["run"]))[0].state_dict()
    adapted = load_for_inference(Path(cells["adapted"]["run"]))[0].state_dict()
    shared = [k for k in ar if k in scratch and k in adapted and "layers.0.mlp.up_proj" in k]
    assert shared and all(ar[k].shape == scratch[k].shape for k in shared)  # the parent's architecture
    # 4 tiny updates move the adapted weights a little from the parent's; the scratch ones are elsewhere entirely
    for k in shared:
        assert (adapted[k] - ar[k]).norm() < 0.5 * (scratch[k] - ar[k]).norm()
    assert len(cells["scratch"]["correct"]) == 3  # per-problem outcomes, for the paired comparison


def _reuse_plan(tmp_path, name: str, leaf: str, arm: str, sft_extra=()) -> Path:
    """A two-arm plan (the AR parent and one adapted pipeline) whose stage names start with `leaf`; the AR parent has
    one fixed run directory shared by every such plan."""
    runs = tmp_path / "runs"

    def entry(recipe, seed="study", init=None, extra=()):
        return {"recipe": f"recipes/tinymath/{recipe}.yaml", "seed": seed, **({"init_from": init} if init else {}),
                "set": [*TINY, *DATA, *extra]}

    plan = {"name": name, "arms": ["ar", arm], "seeds": [0, 1], "evals": ["test"],
            "settings": {"data_dir": str(runs / "ar" / "data"), "runs_dir": str(runs / name), "n": 3,
                         "max_new_tokens": 16, "batch_size": 3, "eval_files": {"test": "test.jsonl"},
                         "train": {"ar": {**entry("ar", seed=0), "out_dir": str(runs / "ar")},
                                   f"adapt-{leaf}": entry("tess2-adapt", init="ar"),
                                   f"sft-{leaf}": entry("tess2-sft", init=f"adapt-{leaf}", extra=sft_extra)},
                         "arm_settings": {"ar": {"model": "ar"}, arm: {"model": f"sft-{leaf}", "inference_steps": 2}},
                         "comparisons": [[arm, "ar"]]}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps(plan))
    return path


def test_reuse_takes_over_another_plans_cells_only_after_a_witness_seed(tmp_path, monkeypatch):
    """--reuse: a donor arm with the same training chain under other names stands for ours, but only once one seed
    trained here gave the donor's very weights; then that seed's cells are copied (models pinned, nothing trained)."""
    import tess2_tinymath
    from studies.plans import Plan, StudyError
    from studies.tables import StudyTable

    donor, donor_table = _reuse_plan(tmp_path, "donor", "full", "full"), tmp_path / "donor.json"
    tess2_tinymath.main(["study", "--plan", str(donor), "--json", str(donor_table)])
    trained = []
    train = tess2_tinymath._train
    monkeypatch.setattr(tess2_tinymath, "_train", lambda r, resume: (trained.append(Path(r.out_dir).name),
                                                                      train(r, resume)))
    mine, table = _reuse_plan(tmp_path, "mine", "ar", "adapted"), tmp_path / "mine.json"
    cli = ["study", "--plan", str(mine), "--json", str(table), "--reuse", str(donor_table), "--arms", "adapted"]
    tess2_tinymath.main([*cli, "--seeds", "0"])  # no witness yet: seed 0 is trained here, not copied
    assert trained == ["adapt-ar-seed0", "sft-ar-seed0"]
    data, theirs = json.loads(table.read_text()), json.loads(donor_table.read_text())
    assert data["pins"]["sft-ar/seed0"] == theirs["pins"]["sft-full/seed0"]  # the witness: bitwise the same
    assert "copied_from" not in data["cells"][0]
    trained.clear()
    tess2_tinymath.main([*cli, "--seeds", "1"])
    assert trained == []  # taken over
    data = json.loads(table.read_text())
    cell = next(c for c in data["cells"] if c["seed"] == 1)
    source = next(c for c in theirs["cells"] if (c["arm"], c["seed"]) == ("full", 1))
    assert cell["copied_from"] == {"table": "donor", "arm": "full", "seed": 1, "eval": "test"}
    assert cell["correct"] == source["correct"] and cell["problems"] == source["problems"]
    assert data["pins"]["sft-ar/seed1"] == theirs["pins"]["sft-full/seed1"]
    assert data["pins"]["adapt-ar/seed1"] == theirs["pins"]["adapt-full/seed1"]
    # another training chain (one more SFT update) never stands for ours, witness or not
    other = _reuse_plan(tmp_path, "other", "ar", "adapted", sft_extra=["train.steps=3"])
    plan = Plan.load(other)
    t = StudyTable(tmp_path / "other.json", plan)
    t.pins.update(data["pins"])
    assert tess2_tinymath.Donors(plan, t, [donor_table])._donor_arms("adapted") == []
    assert len(tess2_tinymath.Donors(Plan.load(mine), StudyTable(table, Plan.load(mine)),
                                     [donor_table])._donor_arms("adapted")) == 1
    with pytest.raises(StudyError, match="not this plan's own"):
        tess2_tinymath.Donors(Plan.load(mine), StudyTable(table, Plan.load(mine)), [table])


def test_easy_doc_tables_are_generated_from_its_json(tmp_path):
    """docs/results/tess2-tinymath.md's tables are exactly what report-easy writes from the committed JSON (so the
    doc and its JSON cannot drift apart), and rows that keep per-problem outcomes get paired comparisons."""
    import shutil

    import tess2_tinymath

    root = Path(__file__).resolve().parents[1]
    doc = tmp_path / "doc.md"
    shutil.copy(root / "docs" / "results" / "tess2-tinymath.md", doc)
    written = tess2_tinymath.report_easy(root / "docs" / "results" / "tess2-tinymath.json", doc)
    assert written == list(tess2_tinymath.EASY_BLOCKS)
    committed = (root / "docs" / "results" / "tess2-tinymath.md").read_text()
    assert doc.read_text().replace(str(root / "docs" / "results") + "/", "docs/results/") == committed
    data = {"steps-sft-ar": {"model": ["m"], "n": 4, "result": [
        {"inference_steps": s, "accuracy": a, "ms_per_problem": 1.0, "correct": c}
        for s, a, c in [(10, 0.5, [1, 1, 0, 0]), (25, 0.75, [1, 1, 1, 0])]]}}
    lines = tess2_tinymath.easy_blocks(data)["steps"]
    assert any(x.startswith("- inference_steps 25 vs 10: 75.0 % vs 50.0 % (n=4): +25.0 points") for x in lines)


def test_shakespeare_doc_tables_are_generated_from_its_json(tmp_path):
    """docs/results/tess2-shakespeare.md's tables are exactly what `tess2_shakespeare.py report` writes from the
    committed JSON: the doc and its JSON cannot drift apart."""
    import shutil

    import tess2_shakespeare

    root = Path(__file__).resolve().parents[1]
    results = root / "docs" / "results"
    doc = tmp_path / "doc.md"
    shutil.copy(results / "tess2-shakespeare.md", doc)
    written = tess2_shakespeare.report(results / "tess2-shakespeare.json", doc)
    assert written == ["loss", "prefix", "unconditional", "temperature", "seed1-loss", "seed1-prefix"]
    committed = (results / "tess2-shakespeare.md").read_text()
    assert doc.read_text().replace(str(results) + "/", "docs/results/") == committed
    block = tess2_shakespeare.report_blocks({"heldout_simplex_loss_validation": {"n": 2, "result": [
        {"model": "runs/x/tess2-adapt", "response": 4.771, "ul2_t5": 4.0, "ul2_aggressive_t5": 4.2,
         "ul2_prefix_lm": 4.6}]}})["loss"]
    assert block[-1] == "| TESS 2 adapted from AR | 4.77 | 4.00 | 4.20 | 4.60 |"
