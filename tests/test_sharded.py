"""Every objective under 2 CPU processes (gloo), DDP and FSDP2 (full shard): 2 processes × batch b follow 1 process ×
2b step by step (global loss-token normalisation, split-invariant noise); FSDP2 saves the gathered (EMA) model and
resumes exactly from per-rank shards; DDP resumes exactly; PU resumes mid-trajectory under 2 processes.

One `accelerate launch` per mode runs all its jobs (`tests/dist_driver.py`); the 1-process references run here."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dlm.config import dump_recipe
from dlm.training.loop import train
from tests.test_training import losses, small_recipe

pytestmark = pytest.mark.slow

OBJECTIVES = {
    "ar": [],
    "mdm": ["train.objective=mdm", "model.attention=bidirectional"],
    "block-mdm": ["train.objective=mdm", "model.attention=block_causal", "model.block_size=16",
                  "model.label_shift=true"],
    "pu-w1": ["train.objective=pu", "model.attention=bidirectional"],
    "pu-w2-carry": ["train.objective=pu", "model.attention=bidirectional", "progressive.carry=true",
                    "progressive.window=2", "progressive.carry_drop_prob=0.5"],
    # two chunks of the pool (PU+ pool_factor) advanced by two accumulated micro-batches
    "pu-chunks": ["train.objective=pu", "model.attention=bidirectional", "progressive.pool_factor=2",
                  "train.grad_accum=2"],
    "block-pu": ["train.objective=pu", "model.attention=block_causal", "model.block_size=16", "progressive.carry=true",
                 "progressive.window=2"],
    "simplex": ["train.objective=simplex", "model.attention=bidirectional", "model.label_shift=true",
                "simplex.masking=ul2", "simplex.timesteps=100", "eval.inference_steps=2"],
    "reward": ["train.objective=reward", "data.preference_pairs=true"],
}
COMMON = ["train.steps=3", "train.checkpoint_every=100", "data.n_test=2"]


def _grpo(one: Path) -> list[str]:
    """GRPO (DDP; FSDP2 rolls out on a gathered copy) from the 1-process MDM, rewarded by the 1-process reward model;
    2 processes x 2 prompts x G = 2 completions against 1 process x 4 prompts. The rollouts, masks and rewards of a
    prompt are keyed by its place in the global stream, so both layouts sample, score and normalise the same rows.
    The layouts' weights differ by float noise after an update, and Adam amplifies it: a weight whose gradient is
    noise (the group's +A and -A terms cancel in it) moves by up to ~lr, differently per layout. Sampling at
    temperature 1 turns a large enough difference into different rollouts from the second update on (seen with lr
    1e-3 on one CPU type, not on another), after which the runs legitimately part. So these runs take small steps
    (lr 1e-5, eps 1e-6), which keeps the weights within ~1e-8 and the rollouts equal; the loss, the advantages'
    normalisation and the gradient reduction are compared at three updates as for the other objectives."""
    return ["train.objective=grpo", "model.attention=bidirectional", f"model.init_from={one / 'mdm' / 'model'}",
            "optim.lr=1e-5", "optim.eps=1e-6",
            "rl.group_size=2", "rl.reference=frozen", "rl.max_new_tokens=8", "rl.estimator=elbo",
            f"rl.reward=[{{name: reward_model, path: {one / 'reward' / 'model'}}}]", "eval.policy=top_u"]
# resume: EMA on (its shards are checkpointed too); PU: W=2 windows with the carry, trajectories mid-way at step 2
RESUME = {"ema": ["train.objective=mdm", "model.attention=bidirectional", "train.ema_decay=0.5"],
          "pu": OBJECTIVES["pu-w2-carry"]}
RESUME_COMMON = ["train.steps=4", "train.checkpoint_every=2", "data.n_test=2"]
MODES = {"ddp": ["--multi_gpu"], "fsdp": ["--use_fsdp", "--fsdp_version", "2"],
         # hybrid sharding: recipes/accelerate/fsdp2-hsdp.yaml itself, scaled to 2 replicas of a 1-way shard
         "hsdp": ["--config_file", "{workdir}/fsdp2-hsdp.yaml"]}


def _hsdp_config(workdir: Path) -> None:
    import yaml

    cfg = yaml.safe_load((Path(__file__).parents[1] / "recipes" / "accelerate" / "fsdp2-hsdp.yaml").read_text())
    cfg.update(num_machines=1, num_processes=2, use_cpu=True)
    cfg["parallelism_config"].update(parallelism_config_dp_replicate_size=2, parallelism_config_dp_shard_size=1)
    (workdir / "fsdp2-hsdp.yaml").write_text(yaml.safe_dump(cfg))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(mode: str, jobs: list[dict], workdir: Path) -> None:
    launcher = shutil.which("accelerate", path=os.path.dirname(sys.executable))
    assert launcher, "accelerate launcher not installed beside this python"
    (workdir / f"{mode}.json").write_text(json.dumps(jobs))
    if mode == "hsdp":
        _hsdp_config(workdir)
    cmd = [launcher, "launch", *(a.format(workdir=workdir) for a in MODES[mode]), "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port()),
           str(Path(__file__).with_name("dist_driver.py")), str(workdir / f"{mode}.json")]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1",
           "DLM_DRIVER_TIMEOUT": "500",  # a hung collective prints the stacks and ends the launch
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"), str(Path(__file__).parents[1])])}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def _job(root: Path, data: Path, name: str, *extra, **job) -> dict:
    recipe = small_recipe(root / name, data, "train.batch_size=4", *extra)
    path = root / f"{name}.yaml"
    path.write_text(dump_recipe(recipe))
    return {"recipe": str(path), **job}


class Runs:
    """The runs, made when a test first reads them: `runs / "one" / name` trains that 1-process reference and
    `runs / mode` launches all of that mode's jobs (one launch per mode), so a selection (`-k fsdp`) pays only for the
    runs it reads. A run that failed fails every test that reads it, with the same error."""

    def __init__(self, root: Path):
        self.root, self.made = root, {}

    def _make(self, key, make):
        if key not in self.made:
            try:
                make()
                self.made[key] = None
            except BaseException as err:  # noqa: BLE001 (re-raised here and for every later reader)
                self.made[key] = err
        if self.made[key] is not None:
            raise self.made[key]

    def __truediv__(self, part: str):
        if part == "one":
            return _References(self)
        self / "one" / "ar"  # the 1-process runs write the shared data first, as they always did
        if part in ("ddp", "fsdp"):  # GRPO's policy and reward model
            self / "one" / "mdm", self / "one" / "reward"
        self._make(part, lambda: _launch_mode(self.root, part))
        return self.root / part


class _References:
    def __init__(self, runs: Runs):
        self.runs = runs

    def __truediv__(self, name: str) -> Path:
        root, data = self.runs.root / "one", self.runs.root / "data"
        if name == "ema":
            recipe = small_recipe(root / "ema", data, "train.batch_size=8", *RESUME_COMMON, *RESUME["ema"])
        elif name == "grpo":
            self / "mdm", self / "reward"  # its policy and its reward model
            recipe = small_recipe(root / name, data, "train.batch_size=8", *COMMON, *_grpo(root))
        else:
            recipe = small_recipe(root / name, data, "train.batch_size=8", *COMMON, *OBJECTIVES[name])
        self.runs._make(("one", name), lambda: train(recipe, progress=False))
        return root / name


def _launch_mode(root: Path, mode: str) -> None:  # 2 processes × b
    data, out = root / "data", root / mode
    out.mkdir()
    if mode == "hsdp":  # the mesh, not the objectives, is under test: one objective and one checkpoint
        launch(mode, [_job(out, data, "ar", *COMMON), _job(out, data, "ema-full", *RESUME_COMMON, *RESUME["ema"])],
               out)
        return
    jobs = [_job(out, data, name, *COMMON, *extra) for name, extra in OBJECTIVES.items()]
    if mode in ("ddp", "fsdp"):
        jobs.append(_job(out, data, "grpo", *COMMON, *_grpo(root / "one")))
    if mode == "fsdp":  # bf16: shards gathered as bf16 copies (MixedPrecisionPolicy), gradients reduced in fp32
        jobs.append(_job(out, data, "mdm-bf16", *COMMON, *OBJECTIVES["mdm"], "train.precision=bf16"))
    for name, extra in RESUME.items():
        if mode == "fsdp" and name == "pu":
            continue
        jobs += [_job(out, data, f"{name}-full", *RESUME_COMMON, *extra),
                 _job(out, data, f"{name}-resumed", *RESUME_COMMON, *extra, stop_after=2),
                 _job(out, data, f"{name}-resumed", *RESUME_COMMON, *extra, resume=True)]
    launch(mode, jobs, out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("sharded"))


def grad_norms(run: Path) -> list[float]:
    return [json.loads(line)["grad_norm"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "model" / "model.safetensors")


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.parametrize("mode,objective", [(m, o) for m in ("ddp", "fsdp") for o in OBJECTIVES]
                         + [("hsdp", "ar"), ("ddp", "grpo"), ("fsdp", "grpo")])
def test_two_processes_match_one_process_with_double_batch(runs, mode, objective):
    ref, got = losses(runs / "one" / objective), losses(runs / mode / objective)
    assert len(got) == len(ref) == 3
    assert got == pytest.approx(ref, rel=1e-4, abs=1e-5)
    assert ref[0] != pytest.approx(ref[-1], rel=1e-3)  # the runs moved: equal curves are not trivially equal
    # AdamW is blind to a constant gradient scale; the pre-clipping gradient norm is not
    assert grad_norms(runs / mode / objective) == pytest.approx(grad_norms(runs / "one" / objective), rel=1e-4)
    two, one = weights(runs / mode / objective), weights(runs / "one" / objective)
    # The Bradley-Terry loss is blind to the reward head's bias: its gradient is float noise, which Adam's
    # normalisation turns into updates of up to ~lr. Every other weight follows the 1-process run closely.
    two.pop("dlm_reward_head.bias", None), one.pop("dlm_reward_head.bias", None)
    assert max_diff(two, one) < 5e-5
    if objective == "grpo":  # its small steps: the layouts agree to a thousandth of how far the policy moved
        assert max_diff(two, one) < 1e-3 * max_diff(one, weights(runs / "one" / "mdm"))


@pytest.mark.parametrize("mode,name", [("ddp", "ema"), ("fsdp", "ema"), ("ddp", "pu")])
def test_resume_at_a_checkpoint_equals_uninterrupted(runs, mode, name):
    full, resumed = runs / mode / f"{name}-full", runs / mode / f"{name}-resumed"
    assert len(losses(full)) == 4
    assert losses(resumed) == losses(full)  # exact: same shards, same noise, same reductions
    assert max_diff(weights(resumed), weights(full)) == 0.0
    step2 = resumed / "checkpoints" / "step_0000002"
    if mode == "fsdp":  # the optimizer, weights and EMA were checkpointed as each rank's shards
        shards = [torch.load(step2 / f"shards_rank{r}.pt", weights_only=False) for r in (0, 1)]
        emb = "backbone.model.embed_tokens.weight"
        assert shards[0]["model"][emb].shape[0] * 2 == weights(full)[emb.removeprefix("backbone.")].shape[0]
        assert shards[0]["optimizer"]["state"] and shards[0]["ema"]
    if name == "pu":  # the interruption fell in the middle of trajectories that carry a hidden state
        for r in (0, 1):
            pool = torch.load(step2 / f"data_rank{r}.pt", weights_only=False)["objective"]["pool"]
            assert (pool["steps"] > 0).any() and (~pool["done"]).all() and pool["carry"].abs().sum() > 0


def test_fsdp_saves_the_gathered_ema_model_of_one_process(runs):
    one, two = weights(runs / "one" / "ema"), weights(runs / "fsdp" / "ema-full")
    assert max_diff(two, one) < 5e-5
    live = load_file(runs / "fsdp" / "ema-full" / "checkpoints" / "step_0000004" / "model" / "model.safetensors")
    assert max_diff(two, live) > 5e-4  # the saved model is the average, not the live weights


def test_hybrid_sharding_replicates_across_the_replica_dimension(runs):
    """Under fsdp2-hsdp's parallelism_config the mesh is (replicate, shard): with a 1-way shard every rank's shard is
    the whole tensor (under plain FSDP2 each rank holds half), and the EMA model still equals one process's."""
    step2 = runs / "hsdp" / "ema-full" / "checkpoints" / "step_0000002"
    emb = "backbone.model.embed_tokens.weight"
    full = weights(runs / "hsdp" / "ema-full")[emb.removeprefix("backbone.")]
    for r in (0, 1):
        assert torch.load(step2 / f"shards_rank{r}.pt", weights_only=False)["model"][emb].shape == full.shape
    assert max_diff(weights(runs / "hsdp" / "ema-full"), weights(runs / "one" / "ema")) < 5e-5


def test_fsdp_in_bf16_follows_the_fp32_run(runs):
    """bf16 gathers and autocast change the numbers by bf16 rounding, not the update: the curve stays within 1 % of
    the fp32 one-process run (a wrong reduction dtype or scale would move it by far more)."""
    ref, got = losses(runs / "one" / "mdm"), losses(runs / "fsdp" / "mdm-bf16")
    assert got == pytest.approx(ref, rel=1e-2) and got != pytest.approx(ref, rel=1e-6)
