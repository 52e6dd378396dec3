"""The simplex family through the user path: `dlm train` with the simplex objective (prefix-LM and UL2), resume,
`dlm generate` and `dlm eval --sweep steps=...` dispatching to the simplex sampler."""

import json

import pytest
import torch

from dlm.cli import main
from dlm.config import load_recipe
from dlm.training.loop import train

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: latency-bound on 1 thread


def recipe(out_dir, data_dir, *extra):
    return load_recipe(None, [
        f"out_dir={out_dir}", f"data.dir={data_dir}", "data.level=easy", "data.n_train=200", "data.n_validation=4",
        "data.n_test=6", "model.preset=nano", "model.vocab_size=300", "model.max_length=96",
        "model.attention=bidirectional", "model.label_shift=true", "train.objective=simplex", "train.steps=6",
        "train.batch_size=8", "train.log_every=1", "train.checkpoint_every=3", "simplex.timesteps=200",
        "eval.max_new_tokens=12", "eval.inference_steps=3", "eval.batch_size=6", *extra])


def losses(run):
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("masking", ["prefix_lm", "ul2"])
def test_train_resume_generate_eval(tmp_path, capsys, masking):
    data = tmp_path / "data"
    run = train(recipe(tmp_path / "run", data, f"simplex.masking={masking}"), progress=False)
    evaluation = json.loads((run / "eval.json").read_text())
    assert evaluation["eval/mean_nfe"] == 3 and evaluation["eval/n"] == 6  # the simplex sampler ran, 3 steps each

    # Exact resume: a second run stopped at step 3 and resumed matches the uninterrupted one.
    part = train(recipe(tmp_path / "part", data, f"simplex.masking={masking}", "train.steps=3"), progress=False)
    resumed = train(recipe(part, data, f"simplex.masking={masking}", "train.steps=3"), resume=True, progress=False,
                    extend_to=6)  # all 6 updates are inside the warmup: re-planning keeps the rates
    assert losses(resumed) == pytest.approx(losses(run), rel=1e-5, abs=1e-6)

    capsys.readouterr()
    main(["generate", str(run), "--prompt", "Mia has 3 apples and buys 4 more. How many?", "--steps", "4",
          "--max-new-tokens", "10"])
    assert "(4 NFE)" in capsys.readouterr().out
    out = tmp_path / "sweep.json"
    # the tiny run's context (96) is shorter than some tinymath prompts: keep their end, as its training did
    main(["eval", str(run), "--sweep", "steps=2,5", "--max-new-tokens", "10", "--n", "3", "--out", str(out),
          "--truncate-prompts"])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["family"], r["inference_steps"], r["mean_nfe"]) for r in rows] == [("simplex", 2, 2), ("simplex", 5, 5)]
    main(["eval", str(run), "--steps", "3", "--early-stop", "1", "--max-new-tokens", "10", "--n", "3",
          "--out", str(out), "--truncate-prompts"])
    row = json.loads(out.read_text())["rows"][0]
    assert row["early_stop_patience"] == 1 and row["mean_nfe"] <= 3


def test_adapt_then_sft_recipes_from_a_plain_hf_checkpoint(tmp_path, tiny_tokenizer):
    """The shipped recipes, shrunk: any local HF causal LM (no dlm.json) → TESS 2 adaptation (UL2) → instruction
    tuning (prefix-LM) starting from the adapted weights, timestep embedding included."""
    from pathlib import Path

    from dlm.modeling.backbone import build_backbone
    from dlm.sampling import load_for_inference
    from dlm.training.loop import build_model

    recipes = Path(__file__).parents[1] / "recipes" / "tinymath"
    hf = build_backbone("qwen2", "nano", len(tiny_tokenizer), 128, "causal")
    hf.save_pretrained(tmp_path / "hf")
    tiny_tokenizer.save_pretrained(tmp_path / "hf")
    small = [f"data.dir={tmp_path / 'data'}", "data.level=easy", "data.n_train=100", "data.n_validation=2",
             "data.n_test=3", "model.max_length=96", "train.steps=3", "train.batch_size=8", "train.eval_every=null",
             "train.checkpoint_every=null", "eval.max_new_tokens=8", "eval.inference_steps=2", "eval.batch_size=3",
             "simplex.timesteps=200"]
    adapt_recipe = load_recipe(recipes / "tess2-adapt.yaml", small + [f"model.init_from={tmp_path / 'hf'}",
                                                                     f"out_dir={tmp_path / 'adapt'}"])
    assert adapt_recipe.simplex.masking == "ul2" and adapt_recipe.model.label_shift
    adapt = train(adapt_recipe, progress=False)
    model, tok = load_for_inference(adapt)
    assert model.spec.family == "simplex" and model.spec.label_shift and not model.backbone.config.is_causal
    assert model.config.model_type == "qwen2" and model.spec.simplex_timesteps == 200
    timestep = model.backbone.dlm_timestep_embedding.weight
    assert timestep.abs().sum() > 0  # trained away from its zero start

    sft_recipe = load_recipe(recipes / "tess2-sft.yaml",
                             small + [f"model.init_from={adapt}", f"out_dir={tmp_path / 'sft'}"])
    assert sft_recipe.simplex.masking == "prefix_lm"
    start = build_model(sft_recipe, tok)
    assert torch.equal(start.backbone.dlm_timestep_embedding.weight, timestep)
    sft = train(sft_recipe, progress=False)
    assert len(losses(sft)) >= 1 and (sft / "eval.json").is_file()


def test_generate_show_steps_renders_the_reverse_process(tmp_path, tiny_tokenizer, capsys):
    from tests.test_simplex import simplex_model

    m = simplex_model(vocab=len(tiny_tokenizer))
    m.spec = m.spec.model_copy(update={"eos_token_id": tiny_tokenizer.eos_token_id,
                                       "pad_token_id": tiny_tokenizer.pad_token_id})
    m.save_pretrained(tmp_path / "sx")
    tiny_tokenizer.save_pretrained(tmp_path / "sx")
    capsys.readouterr()
    main(["generate", str(tmp_path / "sx"), "--prompt", "Mia has 3 apples.", "--steps", "20", "--max-new-tokens", "6",
          "--show-steps"])
    out = capsys.readouterr().out
    frames = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(frames) == 10 and frames[-1].startswith("step   20/20 t=    0")  # every 2nd step, ending at t = 0
    assert "(20 NFE)" in out
