"""Recipes: YAML files validated by pydantic, with `--set a.b=c` overrides. Unknown keys and wrong types are errors
that name the file and the field, raised before any work starts."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dlm.errors import DlmError
from dlm.modeling.spec import LoraSpec, ModelSpec
from dlm.sampling.options import SamplingSettings


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelConfig(_Strict):
    arch: Literal["llama", "mistral", "qwen2"] = "llama"
    preset: str = "small"
    init_from: str | None = Field(None, description="local HF checkpoint or dlm run/model dir to start from")
    attention: Literal["causal", "bidirectional", "block_causal"] = "causal"
    block_size: int | None = Field(None, gt=0, description="block diffusion: tokens per block (block_causal "
                                   "attention; 32 in PUMBA §4.2)")
    label_shift: bool = False
    tokenizer: str = Field("builtin", description="'builtin' trains a byte-level BPE on the data; else a local HF "
                           "tokenizer path")
    vocab_size: int = Field(1024, gt=16, description="size of the built-in BPE")
    max_length: int = Field(256, gt=8, description="canvas length: prompt + response + EOS (block diffusion: "
                            "the response rounded up to whole blocks)")

    @model_validator(mode="after")
    def _blocks(self):
        if (self.attention == "block_causal") != (self.block_size is not None):
            raise ValueError("model.block_size is required with attention: block_causal, and only with it")
        return self


class DataConfig(_Strict):
    source: Literal["tinymath", "jsonl", "hf", "text"] = "tinymath"
    level: str = "medium"
    n_train: int = Field(20000, gt=0)
    n_validation: int = Field(500, gt=0)
    n_test: int = Field(500, gt=0)
    seed: int = 0
    train: str | None = Field(None, description="jsonl path, HF dataset, or plain-text file (source: jsonl|hf|text)")
    validation: str | None = None
    test: str | None = None
    dir: str | None = Field(None, description="where tinymath is written (default: <out_dir>/data)")
    preference_pairs: bool = Field(False, description="tinymath: pair each program with a corrupted one as "
                                   "`rejected` (reward models); jsonl records may carry `rejected` themselves")

    @model_validator(mode="after")
    def _paths(self):
        if self.source != "tinymath" and not self.train:
            raise ValueError(f"data.train is required when data.source is {self.source!r}")
        return self


class OptimConfig(_Strict):
    lr: float = Field(1e-3, gt=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.01
    warmup_steps: int = Field(50, ge=0)
    schedule: Literal["cosine", "constant"] = "cosine"
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    grad_clip: float | None = 1.0


class LoraConfig(_Strict):
    """LoRA (Hu et al. 2021): train rank-r adapters W + (alpha/r)·B·A on a frozen base (`model.init_from`), plus
    dlm's own modules; null = full fine-tuning. See dlm.modeling.lora."""

    r: int = Field(16, gt=0, description="adapter rank")
    alpha: float = Field(32.0, gt=0, description="scale alpha: the update is (alpha/r)·B·A")
    dropout: float = Field(0.05, ge=0, lt=1, description="dropout on the adapter's input")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="leaf names of the adapted Linear layers, e.g. [q_proj, v_proj]; 'all-linear' = "
        "every Linear of the decoder blocks (attention q/k/v/o and MLP gate/up/down; not the LM head)")
    base_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="dtype of the frozen base weights (bfloat16 halves them; needs train.precision "
        "bf16); trainable tensors stay float32")


class TrainConfig(_Strict):
    objective: Literal["autoregressive", "mdm", "pu", "simplex", "reward"] = "autoregressive"
    steps: int = Field(1000, gt=0)
    batch_size: int = Field(32, gt=0, description="sequences per process per micro-batch")
    grad_accum: int = Field(1, gt=0)
    precision: Literal["fp32", "bf16"] = "fp32"
    ema_decay: float | None = Field(None, ge=0, lt=1,
                                    description="EMA of weights; evaluation and the final model use it")
    seed: int = 0
    log_every: int = Field(10, gt=0)
    eval_every: int | None = Field(None, gt=0)
    checkpoint_every: int | None = Field(None, gt=0)
    keep_checkpoints: int = Field(2, gt=0)
    max_minutes: float | None = Field(None, gt=0, description="stop (and save) after this wall time")
    max_nonfinite_updates: int = Field(5, gt=0, description="an update whose loss or gradient is NaN/inf is skipped "
                                       "(and counted); after this many in a row the run stops, keeping its last "
                                       "checkpoint")
    lora: LoraConfig | None = Field(None, description="LoRA adapters instead of full fine-tuning (null = full)")
    activation_checkpointing: bool = Field(False, description="recompute each backbone decoder layer's activations "
                                           "in the backward pass instead of keeping them (every objective): less "
                                           "memory, about one more forward of the layers. Independent of "
                                           "progressive.activation_checkpointing (whole PU passes); both together "
                                           "nest and run the layers three times per pass")

    @model_validator(mode="after")
    def _lora_precision(self):
        if self.lora is not None and self.lora.base_dtype == "bfloat16" and self.precision != "bf16":
            raise ValueError("lora.base_dtype bfloat16 runs the frozen base under bf16 autocast: set "
                             "train.precision: bf16 (or lora.base_dtype: float32)")
        return self


class MaskedConfig(_Strict):
    """Masked-diffusion loss settings (PUMBA Eq. 2.1, App. B.4)."""

    weight_cap: float = Field(5.0, gt=0, description="the 1/t loss weight is capped at this value (min-SNR)")
    z_loss: float = Field(1e-5, ge=0)


class ProgressiveConfig(_Strict):
    """Progressive unmasking, carry and truncated BPTT (PUMBA §3, Algorithm 1, App. B.2, C, F.6-F.7); read by the
    `pu` objective. Every trajectory advances one step per forward pass and commits ground-truth tokens."""

    construction: Literal["threshold", "stages"] = Field(
        "threshold", description="'threshold': start fully masked, commit the top-u plus all above tau (LLaDA runs, "
        "§B.2); 'stages': PUMA's stage-indexed construction with its curriculum on K (TinyGSM runs, Table 3)")
    reveal_count: int = Field(2, gt=0, description="u of the threshold construction")
    threshold: float | None = Field(0.9, gt=0, le=1, description="tau_train: also commit every position above it; "
                                    "null = commit exactly u (App. F.7)")
    stages_start: int = Field(12, gt=1, description="K at the start of the curriculum (stages construction)")
    stages_end: int = Field(42, gt=1, description="K at the end of the curriculum")
    stages_increment: int = Field(3, gt=0, description="K rises by this much ...")
    stages_every: int = Field(30000, gt=0, description="... every this many updates ...")
    stages_from: int = Field(60000, ge=0,
                             description="... from this update on (Table 4: 12→42 by 3 every 30k from 60k)")
    window: int = Field(1, gt=0, description="W: forward passes per optimizer update, gradient through the carry "
                        "inside the window (truncated BPTT, Algorithm 1)")
    carry: bool = Field(False, description="pass the last hidden state to the next step (Eq. 3.1)")
    carry_positions: Literal["all", "masked"] = Field("all", description="where the carry is added")
    carry_drop_prob: float = Field(0.0, ge=0, lt=1, description="probability that a step's carry is zeroed, per "
                                   "sequence (carry dropout, Jo et al. 2026); 0 = always passed (the paper's setting)")
    activation_checkpointing: bool = Field(False, description="recompute each whole pass (layers, LM head, loss "
                                           "terms) in backward so memory does not grow W-fold; keeps only each "
                                           "pass's inputs and outputs. Per-layer checkpointing inside a pass is "
                                           "train.activation_checkpointing; they combine")
    pad_in_loss: bool = Field(False, description="padding after the first EOS is maskable and in the loss (TinyGSM "
                              "setting, §B.3) instead of attended and maskable but out of the loss (§B.4.1)")
    # Ablations
    bridge: Literal["none", "gumbel", "straight_through", "reinforce", "reinforce_sampled"] = Field(
        "none",
        description="discrete bridge through the committed tokens instead of a carry (Table 1; use with window 2). "
                    "reinforce scores the teacher-forced commits (diverges, kept for the runs that used it); "
                    "reinforce_sampled commits a sample of the model inside the window and scores it")
    gumbel_temperature: float = Field(1.0, gt=0)
    reinforce_weight: float = Field(1.0, gt=0)
    student_forcing_k: float | None = Field(None, gt=0, description="scheduled sampling (App. C.3): commit the ground "
                                            "truth with prob eps(s) = max(floor, k/(k+exp(s/k))), else the argmax")
    student_forcing_floor: float = Field(0.1, ge=0, le=1)
    student_forcing_warmup: int = Field(1000, ge=0, description="updates of pure teacher forcing before the schedule")
    pool_factor: int = Field(1, gt=0, description="PU+ (App. F.6.1): keep pool_factor × batch trajectories and "
                             "advance the next batch of them each step (10 in the paper)")
    random_initial_masking: bool = Field(False, description="PU+: fresh trajectories start with a uniformly random "
                                         "fraction of their positions revealed")
    balance_lambda: float | None = Field(None, ge=0, le=1, description="PU+ Eq. F.2: lambda·(loss on the revealed) + "
                                         "(1-lambda)·(loss on those still masked after the step); null = plain loss")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data):
        if isinstance(data, dict) and "carry_dropout" in data:
            keep = data["carry_dropout"]
            if keep != 1.0:  # 1.0 (always keep) is what earlier runs wrote into their recipe.yaml: drop prob 0
                msg = "progressive.carry_dropout was a keep probability and is gone; use carry_drop_prob = 1 - value"
                raise ValueError(msg + (f" (here {1 - keep:g})" if isinstance(keep, (int, float)) else ""))
            data = {k: v for k, v in data.items() if k != "carry_dropout"}
        return data

    @model_validator(mode="after")
    def _checks(self):
        if self.stages_end < self.stages_start:
            raise ValueError(f"stages_end ({self.stages_end}) < stages_start ({self.stages_start})")
        if self.bridge != "none" and self.carry:
            raise ValueError("a discrete bridge replaces the carry: set carry: false with bridge")
        if self.random_initial_masking and self.construction == "stages":  # it would be silently ignored
            raise ValueError("random_initial_masking is for construction 'threshold' (the stages construction already "
                             "starts each trajectory at a random stage): set construction: threshold or drop it")
        return self


class SimplexConfig(_Strict):
    """Simplex diffusion settings (TESS 2 §3.1–3.3, App. A.1; defaults from ../shared/notes-tess2.md)."""

    simplex_value: float = Field(5.0, gt=0, description="k: tokens as ±k logit simplices (Eq. 1)")
    timesteps: int = Field(5000, gt=1, description="T: training timesteps of the cosine schedule")
    self_condition_prob: float = Field(0.5, ge=0, le=1, description="share of batches with a self-conditioning pass")
    masking: Literal["prefix_lm", "ul2"] = Field("prefix_lm", description="prefix_lm: generate the response (SFT); "
                                                 "ul2: the UL2 mixture over the whole sequence (adaptation)")
    ul2_prefix: Literal["half", "random"] = Field("half", description="UL2 prefix-LM split: half (App. A.1) or random "
                                                  "(§3.2)")


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


class ScaleConfig(_Strict):
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


class EvalConfig(SamplingSettings):
    """In-run evaluation, and the sampler it uses: every family's sampling options, flat (eval.reveal_count,
    eval.inference_steps, ...), defined once in `dlm.sampling.options`; each model takes its family's share
    (`eval.sampling_options(family)`)."""

    n: int = Field(200, gt=0, description="validation problems evaluated during training")
    test_n: int | None = Field(None, gt=0, description="test problems evaluated when training ends (null = all)")
    batch_size: int = Field(50, gt=0)
    max_new_tokens: int = Field(128, gt=0, description="AR: token limit; masked: length of the generation canvas")
    temperature: float = Field(0.0, ge=0)


class Recipe(_Strict):
    name: str = "run"
    out_dir: str = "runs/run"
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    optim: OptimConfig = OptimConfig()
    masked: MaskedConfig = MaskedConfig()
    progressive: ProgressiveConfig = ProgressiveConfig()
    simplex: SimplexConfig = SimplexConfig()
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
        if self.train.objective not in ("mdm", "pu"):
            raise ValueError(f"block_causal attention trains with objective mdm or pu, not {self.train.objective!r}")
        if self.train.objective == "pu":
            if p.construction != "threshold":
                raise ValueError("block PUMBA uses the threshold construction (progressive.construction: threshold)")
            steps = -(-m.block_size // p.reveal_count)
            if p.window > steps:
                raise ValueError(f"progressive.window {p.window} exceeds the ceil(block_size / reveal_count) = "
                                 f"ceil({m.block_size}/{p.reveal_count}) = {steps} steps a block lasts (PUMBA §4.2)")
            if p.bridge != "none" or p.pool_factor != 1 or p.random_initial_masking or p.pad_in_loss:
                raise ValueError("block PUMBA supports the carry and BPTT, not bridges, pool_factor, random initial "
                                 "masking or pad_in_loss")
        return self


class RecipeError(DlmError, ValueError):
    """A recipe that cannot be read or does not validate; the message names the file, line or field."""


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """`a.b=c` sets raw['a']['b'] to YAML-parsed c."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise RecipeError(f"--set {item!r}: expected KEY=VALUE, e.g. train.steps=100")
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise RecipeError(f"--set {item!r}: {part!r} is not a section")
        node[parts[-1]] = yaml.safe_load(value)
    return raw


def load_recipe(path: str | Path | None = None, overrides: list[str] | None = None) -> Recipe:
    """Read, override and validate a recipe; errors name the file and the offending line or field. `path=None`
    starts from the defaults; a recipe file must say something (an empty one is refused, not run on defaults)."""
    raw: dict = {}
    where = "<defaults>"
    if path is not None:
        where = str(path)
        raw = _read_yaml(Path(path))
    raw = apply_overrides(raw, overrides or [])
    try:
        return smoke_scaled(Recipe.model_validate(raw))
    except ValidationError as err:
        problems = []
        for e in err.errors():
            field = ".".join(str(x) for x in e["loc"]) or "(recipe)"
            msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
            problems.append(f"{field}: {msg}")
        raise RecipeError(f"{where}: " + "; ".join(problems)) from None


def run_recipe(path: str | Path) -> Recipe | None:
    """The recipe of the run a model directory belongs to (run dir, its model/, or a checkpoint), or None."""
    path = Path(path).expanduser().resolve()
    candidates = [path, path.parent] + ([path.parent.parent] if path.parent.name == "checkpoints" else [])
    recipe = next((d / "recipe.yaml" for d in candidates if (d / "recipe.yaml").is_file()), None)
    return load_recipe(recipe) if recipe else None


def run_generation_length(path: str | Path, fallback: int) -> int:
    """The generation length a run was evaluated with while training (its recipe's eval.max_new_tokens: the canvas
    its test used), else `fallback`: the default of `dlm generate` / `dlm eval` on a dlm run."""
    try:
        recipe = run_recipe(path)
    except DlmError:
        return fallback
    return recipe.eval.max_new_tokens if recipe is not None else fallback


# ---- smoke scale: every documented command run as written, in minutes (scripts/run_doc_commands.py) ------------
SMOKE_ENV = "DLM_SMOKE"
SMOKE_CAPS = {"train.steps": 3, "data.n_train": 256, "data.n_validation": 16, "data.n_test": 16, "eval.n": 8,
              "eval.test_n": 8}
SMOKE_N = 8  # problems a `dlm eval` / documents an lm-eval task runs under DLM_SMOKE
SMOKE_TOKENS = 64  # the longest generation a `dlm eval` makes under DLM_SMOKE (a multiple of every block size used)


def smoke() -> bool:
    """True when DLM_SMOKE=1: the documented commands run at toy scale (SMOKE_CAPS; `dlm eval --n` and lm-eval's
    --limit at most SMOKE_N, `dlm eval --max-new-tokens` at most SMOKE_TOKENS). For checking that commands work as
    written, never for results: every affected command says so on stderr."""
    return os.environ.get(SMOKE_ENV, "") not in ("", "0")


def smoke_scaled(recipe: Recipe) -> Recipe:
    """`recipe` with SMOKE_CAPS applied under DLM_SMOKE (and no time cap), else `recipe` unchanged."""
    if not smoke():
        return recipe
    sections = {}
    for key, cap in SMOKE_CAPS.items():
        section, field = key.split(".")
        value = getattr(getattr(recipe, section), field)
        sections.setdefault(section, {})[field] = cap if value is None else min(value, cap)
    sections["train"]["max_minutes"] = None
    print(f"{SMOKE_ENV}=1: recipe capped at toy scale ({', '.join(f'{k} <= {v}' for k, v in SMOKE_CAPS.items())}); "
          "not a result", file=sys.stderr)
    return recipe.model_copy(update={name: getattr(recipe, name).model_copy(update=fields)
                                     for name, fields in sections.items()})


def _read_yaml(path: Path) -> dict:
    from dlm.data.sources import read_utf8

    if not path.exists():
        raise RecipeError(f"{path}: recipe not found")
    text = read_utf8(path, error=RecipeError)
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = " ".join(str(getattr(err, "problem", None) or err).split())
        raise RecipeError(f"{path}{at}: invalid YAML ({problem})") from None
    if raw is None:
        raise RecipeError(f"{path}: the recipe is empty; give at least the sections that differ from the defaults "
                          f"(e.g. train.objective), see recipes/")
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: a recipe must be a mapping of sections (model:, data:, train:, ...), "
                          f"got a {type(raw).__name__}")
    return raw


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)


# The model family each objective trains.
FAMILIES = {"autoregressive": "autoregressive", "mdm": "masked", "pu": "masked", "simplex": "simplex",
            "reward": "reward"}


def model_spec(recipe: Recipe, mask_token_id: int | None, eos_token_id: int | None,
               pad_token_id: int | None) -> ModelSpec:
    """The ModelSpec a recipe trains: the family its objective trains, attention, label shift, the tokenizer's
    special tokens, and the extras its settings name (PUMBA's carry; TESS 2's simplex k, T and self-conditioning)."""
    m, family = recipe.model, FAMILIES[recipe.train.objective]
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
