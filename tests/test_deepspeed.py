"""DeepSpeed ZeRO-2 and ZeRO-3 through `accelerate launch --use_deepspeed` on 2 CPU processes (DeepSpeed's CPU
accelerator, gloo): 2 processes × batch b follow 1 process × 2b step by step with accumulation, the gathered model is
saved, and a run resumes exactly from DeepSpeed's per-rank checkpoint. Skips when deepspeed is not installed.

One launch per ZeRO stage runs all its jobs (`tests/dist_driver.py`); the 1-process references run here."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dlm.config import dump_recipe
from dlm.training.loop import train
from tests import test_sharded as sharded
from tests.test_sharded import OBJECTIVES, _free_port, max_diff, weights
from tests.test_training import losses, small_recipe

pytestmark = pytest.mark.slow
pytest.importorskip("deepspeed")

STAGES = {"zero2": "2", "zero3": "3"}
# ZeRO-3 partitions every weight; objectives that read a weight outside a module's forward are listed where they run
RUN = {"zero2": list(OBJECTIVES), "zero3": ["ar", "mdm", "block-mdm"]}  # the others are refused (see the loop)
COMMON = ["train.steps=3", "train.checkpoint_every=100", "data.n_test=2", "train.grad_accum=2"]
RESUME_COMMON = ["train.steps=4", "train.checkpoint_every=2", "data.n_test=2"]
RESUME = {"zero2": ["train.objective=mdm", "model.attention=bidirectional", "train.ema_decay=0.5"],
          "zero3": ["train.objective=mdm", "model.attention=bidirectional"]}


def launch(stage: str, jobs: list[dict], workdir: Path) -> None:
    (workdir / "jobs.json").write_text(json.dumps(jobs))
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--use_deepspeed", "--zero_stage",
           STAGES[stage], "--zero3_save_16bit_model", "true", "--zero3_init_flag", "false", "--num_processes", "2",
           "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
           str(Path(__file__).with_name("dist_driver.py")), str(workdir / "jobs.json")]
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}  # DeepSpeed refuses accelerate's cpu mode
    env |= {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "DLM_DRIVER_TIMEOUT": "400",
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"), str(Path(__file__).parents[1])])}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def _job(root: Path, data: Path, name: str, *extra, **job) -> dict:
    path = root / f"{name}.yaml"
    path.write_text(dump_recipe(small_recipe(root / name, data, "train.batch_size=2", *extra)))
    return {"recipe": str(path), **job}


class Runs(sharded.Runs):
    """Made when first read, as in tests/test_sharded.py: `runs / "one" / name` (1 process × 2b × the same
    accumulation) and `runs / stage` (one launch per stage, its objectives and its resume jobs)."""

    def __truediv__(self, part: str):
        if part == "one":
            return _References(self)
        self / "one" / "ar"  # the 1-process runs write the shared data first
        self._make(part, lambda: _launch_stage(self.root, part))
        return self.root / part


class _References(sharded._References):
    def __truediv__(self, name: str) -> Path:
        root, data = self.runs.root / "one", self.runs.root / "data"
        recipe = small_recipe(root / name, data, "train.batch_size=4", *COMMON, *OBJECTIVES[name])
        self.runs._make(("one", name), lambda: train(recipe, progress=False))
        return root / name


def _launch_stage(root: Path, stage: str) -> None:
    data, out = root / "data", root / stage
    out.mkdir()
    jobs = [_job(out, data, name, *COMMON, *OBJECTIVES[name]) for name in RUN[stage]]
    jobs += [_job(out, data, "full", *RESUME_COMMON, *RESUME[stage]),
             _job(out, data, "resumed", *RESUME_COMMON, *RESUME[stage], stop_after=2),
             _job(out, data, "resumed", *RESUME_COMMON, *RESUME[stage], resume=True)]
    launch(stage, jobs, out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("deepspeed"))


@pytest.mark.parametrize("stage,objective", [(s, o) for s in STAGES for o in RUN[s]])
def test_two_processes_match_one_process_with_double_batch(runs, stage, objective):
    ref, got = losses(runs / "one" / objective), losses(runs / stage / objective)
    assert len(got) == len(ref) == 3
    assert got == pytest.approx(ref, rel=1e-4, abs=1e-5)
    assert ref[0] != pytest.approx(ref[-1], rel=1e-3)  # the runs moved
    two, one = weights(runs / stage / objective), weights(runs / "one" / objective)
    two.pop("dlm_reward_head.bias", None), one.pop("dlm_reward_head.bias", None)  # see tests/test_sharded.py
    assert max_diff(two, one) < 5e-5  # the saved (for ZeRO-3: gathered) model is the 1-process model


@pytest.mark.parametrize("stage", list(STAGES))
def test_resume_at_a_checkpoint_equals_uninterrupted(runs, stage):
    full, resumed = runs / stage / "full", runs / stage / "resumed"
    assert len(losses(full)) == 4
    assert losses(resumed) == losses(full)
    assert max_diff(weights(resumed), weights(full)) == 0.0
    ds = resumed / "checkpoints" / "step_0000002" / "deepspeed" / "state"
    assert sorted(p.name for p in ds.glob("*optim_states.pt")) == [  # each rank wrote its own partition
        f"{'bf16_' if False else ''}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]
