"""Under `accelerate launch --num_processes 2` every rank takes the same skip decision: a NaN loss on rank 1 only
(its gradient finite, so DDP's all-reduce cannot spread it) makes rank 0 skip that update too."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dlm.config import dump_recipe
from tests.test_sharded import _free_port
from tests.test_training import small_recipe

pytestmark = pytest.mark.slow

SCRIPT = '''
import os, sys
from dlm.training.objectives.autoregressive import AutoregressiveObjective

real, calls = AutoregressiveObjective.loss, []


def loss(self, model, batch, plan=None):
    calls.append(1)
    l_sum, n, m = real(self, model, batch, plan)
    if len(calls) == 2 and os.environ["RANK"] == "1":  # update 2, rank 1: the value is NaN, its gradient is not
        l_sum = l_sum + float("nan") * l_sum.detach()
    return l_sum, n, m


AutoregressiveObjective.loss = loss
from dlm.cli import main

main(sys.argv[1:])
'''


def test_a_nan_on_one_rank_is_skipped_by_every_rank(tmp_path):
    launcher = shutil.which("accelerate", path=os.path.dirname(sys.executable))
    assert launcher, "accelerate launcher not installed beside this python"
    recipe = small_recipe(tmp_path / "two", tmp_path / "data", "train.batch_size=4", "train.steps=4",
                          "train.checkpoint_every=100", "data.n_test=4")
    (tmp_path / "two.yaml").write_text(dump_recipe(recipe))
    (tmp_path / "poisoned.py").write_text(SCRIPT)
    cmd = [launcher, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", str(_free_port()), str(tmp_path / "poisoned.py"),
           "train", str(tmp_path / "two.yaml"), "--no-progress"]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    log = {r["step"]: r for r in map(json.loads, (tmp_path / "two" / "metrics.jsonl").read_text().splitlines())}
    assert math.isnan(log[2]["loss"]) and (log[2]["skipped_updates"], log[2]["skipped_in_a_row"]) == (1, 1)
    assert all(math.isfinite(log[s]["loss"]) and log[s]["skipped_in_a_row"] == 0 for s in (1, 3, 4))
    assert log[4]["skipped_updates"] == 1
