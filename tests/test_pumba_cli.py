"""PUMBA end to end through the shipped recipe and the CLI, shrunk: a masked warm start → `dlm train
recipes/tinymath/pumba-w2.yaml` (PU stage construction + carry + BPTT W=2) → the saved model keeps its trained carry
layer → `dlm generate` passes the carry → `dlm eval --metric mask-discrepancy` reads the construction from the run."""

import json
from pathlib import Path

import torch

from dlm.cli import main
from dlm.config import load_recipe
from dlm.modeling.carry import CARRY_MODULE
from dlm.sampling import load_for_inference
from dlm.training.loop import build_model, train

RECIPES = Path(__file__).parents[1] / "recipes" / "tinymath"


def test_pumba_recipe_from_a_masked_warm_start(tmp_path, capsys):
    small = [f"data.dir={tmp_path / 'data'}", "data.level=easy", "data.n_train=120", "data.n_validation=4",
             "data.n_test=4", "model.preset=nano", "model.vocab_size=300", "model.max_length=96", "train.batch_size=4",
             "train.checkpoint_every=2", "train.log_every=1", "eval.max_new_tokens=16", "eval.batch_size=4", "eval.n=4"]
    warm = train(load_recipe(RECIPES / "mdm.yaml", small + ["model.init_from=null", "model.label_shift=false",
                                                            "train.steps=2", f"out_dir={tmp_path / 'warm'}"]),
                 progress=False)
    recipe = load_recipe(RECIPES / "pumba-w2.yaml", small + [
        f"model.init_from={warm}", "model.label_shift=false", "train.steps=4", f"out_dir={tmp_path / 'pumba'}",
        "progressive.stages_from=1", "progressive.stages_every=1"])
    assert recipe.progressive.construction == "stages" and recipe.progressive.window == 2 and recipe.progressive.carry
    model, tok = load_for_inference(warm)
    start = build_model(recipe, tok)
    assert start.spec.carry and getattr(start.backbone, CARRY_MODULE).weight.abs().sum() == 0  # fresh: zero
    run = train(recipe, progress=False)
    log = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(log) == 4 and all(r["passes"] >= 1 for r in log)
    trained, _ = load_for_inference(run)
    assert trained.spec.carry and getattr(trained.backbone, CARRY_MODULE).weight.abs().sum() > 0
    state = torch.load(next((run / "checkpoints").glob("step_*")) / "data_rank0.pt", weights_only=False)
    assert state["objective"]["stages"] > 12  # the K curriculum moved (every update from update 1)

    main(["generate", str(run), "--prompt", "Mia has 3 apples. She buys 4 more. How many apples does she have?",
          "--max-new-tokens", "12", "--u", "3"])
    assert "NFE" in capsys.readouterr().out
    out = tmp_path / "md.json"
    main(["eval", str(run), str(warm), "--metric", "mask-discrepancy", "--n", "2", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["training"] for r in rows] == ["pu", "mdm"]
    assert out.with_suffix(".png").is_file()
