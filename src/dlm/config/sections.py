"""The recipe's training sections (model, data, optim, train with LoRA, masked, progressive, simplex, rl): fields,
defaults and the checks that concern one section alone."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    """A recipe section: an unknown key is an error, not ignored."""

    model_config = ConfigDict(extra="forbid")


class ModelConfig(Strict):
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


class DataConfig(Strict):
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


class OptimConfig(Strict):
    lr: float = Field(1e-3, gt=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.01
    warmup_steps: int = Field(50, ge=0)
    schedule: Literal["cosine", "constant"] = "cosine"
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    grad_clip: float | None = 1.0


class LoraConfig(Strict):
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


class TrainConfig(Strict):
    objective: Literal["autoregressive", "mdm", "pu", "simplex", "reward", "grpo"] = "autoregressive"
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


class MaskedConfig(Strict):
    """Masked-diffusion loss settings (PUMBA Eq. 2.1, App. B.4)."""

    weight_cap: float = Field(5.0, gt=0, description="the 1/t loss weight is capped at this value (min-SNR)")
    z_loss: float = Field(1e-5, ge=0)


class ProgressiveConfig(Strict):
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


class SimplexConfig(Strict):
    """Simplex diffusion settings (TESS 2 §3.1–3.3, App. A.1; defaults from ../shared/notes-tess2.md)."""

    simplex_value: float = Field(5.0, gt=0, description="k: tokens as ±k logit simplices (Eq. 1)")
    timesteps: int = Field(5000, gt=1, description="T: training timesteps of the cosine schedule")
    self_condition_prob: float = Field(0.5, ge=0, le=1, description="share of batches with a self-conditioning pass")
    masking: Literal["prefix_lm", "ul2"] = Field("prefix_lm", description="prefix_lm: generate the response (SFT); "
                                                 "ul2: the UL2 mixture over the whole sequence (adaptation)")
    ul2_prefix: Literal["half", "random"] = Field("half", description="UL2 prefix-LM split: half (App. A.1) or random "
                                                  "(§3.2)")



class RewardTerm(Strict):
    """One term of the reward: `weight` × the named reward (each in [0, 1], or the reward model's score)."""

    name: Literal["tinymath", "answer", "format", "unit_tests", "reward_model"] = Field(
        description="tinymath: 1 when the completion's program returns the record's `answer` in the sandbox; "
        "answer: 1 when its final answer (last \\boxed{}, text after ####, or last number) equals `answer`; "
        "format: 1 when it parses as Python and defines `solution` (parsed, never run); unit_tests: 1 when the "
        "record's HumanEval-style `test` passes on prompt + completion in the sandbox; reward_model: a dlm "
        "Bradley-Terry model's score (`path`)")
    weight: float = 1.0
    path: str | None = Field(None, description="reward_model: the dlm reward model directory")

    @model_validator(mode="after")
    def _path(self):
        if (self.name == "reward_model") != (self.path is not None):
            raise ValueError("rl.reward: `path` is required by reward_model terms, and only by them")
        return self


class RLConfig(Strict):
    """GRPO-family post-training (train.objective: grpo; `dlm.training.objectives.grpo`). train.batch_size counts
    completions per process per micro-batch: batch_size / group_size prompts, group_size completions each. Rollouts
    use the eval section's sampler (policy, threshold, blocks, ...) at rl.temperature."""

    family: Literal["masked", "autoregressive"] = Field(
        "masked", description="the policy's family: a masked diffusion model (full canvas or block-causal) or an AR "
        "model (exact log-probabilities: the GRPO baseline on the same loop)")
    group_size: int = Field(8, gt=1, description="G: completions per prompt; advantages are normalised in a group")
    inner_steps: int = Field(1, gt=0, description="mu: updates on the same rollouts (the ratio's old policy is the "
                             "policy that sampled them)")
    clip: float = Field(0.2, gt=0, lt=1, description="epsilon of the clipped ratio")
    kl_beta: float = Field(0.04, ge=0, description="beta of the per-token KL (k3 estimate) to the reference")
    reference: Literal["adapters", "frozen", "none"] = Field(
        "adapters", description="adapters: the LoRA base with adapters off (free; needs train.lora); frozen: a "
        "frozen copy of the starting model (one more model in memory per process); none: no KL (kl_beta 0)")
    estimator: Literal["mean_field", "elbo", "spg"] = Field(
        "mean_field", description="sequence log-likelihood of a masked policy: mean_field (d1: completion fully "
        "masked, prompt tokens masked at random, one pass), elbo (the Monte-Carlo ELBO of `evaluation/elbo.py`), "
        "spg (ELBO for positive advantages, an upper bound for negative ones). AR policies are exact")
    prompt_mask_prob: float = Field(0.15, ge=0, lt=1, description="mean_field: probability of masking each prompt "
                                    "token (a fresh draw per inner step)")
    mc_num: int = Field(2, gt=0, description="elbo/spg: masks per completion per inner step")
    spg_beta: float = Field(1.5, ge=1, description="spg: beta of the upper bound (SPG's GSM8K scripts: 1.5)")
    spg_mix: float = Field(0.5, ge=0, le=1, description="spg: weight of the upper bound for negative advantages "
                           "(the rest is the ELBO; 1 = the pure upper bound; SPG's GSM8K scripts: 0.5)")
    scale_rewards: bool = Field(True, description="divide advantages by the group's reward std (GRPO); false: "
                                "only centre them (Dr. GRPO)")
    temperature: float = Field(1.0, ge=0, description="rollout sampling temperature")
    max_new_tokens: int | None = Field(None, gt=0, description="rollout length (masked: the canvas; default "
                                       "eval.max_new_tokens)")
    reward: list[RewardTerm] = Field(default_factory=lambda: [RewardTerm(name="tinymath")],
                                     description="the reward: a weighted sum of terms")
    reward_timeout: float = Field(1.0, gt=0, le=30, description="sandbox seconds per completion")

    @model_validator(mode="after")
    def _kl(self):
        if self.reference == "none" and self.kl_beta:
            raise ValueError(f"rl.reference none has no KL term: set rl.kl_beta: 0 (it is {self.kl_beta})")
        return self
