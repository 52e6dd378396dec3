"""`--resume` never silently changes a run (issue 49): it continues the recipe recorded in the checkpoint, refuses a
different one naming every differing field, and `--extend-to` is the one explicit way to train a run further, its LR
schedule re-planned as documented in `dlm.training.resume`."""

import json
import subprocess
import sys

import pytest

from dlm import checkpoint as ckpt
from dlm.config import load_recipe
from dlm.errors import DlmError
from dlm.training.loop import Trainer, train
from tests.test_training import losses, small_recipe


def lrs(run_dir):
    return [json.loads(line)["lr"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_with_another_recipe_is_refused_naming_each_field_and_leaves_the_run_alone(tmp_path):
    data = tmp_path / "data"
    run = train(small_recipe(tmp_path / "run", data, "train.steps=4", "train.max_minutes=1e-9"), progress=False)
    recorded = (run / "recipe.yaml").read_text()
    assert ckpt.step_of(ckpt.latest(run / "checkpoints")) == 1
    assert (ckpt.latest(run / "checkpoints") / "recipe.yaml").read_text() == recorded  # the checkpoint records it
    with pytest.raises(DlmError) as e:
        train(small_recipe(run, data, "train.steps=12", "optim.lr=0.002"), resume=True, progress=False)
    message = str(e.value)
    assert "optim.lr: 0.001 in the run, 0.002 now" in message and "train.steps: 4 in the run, 12 now" in message
    assert f"dlm train {run / 'recipe.yaml'} --resume" in message
    assert "--extend-to" not in message  # more than the step count differs: a new run, not an extension
    assert (run / "recipe.yaml").read_text() == recorded and ckpt.step_of(ckpt.latest(run / "checkpoints")) == 1
    with pytest.raises(DlmError, match=r"train.steps: 4 in the run, 12 now.*add --extend-to 12"):
        train(small_recipe(run, data, "train.steps=12"), resume=True, progress=False)


def test_resume_from_the_recorded_recipe_equals_the_uninterrupted_run(tmp_path):
    """The README's path: a run stopped early (here by its time cap) continues from its own recipe.yaml; only the
    fields that do not change training may be overridden (the cap)."""
    data = tmp_path / "data"
    full = train(small_recipe(tmp_path / "full", data, "train.steps=6"), progress=False)
    cut = train(small_recipe(tmp_path / "cut", data, "train.steps=6", "train.max_minutes=1e-9"), progress=False)
    assert len(losses(cut)) == 1
    resumed = train(load_recipe(cut / "recipe.yaml", ["train.max_minutes=1000", "eval.test_n=5"]), resume=True,
                    progress=False)
    assert resumed == cut
    assert losses(cut) == pytest.approx(losses(full), abs=1e-6, rel=1e-6) and lrs(cut) == pytest.approx(lrs(full))
    assert json.loads((cut / "eval.json").read_text())["eval/n"] == 5


def test_extend_to_replans_the_schedule_as_documented_and_records_it(tmp_path, capsys):
    data = tmp_path / "data"
    planned = train(small_recipe(tmp_path / "planned", data, "train.steps=8"), progress=False)  # planned for 8
    short = train(small_recipe(tmp_path / "short", data, "train.steps=4"), progress=False)
    capsys.readouterr()
    train(small_recipe(short, data, "train.steps=4"), resume=True, progress=False)  # finished: nothing to do
    assert "already complete (4 of 4 updates); nothing to do" in capsys.readouterr().out
    assert len(losses(short)) == 4
    with pytest.raises(DlmError, match="--extend-to 3: .* is at update 4 already"):
        train(small_recipe(short, data, "train.steps=4"), resume=True, progress=False, extend_to=3)
    trainer = Trainer(small_recipe(short, data, "train.steps=4"), resume=True, progress=False, extend_to=8)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(lrs(planned)[3])  # update 5's rate, planned for 8
    del trainer
    train(small_recipe(short, data, "train.steps=4"), resume=True, progress=False, extend_to=8)
    out = capsys.readouterr().out
    assert "extending" in out and "from 4 to 8 updates at update 4" in out
    got, want = lrs(short), lrs(planned)
    assert got[:4] != pytest.approx(want[:4])  # the first segment followed the 4-update plan ...
    assert got[4:] == pytest.approx(want[4:])  # ... the extension follows the 8-update plan from update 5 on
    assert load_recipe(short / "recipe.yaml").train.steps == 8
    assert load_recipe(ckpt.latest(short / "checkpoints") / "recipe.yaml").train.steps == 8


def test_cli_extend_to_needs_resume(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "dlm.cli", "train", "recipes/tinymath/ar.yaml", "--out-dir",
                           str(tmp_path / "x"), "--extend-to", "10"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == "dlm train: --extend-to goes with --resume: it trains an existing " \
                                                   "run further"


def test_a_run_recorded_before_a_setting_existed_resumes_at_its_default(tmp_path):
    """A recipe recorded by an older dlm lacks the settings added since (issue 45's sampler options): read as this
    version reads it, each counts at its default, so the run resumes; set to something else, it is a difference."""
    import yaml

    data = tmp_path / "data"
    run = train(small_recipe(tmp_path / "run", data, "train.steps=3", "train.max_minutes=1e-9"), progress=False)
    for path in (run / "recipe.yaml", ckpt.latest(run / "checkpoints") / "recipe.yaml"):
        old = yaml.safe_load(path.read_text())
        for field in ("edit_budget", "sub_block_size"):  # as an older version recorded it
            old["eval"].pop(field)
        path.write_text(yaml.safe_dump(old))
    with pytest.raises(DlmError, match="eval.edit_budget: 4 in the run, 2 now"):
        train(small_recipe(run, data, "train.steps=3", "eval.edit_budget=2"), resume=True, progress=False)
    train(small_recipe(run, data, "train.steps=3"), resume=True, progress=False)
    assert len(losses(run)) == 3
