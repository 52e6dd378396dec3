"""The training loop: schedule, exact resume (including a crash while a checkpoint is being written), atomic
checkpoints, EMA, and the AR objective's loss."""

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from dlm import checkpoint as ckpt
from dlm.config import load_recipe
from dlm.training.loop import lr_lambda, train


def small_recipe(out_dir, data_dir, *extra):
    return load_recipe(None, [
        f"out_dir={out_dir}", f"data.dir={data_dir}", "data.level=easy", "data.n_train=300", "data.n_validation=10",
        "data.n_test=10", "model.preset=nano", "model.vocab_size=300", "model.max_length=128", "train.steps=12",
        "train.batch_size=8", "train.log_every=1", "train.checkpoint_every=4", "optim.warmup_steps=3",
        "eval.max_new_tokens=8", "eval.batch_size=10", *extra])


def losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_lr_schedule():
    f = lambda s: lr_lambda(s, warmup=10, total=110, schedule="cosine", min_ratio=0.1)  # noqa: E731
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.55) and f(110) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(10, 110))
    assert lr_lambda(50, 10, 110, "constant", 0.0) == 1.0


def test_checkpoint_latest_skips_incomplete(tmp_path):
    root = tmp_path / "ck"
    tmp = ckpt.begin(root, 4)
    (tmp / "x").write_text("a")
    ckpt.commit(root, tmp, 4, keep=2)
    half = ckpt.begin(root, 8)  # never committed: a crash mid-write
    (half / "x").write_text("partial")
    assert ckpt.latest(root) == root / "step_0000004"
    (root / "step_0000012").mkdir()  # a folder without COMPLETE is never picked
    assert ckpt.latest(root) == root / "step_0000004"


RESUME_CASES = {
    "autoregressive": (),
    "mdm": ("train.objective=mdm", "model.attention=bidirectional"),
    # PUMBA: trajectories (u=2 over ~40-token responses) are mid-way at the step-4 checkpoint; carry and W=2 windows
    "pu": ("train.objective=pu", "model.attention=bidirectional", "progressive.carry=true", "progressive.window=2",
           "progressive.carry_drop_prob=0.5"),
    # block diffusion: vectorised block MDM, and block PUMBA (blocks of 16, u=4, carry, W=2) mid-trajectory
    "block-mdm": ("train.objective=mdm", "model.attention=block_causal", "model.block_size=16",
                  "model.label_shift=true"),
    "block-pu": ("train.objective=pu", "model.attention=block_causal", "model.block_size=16", "model.label_shift=true",
                 "progressive.reveal_count=4", "progressive.threshold=null", "progressive.carry=true",
                 "progressive.window=2"),
}


def crash_at_commit(step: int) -> None:
    """Make this process die (exit code 17) when it is about to commit the checkpoint of `step`: a crash in the
    middle of writing it, injected here rather than read by the library."""
    real = ckpt.commit

    def commit(root, tmp, at, keep):
        if at == step:
            os._exit(17)
        return real(root, tmp, at, keep)

    ckpt.commit = commit


@pytest.mark.parametrize("objective", list(RESUME_CASES))
def test_resume_after_crash_during_checkpoint_equals_uninterrupted(tmp_path, objective):
    data = tmp_path / "data"
    extra = RESUME_CASES[objective]
    full = train(small_recipe(tmp_path / "full", data, *extra), progress=False)
    reference = losses(full)
    assert len(reference) == 12

    # Crash (os._exit) while writing the step-8 checkpoint, in a separate process: every file is written, the
    # commit (COMPLETE marker, rename, `latest`) never happens.
    code = (f"import torch; torch.set_num_threads({torch.get_num_threads()}); "  # same float reductions as here
            f"from tests.test_training import crash_at_commit, small_recipe; from dlm.training.loop import train; "
            f"crash_at_commit(8); "
            f"train(small_recipe({str(tmp_path / 'crash')!r}, {str(data)!r}, *{extra!r}), progress=False)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(__file__)),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 17, proc.stderr[-2000:]
    crashed = tmp_path / "crash"
    assert ckpt.latest(crashed / "checkpoints").name == "step_0000004"
    assert not (crashed / "model").exists()

    resumed = train(small_recipe(crashed, data, *extra), resume=True, progress=False)
    got = losses(resumed)
    assert len(got) == 12
    assert got == pytest.approx(reference, abs=1e-6, rel=1e-6)
    assert not list((crashed / "checkpoints").glob(".tmp-*"))  # the half-written folder was cleaned up


def test_ema_and_final_model(tmp_path):
    from dlm.modeling.build import load_model

    run = train(small_recipe(tmp_path / "ema", tmp_path / "data", "train.ema_decay=0.5", "train.steps=4"),
                progress=False)
    final = load_model(run / "model")
    trainer_state = torch.load(ckpt.latest(run / "checkpoints") / "trainer.pt", weights_only=False)
    shadow = trainer_state["ema"]["shadow"]
    w = final.backbone.state_dict()["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(w, shadow["backbone.model.layers.0.mlp.up_proj.weight"])
    raw = load_model(ckpt.latest(run / "checkpoints") / "model")
    assert not torch.equal(w, raw.backbone.state_dict()["model.layers.0.mlp.up_proj.weight"])
    assert (run / "eval.json").is_file() and (run / "model" / "tokenizer.json").is_file()


def test_ar_loss_covers_response_and_first_eos_only(tiny_tokenizer):
    from dlm.data.canvas import Example, collate
    from dlm.training.objectives.autoregressive import AutoregressiveObjective
    from tests.conftest import tiny_model

    m = tiny_model(len(tiny_tokenizer))
    b = collate([Example([5, 6, 7], [8, 9]), Example([5], [8, 9, 10, 11])], eos_id=1, pad_id=0)
    loss_sum, count, _ = AutoregressiveObjective().loss(m, b)
    assert int(count) == (2 + 1) + (4 + 1)
    with torch.no_grad():
        logits = m(b["input_ids"])
    ref, n = 0.0, 0
    for i in range(2):
        for pos in range(1, b["input_ids"].shape[1]):
            if b["loss_mask"][i, pos]:
                ref += torch.nn.functional.cross_entropy(logits[i, pos - 1], b["input_ids"][i, pos]).item()
                n += 1
    assert n == int(count) and loss_sum.item() == pytest.approx(ref, rel=1e-5)


def test_bad_recipe_fails_before_work(tmp_path, capsys):
    from dlm.cli import main

    p = tmp_path / "r.yaml"
    p.write_text("train:\n  steps: -1\n")
    with pytest.raises(SystemExit) as e:
        main(["train", str(p), "--out-dir", str(tmp_path / "never")])
    assert e.value.code == 2 and "r.yaml: train.steps" in capsys.readouterr().err
    assert not (tmp_path / "never").exists()


def test_gradient_accumulation_matches_full_batch(tmp_path):
    """batch 8 × 1 micro-batch and batch 4 × 2 micro-batches take the same updates: the loss is normalised by the
    positions in the loss over the whole update, not per micro-batch."""
    common = ["train.steps=5", "train.checkpoint_every=100", "data.n_test=2"]
    full = train(small_recipe(tmp_path / "full", tmp_path / "data", "train.batch_size=8", *common), progress=False)
    accum = train(small_recipe(tmp_path / "acc", tmp_path / "data", "train.batch_size=4", "train.grad_accum=2",
                               *common), progress=False)
    assert losses(accum) == pytest.approx(losses(full), rel=1e-5, abs=1e-6)


def test_bf16_trains(tmp_path):
    run = train(small_recipe(tmp_path / "bf16", tmp_path / "data", "train.precision=bf16", "train.steps=8",
                             "optim.lr=3e-3", "data.n_test=2"), progress=False)
    got = losses(run)
    assert all(math.isfinite(x) for x in got) and got[-1] < got[0]


def test_train_from_local_hf_checkpoint_on_jsonl(tmp_path, tiny_tokenizer):
    """The user path: any local HF causal LM + its tokenizer (here one without a mask token), trained on jsonl."""
    from transformers import PreTrainedTokenizerFast

    from dlm.modeling.backbone import build_backbone
    from dlm.modeling.build import load_model

    bare = PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer.backend_tokenizer, eos_token="<|eos|>",
                                   pad_token="<|pad|>")
    hf = build_backbone("qwen2", "nano", len(bare) - 1, 128, "causal")  # one row short: resized on load
    hf.save_pretrained(tmp_path / "hf")
    bare.save_pretrained(tmp_path / "hf")
    rows = [{"prompt": f"Ann has {i} cats. How many?", "response": f"def solution():\n    return {i}"}
            for i in range(40)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = load_recipe(None, [f"out_dir={tmp_path / 'run'}", "data.source=jsonl",
                                f"data.train={tmp_path / 'train.jsonl'}", f"model.init_from={tmp_path / 'hf'}",
                                "model.tokenizer=ignored-when-init-from-has-one",
                                "train.steps=3", "train.batch_size=4", "train.log_every=1"])
    run = train(recipe, progress=False)
    model = load_model(run / "model")
    assert model.config.model_type == "qwen2"
    assert model.backbone.get_input_embeddings().weight.shape[0] >= len(bare) + 1  # room for the added mask token
    assert model.spec.mask_token_id is not None and len(losses(run)) == 3
    assert not (run / "eval.json").exists()  # no answers in this data: nothing to grade


def test_plain_text_corpus_is_packed_and_trained(tmp_path):
    from dlm.data.tinymath import write_tinymath

    paths = write_tinymath(tmp_path / "tm", n_train=200, n_val=5, n_test=5, level="easy", seed=1)
    recipe = load_recipe(None, [f"out_dir={tmp_path / 'run'}", "data.source=text", f"data.train={paths['corpus']}",
                                "model.preset=nano", "model.vocab_size=300", "model.max_length=64", "train.steps=6",
                                "train.batch_size=4", "train.log_every=1", "optim.lr=3e-3", "optim.warmup_steps=1"])
    from dlm.training.loop import Trainer

    trainer = Trainer(recipe, progress=False)
    batch = next(trainer.stream)
    assert batch["input_ids"].shape == (4, 64) and batch["loss_mask"].all() and (batch["prompt_len"] == 0).all()
    trainer.fit()
    got = losses(tmp_path / "run")
    assert len(got) == 6 and got[-1] < got[0]


def test_wall_clock_cap_stops_early_says_so_and_resumes_to_the_end(tmp_path, capsys):
    """train.max_minutes ends a run after the update that crosses it, with a line saying how far it got; the saved
    checkpoint lets --resume finish the planned updates."""
    recipe = small_recipe(tmp_path / "cap", tmp_path / "data", "train.steps=6", "train.max_minutes=1e-9")
    run = train(recipe, progress=False)
    out = capsys.readouterr().out
    assert "stopped at update 1 of 6: train.max_minutes=1e-09 reached" in out
    # the end-of-run test line says how many problems it scored and that the model is the stopped one
    assert re.search(r"test accuracy: \d+\.\d% on 10 problems \(mean NFE [\d.]+; the model stopped at update 1 of 6\)",
                     out), out
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 1
    # the checkpoint records the training seconds so far, and the resumed run adds its own to them (the study
    # drivers report a resumed arm's whole training time from it): plant a large figure to see it carried over
    first = ckpt.latest(run / "checkpoints")
    state = torch.load(first / "trainer.pt", weights_only=False)
    assert 0 < state["train_seconds"] < 600
    state["train_seconds"] = 1000.0
    torch.save(state, first / "trainer.pt")
    train(small_recipe(tmp_path / "cap", tmp_path / "data", "train.steps=6"), resume=True, progress=False)
    out = capsys.readouterr().out
    assert "stopped at update" not in out
    assert re.search(r"test accuracy: \d+\.\d% on 10 problems \(mean NFE [\d.]+\)", out), out
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 6
    last = ckpt.latest(run / "checkpoints")
    total = torch.load(last / "trainer.pt", weights_only=False)["train_seconds"]
    assert last != first and 1000.0 < total < 1600
    # the run's summary, which the study drivers read, carries the same whole-run figure
    summary = json.loads((run / "train_summary.json").read_text())
    assert summary["updates"] == summary["of"] == 6 and summary["train_seconds"] == pytest.approx(total, abs=1.0)


def test_a_builtin_bpe_smaller_than_asked_says_so(tmp_path, capsys):
    """On a small corpus the BPE runs out of merges before model.vocab_size: the run's first line says how many tokens
    it has and why, instead of leaving 'vocab 695' beside a recipe that asked for 1024."""
    recipe = small_recipe(tmp_path / "run", tmp_path / "data", "model.vocab_size=20000", "train.steps=1",
                          "eval.test_n=1")
    train(recipe, progress=False)
    out = capsys.readouterr().out
    vocab = int(re.search(r"\| vocab (\d+)", out).group(1))
    assert vocab < 20000 and f"vocab {vocab} (of model.vocab_size 20000: the BPE ran out of merges" in out
