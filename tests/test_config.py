import pytest

from dlm.config import RecipeError, load_recipe


def test_defaults_and_overrides():
    r = load_recipe(None, ["train.steps=7", "optim.lr=3e-4", "model.attention=bidirectional",
                           "optim.betas=[0.9, 0.99]"])
    assert r.train.steps == 7 and r.optim.lr == 3e-4 and r.model.attention == "bidirectional"
    assert r.optim.betas == (0.9, 0.99)
    assert r.optim.weight_decay == 0.01 and r.optim.eps == 1e-8 and r.optim.grad_clip == 1.0


def test_unknown_key_names_file_and_field(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("train:\n  stpes: 10\n")
    with pytest.raises(RecipeError, match=r"bad.yaml: train.stpes: unknown key"):
        load_recipe(p)


def test_wrong_type_names_field(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("optim:\n  lr: fast\n")
    with pytest.raises(RecipeError, match=r"optim.lr"):
        load_recipe(p)


def test_bad_override_syntax():
    with pytest.raises(RecipeError, match="KEY=VALUE"):
        load_recipe(None, ["train.steps"])


def test_non_tinymath_source_needs_train_path():
    with pytest.raises(RecipeError, match="data.train is required"):
        load_recipe(None, ["data.source=jsonl"])


def test_shipped_recipes_validate():
    from pathlib import Path

    recipes = [p for p in sorted(Path(__file__).parents[1].glob("recipes/**/*.yaml"))
               if p.parent.name != "accelerate"]  # accelerate launch configs, not recipes (tests/test_dryrun.py)
    assert recipes, "no recipes shipped"
    for path in recipes:
        load_recipe(path)
