"""Learning tests under a fixed seed: the AR baseline, trained for a few hundred updates on tinymath (easy), solves a
clear share of held-out problems; a masked diffusion model adapted from it for a further 150 updates does too — far
above its own starting point (the AR weights read as an MDM) and the trivial most-common-answer baseline."""

import json

import pytest

from dlm.config import load_recipe
from dlm.evaluation.run import evaluate_model
from dlm.evaluation.tasks import trivial_baseline
from dlm.training.loop import Trainer

pytestmark = pytest.mark.slow

COMMON = ["data.level=easy", "data.n_train=4000", "data.n_validation=50", "data.n_test=200", "model.preset=tiny",
          "model.vocab_size=512", "model.max_length=96", "train.batch_size=32", "train.log_every=25", "train.seed=0"]


@pytest.fixture(scope="module")
def ar_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("learn")
    recipe = load_recipe(None, COMMON + [f"out_dir={root / 'ar'}", f"data.dir={root / 'data'}", "train.steps=450",
                                         "optim.lr=3e-3", "optim.warmup_steps=20"])
    trainer = Trainer(recipe, progress=False)
    trainer.save_model(root / "untrained")
    trainer.fit()
    return root, trainer.splits["test"]


def _curve(run):
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_ar_baseline_learns_tinymath(ar_run):
    root, test = ar_run
    kwargs = dict(data=root / "data" / "test.jsonl", max_new_tokens=48, batch_size=100, progress=False)
    before = evaluate_model(root / "untrained", **kwargs)["accuracy"]
    after = evaluate_model(root / "ar", **kwargs)["accuracy"]
    floor = trivial_baseline(test)
    curve = _curve(root / "ar")
    assert curve[-1] < 0.25 * curve[0]
    assert before <= floor
    assert after >= floor + 0.20, f"accuracy {after:.3f} vs trivial baseline {floor:.3f}"


def test_masked_diffusion_adapted_from_ar_learns(ar_run):
    root, test = ar_run
    recipe = load_recipe(None, COMMON + [f"out_dir={root / 'mdm'}", f"data.dir={root / 'data'}",
                                         f"model.init_from={root / 'ar'}", "model.attention=bidirectional",
                                         "model.label_shift=true", "train.objective=mdm", "train.steps=150",
                                         "optim.lr=1e-3", "optim.warmup_steps=10"])
    trainer = Trainer(recipe, progress=False)
    trainer.save_model(root / "mdm-start")  # the AR weights, read as a bidirectional MDM
    trainer.fit()
    kwargs = dict(data=root / "data" / "test.jsonl", max_new_tokens=40, batch_size=100, progress=False,
                  policy="top_u", reveal_count=2)
    before = evaluate_model(root / "mdm-start", **kwargs)
    after = evaluate_model(root / "mdm", **kwargs)
    floor = trivial_baseline(test)
    assert _curve(root / "mdm")[-1] < _curve(root / "mdm")[0]
    assert after["accuracy"] >= before["accuracy"] + 0.20
    assert after["accuracy"] >= floor + 0.20, f"accuracy {after['accuracy']:.3f} vs trivial baseline {floor:.3f}"
    assert after["mean_nfe"] <= 21  # top-u with u=2 on a 40-position canvas: at most 20 steps, fewer with early EOS
