"""Learning test: the AR baseline, trained for a few hundred updates on tinymath (easy) from a fixed seed, solves a
clear share of held-out problems — far above its untrained self and the trivial most-common-answer baseline."""

import json

import pytest

from dlm.config import load_recipe
from dlm.evaluation.run import evaluate_model
from dlm.evaluation.tasks import trivial_baseline
from dlm.training.loop import Trainer

pytestmark = pytest.mark.slow

STEPS = 450


def test_ar_baseline_learns_tinymath(tmp_path):
    recipe = load_recipe(None, [
        f"out_dir={tmp_path / 'run'}", f"data.dir={tmp_path / 'data'}", "data.level=easy", "data.n_train=4000",
        "data.n_validation=50", "data.n_test=200", "model.preset=tiny", "model.vocab_size=512", "model.max_length=96",
        f"train.steps={STEPS}", "train.batch_size=32", "train.log_every=50", "optim.lr=3e-3", "optim.warmup_steps=20",
        "train.seed=0"])
    trainer = Trainer(recipe, progress=False)
    test = trainer.splits["test"]
    trainer.save_model(tmp_path / "untrained")
    trainer.fit()
    kwargs = dict(data=tmp_path / "data" / "test.jsonl", max_new_tokens=48, batch_size=100, progress=False)
    before = evaluate_model(tmp_path / "untrained", **kwargs)["accuracy"]
    after = evaluate_model(tmp_path / "run", **kwargs)["accuracy"]
    floor = trivial_baseline(test)
    curve = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert curve[-1] < 0.25 * curve[0]
    assert before <= floor
    assert after >= floor + 0.20, f"accuracy {after:.3f} vs trivial baseline {floor:.3f}"
