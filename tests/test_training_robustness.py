"""Training that meets trouble stops cleanly and loses nothing: NaN/inf updates are skipped and counted, a run of them
stops the run at its last good checkpoint; a checkpoint write that fails (a full disk) leaves the previous one as
`latest` and the run resumes from it; a checkpoint is resumed only by as many processes as wrote it."""

import errno
import json

import pytest
import torch

from dlm import checkpoint as ckpt
from dlm.cli import main
from dlm.errors import DlmError
from dlm.training.loop import Trainer, train
from dlm.training.objectives.autoregressive import AutoregressiveObjective
from tests.test_training import losses, small_recipe


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def poison(monkeypatch, updates, where="loss"):
    """Make the AR objective's loss (or, with where="grad", only its gradient) NaN during the given updates (1-based),
    counted by calls: one call per update here (grad_accum 1)."""
    real, calls = AutoregressiveObjective.loss, []

    def loss(self, model, batch, plan=None):
        calls.append(1)
        l_sum, n, m = real(self, model, batch, plan)
        if len(calls) in updates:
            if where == "loss":
                l_sum = l_sum * float("nan")
            else:
                l_sum.register_hook(lambda g: g * float("inf"))
        return l_sum, n, m

    monkeypatch.setattr(AutoregressiveObjective, "loss", loss)


def weights(trainer):
    return torch.cat([p.detach().flatten().clone() for p in trainer.model.parameters()])


@pytest.mark.parametrize("where", ["loss", "grad"])
def test_nonfinite_update_is_skipped_and_counted(tmp_path, monkeypatch, where):
    poison(monkeypatch, {2, 3}, where)
    recipe = small_recipe(tmp_path / "run", tmp_path / "data", "train.steps=5", "train.log_every=5",
                          "train.checkpoint_every=100", "train.ema_decay=0.5", "data.n_test=2")
    trainer = Trainer(recipe, progress=False)
    steps = []
    real_step = trainer.train_step

    def observed():
        before = (weights(trainer), trainer.scheduler.last_epoch, trainer.ema.shadow["backbone.lm_head.weight"].clone())
        out = real_step()
        after = (weights(trainer), trainer.scheduler.last_epoch, trainer.ema.shadow["backbone.lm_head.weight"].clone())
        steps.append((before, after))
        return out

    trainer.train_step = observed
    trainer.fit()
    for i, ((w0, s0, e0), (w1, s1, e1)) in enumerate(steps, start=1):
        skipped = i in (2, 3)
        assert torch.equal(w0, w1) == skipped and (s1 == s0) == skipped and torch.equal(e0, e1) == skipped
        assert torch.isfinite(w1).all()
    assert all(p.grad is None for p in trainer.model.parameters())
    log = {r["step"]: r for r in records(tmp_path / "run")}
    assert sorted(log) == [2, 3, 5]  # skipped updates are always logged
    assert (log[2]["skipped_updates"], log[2]["skipped_in_a_row"]) == (1, 1)
    assert (log[3]["skipped_updates"], log[3]["skipped_in_a_row"]) == (2, 2)
    assert (log[5]["skipped_updates"], log[5]["skipped_in_a_row"]) == (2, 0)
    assert "grad_norm" not in log[2] and "grad_norm" in log[5]
    state = torch.load(ckpt.latest(tmp_path / "run" / "checkpoints") / "trainer.pt", weights_only=False)
    assert state["skipped_updates"] == 2 and state["scheduler"]["last_epoch"] == 3  # 5 steps, 3 updates


def test_a_run_of_nonfinite_updates_stops_at_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    poison(monkeypatch, set(range(4, 100)))  # every update from the 4th on
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  max_nonfinite_updates: 3\n")
    sets = [f"out_dir={tmp_path / 'run'}", f"data.dir={tmp_path / 'data'}", "data.level=easy", "data.n_train=100",
            "data.n_validation=4", "data.n_test=4", "model.preset=nano", "model.vocab_size=300",
            "model.max_length=128", "train.steps=20", "train.batch_size=4", "train.log_every=1",
            "train.checkpoint_every=3"]
    with pytest.raises(SystemExit) as e:
        main(["train", str(recipe), "--no-progress", *[a for s in sets for a in ("--set", s)]])
    assert e.value.code == 2
    run = tmp_path / "run"
    last = ckpt.latest(run / "checkpoints")
    assert capsys.readouterr().err.splitlines() == [
        f"dlm train: stopped at step 6: 3 updates in a row had a NaN/inf loss or gradient and were skipped "
        f"(train.max_nonfinite_updates: 3); the last checkpoint, {last}, is kept; check the data or lower optim.lr"]
    assert last.name == "step_0000003"  # step 6's checkpoint was not written in the middle of skipped updates
    assert not (run / "model").exists()
    log = records(run)
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6] and log[-1]["skipped_in_a_row"] == 3


def test_full_disk_during_a_checkpoint_keeps_the_previous_one_and_resume_continues(tmp_path, monkeypatch):
    recipe = small_recipe(tmp_path / "run", tmp_path / "data", "data.n_test=2")  # 12 steps, checkpoints at 4 and 8
    real_save = torch.save

    def full_disk(obj, path, *args, **kwargs):
        if "step_0000008" in str(path) and str(path).endswith("trainer.pt"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    root = tmp_path / "run" / "checkpoints"
    with pytest.raises(DlmError) as e:
        train(recipe, progress=False)
    message = str(e.value)
    assert message.startswith(f"checkpoint of step 8 not written to {root}: [Errno 28] No space left on device: ")
    assert message.endswith(f"{root / 'step_0000004'} is still the latest; free some space and rerun with --resume")
    assert ckpt.latest(root).name == "step_0000004" and (root / "latest").read_text() == "step_0000004"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_0000004"]  # no half-written folder left
    first = losses(tmp_path / "run")
    assert len(first) == 8

    monkeypatch.setattr(torch, "save", real_save)
    train(recipe, resume=True, progress=False)
    got = losses(tmp_path / "run")
    assert len(got) == 12 and got[4:8] == pytest.approx(first[4:8], abs=1e-6, rel=1e-6)


def test_resume_with_another_number_of_processes_is_refused(tmp_path):
    recipe = small_recipe(tmp_path / "run", tmp_path / "data", "train.steps=4", "data.n_test=2")
    train(recipe, progress=False)
    last = ckpt.latest(tmp_path / "run" / "checkpoints")
    state = torch.load(last / "trainer.pt", weights_only=False)
    assert state["world_size"] == 1
    state["world_size"] = 2
    torch.save(state, last / "trainer.pt")
    refusal = (f"{last}: written by 2 process(es), this run has 1; resume with 2 (e.g. accelerate launch "
               f"--num_processes 2 ...), or start a new run from its weights: --set model.init_from={last / 'model'} "
               f"with another out_dir")
    with pytest.raises(DlmError) as e:
        Trainer(recipe, resume=True, progress=False)
    assert str(e.value) == refusal
    del state["world_size"]  # a checkpoint from before the world size was recorded: its rank files count
    torch.save(state, last / "trainer.pt")
    for name in ("data", "rng"):
        (last / f"{name}_rank1.pt").write_bytes((last / f"{name}_rank0.pt").read_bytes())
    with pytest.raises(DlmError) as e:
        Trainer(recipe, resume=True, progress=False)
    assert str(e.value) == refusal


def test_resume_without_a_checkpoint_says_it_starts_fresh(tmp_path, capsys):
    trainer = Trainer(small_recipe(tmp_path / "run", tmp_path / "data", "train.steps=2"), resume=True, progress=False)
    assert trainer.step == 0
    assert f"--resume: no complete checkpoint in {tmp_path / 'run' / 'checkpoints'}; starting fresh" in (
        capsys.readouterr().out.splitlines())
