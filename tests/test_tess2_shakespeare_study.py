"""benchmarks/tess2_shakespeare_study.py end to end on tiny models and a hand-made text set: per-passage held-out
loss and per-generation reference NLL as measure cells, models trained once (per seed where the plan says so), a
rerun that trains and measures nothing, paired comparisons and the report."""

import json
import math
import random
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]

WORDS = ("thou art the king of rome and I shall speak no more of love or war to thee this night my lord "
         "good sir what say you now").split()
TINY = ["model.preset=tiny", "model.max_length=64", "train.batch_size=4", "train.steps=2", "train.log_every=1",
        "train.checkpoint_every=null", "optim.warmup_steps=0", "model.vocab_size=320"]


def _texts(path: Path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    rows = [{"prompt": " ".join(rng.choices(WORDS, k=6)), "response": " ".join(rng.choices(WORDS, k=12))}
            for _ in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _plan(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    for name, n, seed in (("train", 48, 0), ("validation", 8, 1), ("reference", 32, 2), ("eval-prefix", 6, 3)):
        _texts(data / f"{name}.jsonl", n, seed)
    files = [f"data.train={data / 'train.jsonl'}", f"data.validation={data / 'validation.jsonl'}"]
    runs = tmp_path / "runs"
    plan = {"name": "shakespeare-smoke", "arms": ["adapted", "scratch", "ar"], "seeds": [0, 1],
            "evals": ["loss", "prefix"],
            "settings": {
                "data_dir": str(data), "runs_dir": str(runs), "n": 4, "eval_n": {"loss": 6},
                "max_new_tokens": 12, "batch_size": 4, "mauve": False,
                "eval_files": {"loss": "validation.jsonl", "prefix": "eval-prefix.jsonl"},
                "eval_arms": {"loss": ["adapted", "scratch"]}, "reference": "reference-ar",
                "train": {
                    "ar": {"recipe": "recipes/shakespeare/ar.yaml", "seed": 0, "out_dir": str(runs / "ar"),
                           "set": [*TINY, *files]},
                    "reference-ar": {"recipe": "recipes/shakespeare/ar.yaml", "seed": 1,
                                     "set": [*TINY, f"data.train={data / 'reference.jsonl'}",
                                             f"data.validation={data / 'validation.jsonl'}"]},
                    "adapt": {"recipe": "recipes/shakespeare/tess2-adapt.yaml", "init_from": "ar", "seed": "study",
                              "set": [*TINY, *files]},
                    "scratch": {"recipe": "recipes/shakespeare/tess2-scratch.yaml", "seed": "study",
                                "set": [*TINY, *files, f"model.tokenizer={runs / 'ar' / 'model'}"]}},
                "arm_settings": {"adapted": {"model": "adapt", "inference_steps": 3},
                                 "scratch": {"model": "scratch", "inference_steps": 3},
                                 "ar": {"model": "ar", "temperature": 1.0}},
                "comparisons": [{"a": "adapted", "b": "scratch", "eval": "loss", "expect": "lower"},
                                {"a": "adapted", "b": "scratch", "eval": "prefix", "expect": "lower"}]}}
    path = tmp_path / "plan.yaml"
    path.write_text(json.dumps(plan))  # JSON is YAML
    return path


def test_shakespeare_study_measures_pairs_resumes_and_reports(tmp_path):
    import mask_discrepancy_study as mds
    import tess2_shakespeare_study as ss
    import tess2_tinymath
    from dlm.sampling import load_for_inference
    from studies.plans import Plan, StudyError
    from studies.tables import StudyTable

    plan_path, table_path = _plan(tmp_path), tmp_path / "table.json"
    trained = []

    def counted(recipe, resume):
        trained.append(Path(recipe.out_dir).name)
        tess2_tinymath._train(recipe, resume)

    assert ss.run(plan_path, table_path, train_fn=counted) == 10  # loss: 2 arms x 2 seeds; prefix: 3 x 2
    assert sorted(trained) == ["adapt-seed0", "adapt-seed1", "ar", "reference-ar", "scratch-seed0", "scratch-seed1"]
    assert ss.run(plan_path, table_path, train_fn=counted) == 0 and len(trained) == 6  # nothing again

    plan = Plan.load(plan_path)
    table = StudyTable(table_path, plan)
    loss = table.cell("adapted", 0, "loss")
    assert loss["n"] == 6 and all(v > 0 and math.isfinite(v) for v in loss["values"])
    # the same model and passages give the same per-passage losses: the objective's draws are fixed
    model, tok = load_for_inference(loss["model"])
    records = tess2_tinymath.read_jsonl(Path(plan.settings["data_dir"]) / "validation.jsonl")[:6]
    assert [round(v, 5) for v in ss.passage_losses(model, tok, records)] == loss["values"]
    assert table.cell("adapted", 0, "loss")["values"] != table.cell("adapted", 1, "loss")["values"]  # seeds differ

    ar = [table.cell("ar", s, "prefix") for s in (0, 1)]
    assert all(c["n"] == 4 and c["temperature"] == 1.0 and c["metrics"]["perplexity"] > 0 for c in ar)
    assert ar[0]["examples"] != ar[1]["examples"]  # sampled at temperature 1 with the seed
    assert table.cell("scratch", 1, "prefix")["options"] == {"inference_steps": 3}

    r = mds.compare(table, plan.settings["comparisons"][0])
    a = [table.cell("adapted", s, "loss")["values"] for s in (0, 1)]
    b = [table.cell("scratch", s, "loss")["values"] for s in (0, 1)]
    assert r["n"] == 6 and r["n_seeds"] == 2
    assert r["difference"] == pytest.approx(sum(sum(x) - sum(y) for x, y in zip(a, b)) / 12, abs=1e-6)

    doc = tmp_path / "doc.md"
    ss.main(["report", "--plan", str(plan_path), "--json", str(table_path), "--doc", str(doc)])
    text = doc.read_text()
    assert "| adapted | 2 |" in text and "| ar | 2 |" in text and "adapted lower than scratch at loss" in text
    assert "Missing cells: none" in text

    bad = json.loads(plan_path.read_text())
    bad["evals"] = ["loss", "unconditional"]
    plan_path.write_text(json.dumps(bad))
    with pytest.raises(StudyError, match="evaluation 'unconditional'"):
        ss.run(plan_path, table_path)
