"""Recipes: YAML files validated by pydantic, with `--set a.b=c` overrides. Unknown keys and wrong types are errors
that name the file and the field, raised before any work starts.

sections.py: the training sections; recipe.py: the whole recipe, its cross-section rules and ModelSpec;
loading.py: read, override, validate, dump; smoke.py: the toy scale the documented commands are checked at."""

from dlm.config.loading import RecipeError, apply_overrides, dump_recipe, load_recipe, run_generation_length, run_recipe
from dlm.config.recipe import (
    FAMILIES,
    GENERATION_LENGTH,
    GPUS,
    EvalConfig,
    Gpu,
    Recipe,
    ScaleConfig,
    family_of,
    model_spec,
)
from dlm.config.sections import (
    DataConfig,
    LoraConfig,
    MaskedConfig,
    ModelConfig,
    OptimConfig,
    ProgressiveConfig,
    RewardTerm,
    RLConfig,
    SimplexConfig,
    TrainConfig,
)
from dlm.config.smoke import SMOKE_CAPS, SMOKE_ENV, SMOKE_N, SMOKE_TOKENS, smoke, smoke_scaled

__all__ = [
    "FAMILIES", "GENERATION_LENGTH", "GPUS", "SMOKE_CAPS", "SMOKE_ENV", "SMOKE_N", "SMOKE_TOKENS", "DataConfig",
    "EvalConfig", "Gpu", "LoraConfig", "MaskedConfig", "ModelConfig", "OptimConfig", "ProgressiveConfig",
    "Recipe", "RecipeError", "RewardTerm", "RLConfig", "ScaleConfig", "SimplexConfig", "TrainConfig",
    "apply_overrides", "dump_recipe", "family_of", "load_recipe", "model_spec", "run_generation_length",
    "run_recipe", "smoke", "smoke_scaled"
]
