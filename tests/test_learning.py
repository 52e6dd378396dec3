"""Learning tests under a fixed seed: the AR baseline, trained for a few hundred updates on tinymath (easy), solves
a clear share of held-out problems — far above its untrained self and the trivial most-common-answer baseline; a
masked diffusion model adapted from it (the adaptation route of both papers) learns to denoise and, decoded with
top-u, beats its untrained self (the AR weights used as a masked model) and the trivial baseline."""

import json

import pytest

from dlm.config import load_recipe
from dlm.evaluation.run import evaluate_model
from dlm.evaluation.tasks import trivial_baseline
from dlm.sampling.options import MaskedOptions
from dlm.training.loop import Trainer

pytestmark = pytest.mark.slow(minutes=8)  # the suite's longest chain (AR fixture, then MDM from it): scheduled first

STEPS = 450
MDM_STEPS = 300
COMMON = ["data.level=easy", "data.n_train=4000", "data.n_validation=50", "data.n_test=200", "model.preset=tiny",
          "model.vocab_size=512", "model.max_length=96", "train.batch_size=32", "train.log_every=25", "train.seed=0"]


def _curve(run):
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def ar_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("learning")
    recipe = load_recipe(None, COMMON + [f"out_dir={root / 'ar'}", f"data.dir={root / 'data'}", f"train.steps={STEPS}",
                                         "optim.lr=3e-3", "optim.warmup_steps=20"])
    trainer = Trainer(recipe, progress=False)
    trainer.save_model(root / "untrained")
    trainer.fit()
    return root, trainer.splits["test"]


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


def test_mdm_adapted_from_ar_learns_tinymath(ar_run):
    root, test = ar_run
    recipe = load_recipe(None, COMMON + [
        f"out_dir={root / 'mdm'}", f"data.dir={root / 'data'}", f"model.init_from={root / 'ar'}", "train.objective=mdm",
        "model.attention=bidirectional", "model.label_shift=true", f"train.steps={MDM_STEPS}", "optim.lr=1e-3",
        "optim.warmup_steps=20"])
    trainer = Trainer(recipe, progress=False)
    trainer.save_model(root / "mdm-untrained")
    trainer.fit()
    kwargs = dict(data=root / "data" / "test.jsonl", max_new_tokens=40, batch_size=100, progress=False,
                  options=MaskedOptions(policy="top_u", reveal_count=2))
    before = evaluate_model(root / "mdm-untrained", **kwargs)["accuracy"]
    after = evaluate_model(root / "mdm", **kwargs)["accuracy"]
    floor = trivial_baseline(test)
    curve = _curve(root / "mdm")
    assert curve[-1] < 0.35 * curve[0]  # the min(1/t, 5)-weighted masked loss falls (3.6 → 0.7 in calibration)
    assert before <= floor
    # calibration run (same seed and config, 2 threads): 15.5 % vs untrained 0 % and trivial 7 %
    assert after >= floor + 0.03 and after >= before + 0.06, (
        f"MDM accuracy {after:.3f} (untrained {before:.3f}, trivial {floor:.3f})")
