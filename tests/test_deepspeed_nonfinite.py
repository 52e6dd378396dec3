"""Under DeepSpeed (ZeRO-2 and ZeRO-3, 2 CPU processes) an update with a NaN/inf loss or gradient is really skipped:
the weights stay as they were, the optimizer takes no step, and the optimizer's step count, DeepSpeed's own count of
skipped steps and the LR schedule all follow the applied updates. Three kinds of poison, each on one rank only: a NaN
loss (its gradient NaN too), an inf gradient under a finite loss, and a NaN loss value over a finite gradient (which
the engine alone would apply). Skips when deepspeed is not installed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dlm.config import dump_recipe, load_recipe
from dlm.training.loop import lr_lambda
from tests.test_sharded import _free_port
from tests.test_training import small_recipe

pytestmark = pytest.mark.slow
pytest.importorskip("deepspeed")

POISONED = {2: ("loss", 1), 3: ("grad", 0), 4: ("value", 1)}  # update: (what is non-finite, on which rank)
UPDATES = 6

SCRIPT = '''
import json, os, sys
import torch
from dlm.config import load_recipe
from dlm.training import sharding
from dlm.training.loop import Trainer
from dlm.training.objectives.autoregressive import AutoregressiveObjective

RANK, POISONED = int(os.environ["RANK"]), {int(k): v for k, v in json.loads(sys.argv[3]).items()}
real, now = AutoregressiveObjective.loss, {"update": 0}


def loss(self, model, batch, plan=None):
    l_sum, n, m = real(self, model, batch, plan)
    what, rank = POISONED.get(now["update"], (None, None))
    if rank == RANK and what == "loss":
        l_sum = l_sum * float("nan")
    elif rank == RANK and what == "grad":  # the value stays finite
        l_sum.register_hook(lambda g: g * float("inf"))
    elif rank == RANK and what == "value":  # the gradient stays finite
        l_sum = l_sum + float("nan") * l_sum.detach()
    return l_sum, n, m


AutoregressiveObjective.loss = loss
trainer = Trainer(load_recipe(sys.argv[1]), progress=False)
engine, inner = trainer.model, sharding.torch_optimizer(trainer.optimizer)


def weights():  # this rank's copy (ZeRO-3: its partition) of every weight
    return torch.cat([getattr(p, "ds_tensor", p).detach().flatten().clone() for p in engine.module.parameters()])


trace = []
for update in range(1, int(sys.argv[4]) + 1):
    now["update"] = update
    before = weights()
    out = trainer.train_step()
    after = weights()
    trace.append({"changed": not torch.equal(before, after), "finite": bool(torch.isfinite(after).all()),
                  "adam_steps": sorted({int(s["step"]) for s in inner.state.values()}) or [0],
                  "scheduler": trainer.scheduler.last_epoch, "engine_skipped": int(engine.skipped_steps),
                  "lr": out["lr"], "skipped": out["skipped_updates"]})
with open(os.path.join(sys.argv[2], f"trace_rank{RANK}.json"), "w") as f:
    json.dump(trace, f)
'''


@pytest.mark.parametrize("stage", ["2", "3"])
def test_a_nonfinite_update_is_skipped_and_the_schedule_stays_in_step(tmp_path, stage):
    recipe = small_recipe(tmp_path / "run", tmp_path / "data", "train.batch_size=2", "train.grad_accum=2",
                          f"train.steps={UPDATES}", "train.checkpoint_every=100", "optim.warmup_steps=3")
    (tmp_path / "run.yaml").write_text(dump_recipe(recipe))
    (tmp_path / "poisoned.py").write_text(SCRIPT)
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--use_deepspeed", "--zero_stage",
           stage, "--zero3_init_flag", "false", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
           str(tmp_path / "poisoned.py"), str(tmp_path / "run.yaml"), str(tmp_path), json.dumps(POISONED),
           str(UPDATES)]
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}  # DeepSpeed refuses accelerate's cpu mode
    env |= {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"), str(Path(__file__).parents[1])])}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]

    traces = [json.loads((tmp_path / f"trace_rank{r}.json").read_text()) for r in (0, 1)]
    oc = load_recipe(tmp_path / "run.yaml").optim
    for trace in traces:
        applied = 0
        for update, t in enumerate(trace, start=1):
            skipped = update in POISONED
            applied += not skipped
            assert t["changed"] != skipped and t["finite"], (update, t)  # the weights moved iff the update applied
            assert t["skipped"] == update - applied
            assert t["adam_steps"] == [applied] and t["scheduler"] == applied, (update, t)  # in step, no drift
            assert t["engine_skipped"] == update - applied  # DeepSpeed itself counted the skipped steps
            assert t["lr"] == pytest.approx(oc.lr * lr_lambda(applied, oc.warmup_steps, UPDATES, oc.schedule,
                                                              oc.min_lr_ratio))
    assert [t["skipped"] for t in traces[0]] == [t["skipped"] for t in traces[1]]  # every rank took the same decisions
