"""The whole recipe: its sections, the scale and eval sections, the rules that span sections, and the ModelSpec a
recipe trains."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field, field_validator, model_validator

from dlm.config.sections import (
    DataConfig,
    MaskedConfig,
    ModelConfig,
    OptimConfig,
    ProgressiveConfig,
    RLConfig,
    SimplexConfig,
    Strict,
    TrainConfig,
)
from dlm.modeling.spec import LoraSpec, ModelSpec
from dlm.sampling.options import SamplingSettings


@dataclass(frozen=True)
class Gpu:
    """An accelerator the dry run sizes runs for: peak bf16 dense tensor throughput and memory, vendor figures."""

    peak_flops: float
    memory_bytes: int


# NVIDIA datasheets: BF16 tensor-core TFLOPS without sparsity (the sheets print 2x with sparsity) and HBM size as
# named (in GiB; CUDA reports ~1 % less usable, e.g. 79.6 GiB on an H100 80GB).
GPUS: dict[str, Gpu] = {
    "H100-80GB": Gpu(989e12, 80 * 1024**3),   # H100 SXM5
    "H200-141GB": Gpu(989e12, 141 * 1024**3),  # H200 SXM: H100's compute, more memory
    "A100-80GB": Gpu(312e12, 80 * 1024**3),   # A100 SXM4
}


class ScaleConfig(Strict):
    """How a recipe is meant to be launched at size; read by `dlm train RECIPE --dry-run` (training itself takes its
    parallelism from `accelerate launch`)."""

    accelerate_config: str | None = Field(None, description="the accelerate config under recipes/accelerate/ this "
                                          "recipe expects (e.g. recipes/accelerate/fsdp2.yaml); null = one process")
    num_processes: int = Field(1, gt=0, description="processes (GPUs) the recipe is sized for: global batch = "
                               "batch_size × grad_accum × num_processes")
    gpu: str = Field("H100-80GB", description="accelerator the dry run estimates memory and time for: "
                     + ", ".join(GPUS))
    mfu: float = Field(0.4, gt=0, le=1, description="model FLOPs utilisation the dry run's time per update assumes")

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, gpu: str) -> str:
        if gpu not in GPUS:
            raise ValueError(f"unknown GPU {gpu!r}; the dry run knows {', '.join(GPUS)}")
        return gpu


GENERATION_LENGTH = 128  # eval.max_new_tokens' default, and the length dlm generate / eval use without a run recipe


class EvalConfig(SamplingSettings):
    """In-run evaluation, and the sampler it uses: every family's sampling options, flat (eval.reveal_count,
    eval.inference_steps, ...), defined once in `dlm.sampling.options`; each model takes its family's share
    (`eval.sampling_options(family)`)."""

    n: int = Field(200, gt=0, description="validation problems evaluated during training")
    test_n: int | None = Field(None, gt=0, description="test problems evaluated when training ends (null = all)")
    batch_size: int = Field(50, gt=0)
    max_new_tokens: int = Field(GENERATION_LENGTH, gt=0, description="AR: token limit; masked: length of the "
                                "generation canvas")
    temperature: float = Field(0.0, ge=0)


class Recipe(Strict):
    name: str = "run"
    out_dir: str = "runs/run"
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    optim: OptimConfig = OptimConfig()
    masked: MaskedConfig = MaskedConfig()
    progressive: ProgressiveConfig = ProgressiveConfig()
    simplex: SimplexConfig = SimplexConfig()
    rl: RLConfig = RLConfig()
    eval: EvalConfig = EvalConfig()
    scale: ScaleConfig = ScaleConfig()


    @model_validator(mode="after")
    def _progressive_needs_pu(self):
        # Set explicitly and to a non-default value: a recipe written back by a run (every field) still loads.
        p = self.progressive
        given = sorted(f for f in p.model_fields_set if getattr(p, f) != type(p).model_fields[f].default)
        if given and self.train.objective != "pu":
            raise ValueError(f"{', '.join('progressive.' + f for f in given)} only apply to train.objective pu, not "
                             f"{self.train.objective!r}: remove them or set train.objective: pu")
        return self

    @model_validator(mode="after")
    def _rl_needs_grpo(self):
        given = sorted(self.rl.model_fields_set)
        if given and self.train.objective != "grpo" and self.rl != RLConfig():
            raise ValueError(f"{', '.join('rl.' + f for f in given)} only apply to train.objective grpo, not "
                             f"{self.train.objective!r}: remove them or set train.objective: grpo")
        if self.train.objective == "grpo":
            rl = self.rl
            if self.train.batch_size % rl.group_size:
                raise ValueError(f"train.batch_size ({self.train.batch_size}) counts completions: make it a multiple "
                                 f"of rl.group_size ({rl.group_size})")
            if rl.reference == "adapters" and rl.kl_beta and self.train.lora is None:
                raise ValueError("rl.reference adapters is the LoRA base with its adapters off: set train.lora, or "
                                 "rl.reference: frozen (a frozen copy) or none (with rl.kl_beta: 0)")
            if not self.model.init_from:
                raise ValueError("train.objective grpo post-trains a model: set model.init_from (a dlm run or "
                                 "model directory)")
        return self

    @model_validator(mode="after")
    def _lora_needs_a_base(self):
        if self.train.lora is not None and not self.model.init_from:
            raise ValueError("train.lora adapts a saved model: set model.init_from to its directory (a local HF "
                             "causal LM or a dlm run), or remove train.lora to train every weight")
        return self

    @model_validator(mode="after")
    def _block_recipes(self):
        m, p = self.model, self.progressive
        if m.attention != "block_causal":
            return self
        if self.train.objective not in ("mdm", "pu", "grpo"):
            raise ValueError(f"block_causal attention trains with objective mdm, pu or grpo, not "
                             f"{self.train.objective!r}")
        if self.train.objective == "pu":
            if p.construction != "threshold":
                raise ValueError("block PUMBA uses the threshold construction (progressive.construction: threshold)")
            assert m.block_size is not None  # ModelConfig requires block_size with block_causal attention
            steps = -(-m.block_size // p.reveal_count)
            if p.window > steps:
                raise ValueError(f"progressive.window {p.window} exceeds the ceil(block_size / reveal_count) = "
                                 f"ceil({m.block_size}/{p.reveal_count}) = {steps} steps a block lasts (PUMBA §4.2)")
            if p.bridge != "none" or p.pool_factor != 1 or p.random_initial_masking or p.pad_in_loss:
                raise ValueError("block PUMBA supports the carry and BPTT, not bridges, pool_factor, random initial "
                                 "masking or pad_in_loss")
        return self

# The model family each objective trains.
FAMILIES = {"autoregressive": "autoregressive", "mdm": "masked", "pu": "masked", "simplex": "simplex",
            "reward": "reward", "grpo": "masked"}


def family_of(recipe: Recipe) -> str:
    """The model family a recipe trains (grpo: the policy's, rl.family)."""
    return recipe.rl.family if recipe.train.objective == "grpo" else FAMILIES[recipe.train.objective]


def model_spec(recipe: Recipe, mask_token_id: int | None, eos_token_id: int | None,
               pad_token_id: int | None) -> ModelSpec:
    """The ModelSpec a recipe trains: the family its objective trains, attention, label shift, the tokenizer's
    special tokens, and the extras its settings name (PUMBA's carry; TESS 2's simplex k, T and self-conditioning)."""
    m, family = recipe.model, family_of(recipe)
    attention = "causal" if family == "autoregressive" else m.attention
    fields = dict(family=family, attention=attention, label_shift=m.label_shift, mask_token_id=mask_token_id,
                  eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                  block_size=m.block_size if attention == "block_causal" else None)
    if recipe.train.objective == "pu" and recipe.progressive.carry:  # PUMBA Eq. 3.1
        fields.update(carry=True, carry_positions=recipe.progressive.carry_positions)
    if family == "simplex":  # TESS 2: k, T and self-conditioning travel with the model
        s = recipe.simplex
        fields.update(simplex_k=s.simplex_value, simplex_timesteps=s.timesteps,
                      self_conditioning=s.self_condition_prob > 0)
    if recipe.train.lora is not None:  # the base and its resolved layers are filled in by dlm.modeling.build
        fields["lora"] = LoraSpec(**recipe.train.lora.model_dump(exclude={"base_dtype"}))
    return ModelSpec(**fields)
