"""The same loop under `accelerate launch --num_processes 2` (gloo, CPU): 2 processes × batch b follow the loss
trajectory of 1 process × batch 2b."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dlm.training.loop import train
from tests.test_training import losses, small_recipe

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one_process_with_double_batch(tmp_path):
    common = ["train.steps=6", "train.checkpoint_every=100", "data.n_test=4"]
    one = train(small_recipe(tmp_path / "one", tmp_path / "data", "train.batch_size=8", *common), progress=False)

    launcher = shutil.which("accelerate", path=os.path.dirname(sys.executable))
    assert launcher, "accelerate launcher not installed beside this python"
    overrides = [f"out_dir={tmp_path / 'two'}", "train.batch_size=4", *common]
    recipe = small_recipe(tmp_path / "two", tmp_path / "data", *overrides[1:])
    recipe_path = tmp_path / "two.yaml"
    from dlm.config import dump_recipe

    recipe_path.write_text(dump_recipe(recipe))
    cmd = [launcher, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
           "-m", "dlm.cli", "train", str(recipe_path), "--no-progress"]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    two = tmp_path / "two"
    ref, got = losses(one), losses(two)
    assert len(got) == len(ref) == 6
    assert got == pytest.approx(ref, rel=1e-4, abs=1e-5)
    # and the update is not trivially equal to some other run: the curve moved
    assert ref[0] != pytest.approx(ref[-1], rel=1e-3)
    meta = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    assert meta[-1]["step"] == 6
