"""Run several training jobs one after another inside one `accelerate launch` (the process group is kept, the
Trainer resets the accelerator per run), so the distributed tests pay for one launch per mode, not per objective.

    accelerate launch --multi_gpu --num_processes 2 tests/dist_driver.py JOBS.json

JOBS.json: a list of {"recipe": path, "resume": bool, "stop_after": step or null}. `stop_after` ends the job right
after the checkpoint of that step is written (an interruption at a checkpoint; the run continues with "resume")."""

from __future__ import annotations

import faulthandler
import json
import os
import sys

import torch.distributed as dist

from dlm.config import load_recipe
from dlm.training.loop import Trainer, train


class Interrupted(Exception):
    pass


def run(job: dict) -> None:
    stop = job.get("stop_after")
    original = Trainer.save_checkpoint

    def save_then_stop(self):
        out = original(self)
        if self.step == stop:
            raise Interrupted
        return out

    if stop:
        Trainer.save_checkpoint = save_then_stop
    try:
        train(load_recipe(job["recipe"]), resume=job.get("resume", False), progress=False)
    except Interrupted:
        pass
    finally:
        Trainer.save_checkpoint = original


def main(path: str) -> None:
    if os.environ.get("DLM_DRIVER_TIMEOUT"):  # a hung collective prints every thread's stack and exits
        faulthandler.dump_traceback_later(float(os.environ["DLM_DRIVER_TIMEOUT"]), exit=True)
    for job in json.loads(open(path).read()):
        run(job)
        if dist.is_initialized():
            dist.barrier()
    if dist.is_initialized():  # as `dlm train` does: teardown at interpreter exit once aborted a DeepSpeed rank
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
