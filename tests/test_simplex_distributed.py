"""Simplex and reward objectives under `accelerate launch --num_processes 2` (gloo, CPU): the reward model's updates
equal one process with the double batch; the simplex objective keeps its per-batch choices (self-conditioning, UL2
strategy) identical across ranks — otherwise one rank runs an extra forward and DDP's collectives fall out of step."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dlm.config import dump_recipe
from dlm.training.loop import train
from tests.test_distributed import _free_port
from tests.test_training import losses, small_recipe

pytestmark = pytest.mark.slow

EXTRA = {"reward": ["train.objective=reward", "data.preference_pairs=true"],
         "simplex": ["train.objective=simplex", "model.attention=bidirectional", "model.label_shift=true",
                     "simplex.masking=ul2", "simplex.timesteps=100", "eval.inference_steps=2"]}


def launch_two(recipe, tmp_path):
    launcher = shutil.which("accelerate", path=os.path.dirname(sys.executable))
    path = tmp_path / "two.yaml"
    path.write_text(dump_recipe(recipe))
    cmd = [launcher, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", str(_free_port()), "-m", "dlm.cli", "train", str(path),
           "--no-progress"]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.mark.parametrize("objective", ["reward", "simplex"])
def test_two_processes(tmp_path, objective):
    common = ["train.steps=4", "train.checkpoint_every=100", "data.n_test=4", *EXTRA[objective]]
    one = train(small_recipe(tmp_path / "one", tmp_path / "data", "train.batch_size=8", *common), progress=False)
    launch_two(small_recipe(tmp_path / "two", tmp_path / "data", "train.batch_size=4", *common), tmp_path)
    two = tmp_path / "two"
    records = {name: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
               for name, run in (("one", one), ("two", two))}
    assert len(records["two"]) == 4
    if objective == "reward":  # no randomness: the same updates
        assert losses(two) == pytest.approx(losses(one), rel=1e-4, abs=1e-5)
    else:  # the noise is per rank, the per-batch choices are shared
        for key in ("self_conditioned", "ul2/t5", "ul2/aggressive_t5", "ul2/prefix_lm"):
            assert [r.get(key) for r in records["two"]] == [r.get(key) for r in records["one"]]
        assert (two / "model" / "dlm.json").is_file()
