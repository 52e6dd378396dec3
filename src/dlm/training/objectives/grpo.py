"""GRPO-family post-training on the training loop (`train.objective: grpo`, the `rl` recipe section).

Per cycle of rl.inner_steps (μ) updates and per micro-batch: train.batch_size / G prompts are drawn from the
training records (a stream of their own, exact on resume), each is decoded G times by dlm's own sampler (the eval
section's options at rl.temperature: any masked policy, full canvas or block-causal with its KV cache, or the AR
sampler), the completions are rewarded (`dlm.evaluation.rewards`: sandboxed, failures scored 0 and counted) and
given group-normalised advantages A = (r - mean_G) / (std_G + 1e-4) (rl.scale_rewards false: r - mean_G). Each of
the μ updates then maximises the clipped surrogate per completion token

    min(ρ A, clip(ρ, 1 - ε, 1 + ε) A) - β KL_i,  ρ = exp(ℓ_i - ℓ_i^old),  KL_i = e^(ℓ^ref_i - ℓ_i) - (ℓ^ref_i - ℓ_i) - 1

with ℓ the estimator's per-token log-likelihood (`likelihood`: exact for AR, mean_field / elbo / spg for masked
models), ℓ^old the sampling policy's (computed once at rollout time for each inner step's masks; with μ = 1 it is ℓ
detached, so ρ = 1 and the gradient is A ∇ℓ), ℓ^ref the reference's under the same masks (rl.reference: the LoRA
base with adapters off, or a frozen copy of the starting model) and KL the k3 estimate. The loss is summed over
tokens and divided by the update's token count over micro-batches and ranks (the loop's exact normalisation), so
two processes compute what one does.

Rollouts are keyed by (run seed, the prompt's place in the global stream): a prompt's G completions do not depend on
the batch, the rank or a resume. The current cycle's rollouts are part of the checkpoint (`state_dict`)."""

from __future__ import annotations

import contextlib
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dlm.data.pipeline import BatchStream
from dlm.data.prompts import encode_prompts
from dlm.errors import DlmError
from dlm.evaluation.rewards import Rewards
from dlm.modeling.blocks import num_blocks
from dlm.modeling.device import make_generator, model_device
from dlm.sampling import generate
from dlm.training.objectives.likelihood import Completions, draw, token_logps


@dataclass
class Rollout:
    """One micro-batch's rollouts and what the μ updates on them read."""

    cycle: int  # the update that sampled them
    comp: Completions
    advantages: torch.Tensor  # [R]
    old: list[torch.Tensor] | None  # per inner step, ℓ^old [R, W] (None when μ = 1)
    metrics: dict[str, float]

    def state(self) -> dict:
        c = self.comp
        return {"cycle": self.cycle, "prompts": c.prompts, "canvas": c.canvas.cpu(), "scored": c.scored.cpu(),
                "groups": c.groups.cpu(), "advantages": self.advantages.cpu(),
                "old": None if self.old is None else [o.cpu() for o in self.old], "metrics": self.metrics}

    @classmethod
    def from_state(cls, s: dict, device) -> Rollout:
        comp = Completions(s["prompts"], s["canvas"].to(device), s["scored"].to(device), s["groups"])
        old = None if s["old"] is None else [o.to(device) for o in s["old"]]
        return cls(s["cycle"], comp, s["advantages"].to(device), old, s["metrics"])


def _indices(rows, pad_to=None) -> dict[str, torch.Tensor]:
    """The prompt stream's 'collate': record indices as a [B, 1] tensor."""
    return {"input_ids": torch.tensor(rows, dtype=torch.long)[:, None]}


def prompt_stream(records, prompts: int, seed: int, rank: int = 0, world: int = 1) -> BatchStream:
    """The trainer's data stream under GRPO: shuffled record indices, `prompts` per process per micro-batch, each
    with its place in the global stream (`example_id`, which keys its rollouts); exact on resume."""
    return BatchStream(list(range(len(records))), prompts, _indices, seed=seed, rank=rank, world_size=world)


def required_fields(recipe) -> tuple[str, ...]:
    """The fields every training record needs: prompt and response; under GRPO the prompt and what the rewards
    read (a record that lacks one is refused naming its file and line)."""
    if recipe.train.objective != "grpo":
        return ("prompt", "response")
    need = {"tinymath": ("answer",), "answer": ("answer",), "unit_tests": ("test", "entry_point")}
    return ("prompt", *sorted({f for t in recipe.rl.reward for f in need.get(t.name, ())}))


def unwrapped(model):
    """The module under a DDP / DeepSpeed wrapper (rollouts and the reference run there: no gradient sync)."""
    return getattr(model, "module", model)


@contextlib.contextmanager
def adapters_off(model):
    """The LoRA base: every adapter layer disabled inside the block (the reference of rl.reference: adapters)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in unwrapped(model).modules() if isinstance(m, BaseTunerLayer)]
    if not layers:
        raise DlmError("rl.reference adapters: the model has no LoRA adapters (set train.lora)")
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)


class GRPOObjective:
    """GRPO with diffusion-LM likelihood estimators (module docstring). The trainer calls `attach` (it owns its data)
    and `bind` (the model, the records, the tokenizer and a builder of the starting model) before the first update."""

    def __init__(self, recipe):
        self.recipe, self.rl = recipe, recipe.rl
        self.seed = recipe.train.seed
        self.G = self.rl.group_size
        self.kind = "exact" if self.rl.family == "autoregressive" else self.rl.estimator
        self.buffer: dict[int, Rollout] = {}
        self.stream: BatchStream | None = None
        self.model = self.reference = None
        self.replica: Callable[[], contextlib.AbstractContextManager] | None = None
        self._pending: dict | None = None

    def attach(self, stream, collate, carry_dim) -> None:
        """The trainer's stream of record indices (`prompt_stream`): it draws the prompts and checkpoints them."""
        self.stream = stream

    def bind(self, model, records, tok, build_reference, replica=None) -> None:
        """`replica()`: a context giving the whole model on this process for rollouts (the strategy's: the live
        module, or under FSDP2 a gathered copy); default the unwrapped model."""
        self.model, self.records, self.tok = model, records, tok
        self.replica = replica or (lambda: contextlib.nullcontext(unwrapped(model)))
        inner = unwrapped(model)
        spec = inner.spec
        self.block = spec.block_size if spec.attention == "block_causal" else None
        self.rewards = Rewards(self.rl.reward, self.rl.reward_timeout, device=model_device(inner), batch_size=self.G)
        if self.rl.reference == "frozen" and self.rl.kl_beta:
            self.reference = build_reference().to(model_device(inner)).eval().requires_grad_(False)
        self.options = self.recipe.eval.sampling_options(spec.family)
        self.max_new = self.rl.max_new_tokens or self.recipe.eval.max_new_tokens
        self.prompt_ids: dict[int, list[int]] = {}  # each prompt encoded when first drawn (`_prompts`)
        if self._pending is not None:
            self.load_state_dict(self._pending)

    # ---- rollouts -------------------------------------------------------------------------------------------------
    def plan(self, batch=None, update: int = 0, micro: int = 0) -> dict:
        """This micro-batch's rollouts (sampled at the first update of a cycle, reused for the rest); counts the
        completion tokens in the loss."""
        inner = update % self.rl.inner_steps
        if inner == 0 or micro not in self.buffer or self.buffer[micro].cycle != update - inner:
            self.buffer[micro] = self._rollout(update - inner, micro)
        roll = self.buffer[micro]
        return {"count": roll.comp.scored.sum(), "micro": micro, "inner": inner}

    def _rollout(self, cycle: int, micro: int) -> Rollout:
        assert self.stream is not None, "bind() first"
        t0 = time.perf_counter()
        batch = self.stream.next_batches(1)[0]
        index = batch["input_ids"][:, 0].tolist()
        records = [self.records[i] for i in index]
        keys = batch["example_id"].tolist()
        assert self.replica is not None, "bind() first"
        with self.replica() as inner:
            return self._score_rollouts(inner, cycle, t0, index, records, keys)

    def _score_rollouts(self, inner, cycle: int, t0: float, index, records, keys) -> Rollout:
        training = inner.training
        inner.eval()
        try:
            comp, texts, nfe = self._sample(inner, self._prompts(inner, index), keys)
            rollout_s = time.perf_counter() - t0
            scores = self.rewards([r for r in records for _ in range(self.G)], texts)
            # float64: a group's centred rewards stay exactly opposite when they nearly tie (G = 2: ±std)
            reward = torch.tensor(scores.total, dtype=torch.float64, device=comp.canvas.device).view(-1, self.G)
            centred = reward - reward.mean(-1, keepdim=True)
            std = reward.std(-1, keepdim=True, unbiased=False)
            adv = (centred / (std + 1e-4) if self.rl.scale_rewards else centred).flatten().float()
            old = self._old_logps(inner, comp, adv, cycle) if self.rl.inner_steps > 1 else None
        finally:
            inner.train(training)
        metrics = {"rl/reward": float(reward.mean()), "rl/reward_group_std": float(std.mean()),
                   "rl/mixed_groups": float((reward.max(-1).values > reward.min(-1).values).float().mean()),
                   "rl/nfe": sum(nfe) / len(nfe), "rl/length": float(comp.scored.sum(-1).float().mean()),
                   "rl/reward_failures": float(sum(scores.failures.values())), "rl/rollout_s": rollout_s,
                   "rl/reward_s": time.perf_counter() - t0 - rollout_s}
        metrics |= {f"rl/reward_{k}": sum(v) / len(v) for k, v in scores.terms.items() if len(scores.terms) > 1}
        return Rollout(cycle, comp, adv, old, metrics)

    def _prompts(self, model, index: list[int]) -> list[list[int]]:
        """The records' prompts as evaluation encodes them (chat template), each once; one too long for the context
        keeps its end (a line on stderr says so)."""
        new = [i for i in dict.fromkeys(index) if i not in self.prompt_ids]
        if new:
            ids = encode_prompts(self.tok, [self.records[i] for i in new], model, self.max_new, truncate=True)
            self.prompt_ids.update(zip(new, ids))
        return [self.prompt_ids[i] for i in index]

    @torch.no_grad()
    def _sample(self, model, prompts, keys) -> tuple[Completions, list[str], list[int]]:
        """G completions per prompt, each group from a generator keyed by its prompt's place in the stream."""
        tok, device = self.tok, model_device(model)
        masked = self.rl.family == "masked"
        W = num_blocks(self.max_new, self.block) * self.block if self.block else self.max_new
        canvas, scored, texts, nfe = [], [], [], []
        for ids, key in zip(prompts, keys):
            gen = make_generator(zlib.crc32(repr((self.seed, key)).encode()), model)
            out = generate(model, [ids] * self.G, self.options, max_new_tokens=self.max_new, eos_id=tok.eos_token_id,
                           pad_id=tok.pad_token_id, temperature=self.rl.temperature, generator=gen)
            for t in out.tokens:
                t = t[:W]
                fill = [tok.eos_token_id] * (W - len(t)) if masked else \
                    ([tok.eos_token_id] + [tok.pad_token_id] * (W - len(t) - 1))[: W - len(t)]
                canvas.append(t + fill)
                scored.append(min(len(t) + 1, W))
                texts.append(tok.decode(t, skip_special_tokens=True))
            nfe += out.nfe
        canvas_t = torch.tensor(canvas, dtype=torch.long, device=device)
        scored_t = torch.arange(W, device=device)[None, :] < torch.tensor(scored, device=device)[:, None]
        groups = torch.tensor(keys, dtype=torch.long, device="cpu").repeat_interleave(self.G)  # keys masks, on the CPU
        return Completions([p for p in prompts for _ in range(self.G)], canvas_t, scored_t, groups), texts, nfe

    # ---- the loss -------------------------------------------------------------------------------------------------
    def _masks(self, comp: Completions, cycle: int, inner: int):
        return draw(self.kind, comp, (self.seed, cycle, inner), mc_num=self.rl.mc_num,
                    prompt_mask_prob=self.rl.prompt_mask_prob, block_size=self.block)

    def _logps(self, model, comp: Completions, masks, adv: torch.Tensor) -> torch.Tensor:
        return token_logps(model, comp, self.kind, masks, pad_id=self.tok.pad_token_id,
                           mask_id=unwrapped(model).spec.mask_token_id, negative=adv < 0,
                           spg_beta=self.rl.spg_beta, spg_mix=self.rl.spg_mix)

    @torch.no_grad()
    def _old_logps(self, model, comp: Completions, adv: torch.Tensor, cycle: int) -> list[torch.Tensor]:
        return [self._logps(model, comp, self._masks(comp, cycle, j), adv) for j in range(self.rl.inner_steps)]

    @torch.no_grad()
    def _reference_logps(self, comp: Completions, masks, adv: torch.Tensor) -> torch.Tensor:
        if self.reference is not None:
            return self._logps(self.reference, comp, masks, adv)
        model = unwrapped(self.model)
        training = model.training
        model.eval()
        try:
            with adapters_off(model):
                return self._logps(model, comp, masks, adv)
        finally:
            model.train(training)

    def loss(self, model, batch=None, plan=None):
        """(Σ over completion tokens of the negated clipped surrogate + β KL, their count, metrics)."""
        assert plan is not None
        roll = self.buffer[plan["micro"]]
        comp, adv, j = roll.comp, roll.advantages, plan["inner"]
        t0 = time.perf_counter()
        masks = self._masks(comp, roll.cycle, j)
        logp = self._logps(model, comp, masks, adv)
        old = roll.old[j] if roll.old is not None else logp.detach()
        ratio = torch.exp(logp - old)
        a = adv[:, None]
        surrogate = torch.min(ratio * a, ratio.clamp(1 - self.rl.clip, 1 + self.rl.clip) * a)
        keep = comp.scored
        per_token = -surrogate
        kl = torch.zeros((), device=logp.device)
        if self.rl.kl_beta:
            diff = self._reference_logps(comp, masks, adv) - logp
            kl_tok = torch.exp(diff) - diff - 1
            per_token = per_token + self.rl.kl_beta * kl_tok
            kl = (kl_tok * keep).sum() / keep.sum().clamp(min=1)
        n = keep.sum()
        clipped = ((ratio - 1).abs() > self.rl.clip) & keep
        passes = 1 if self.kind in ("exact", "mean_field") else self.rl.mc_num
        tokens = passes * sum(len(p) + comp.canvas.shape[1] for p in comp.prompts)
        metrics = {**(roll.metrics if j == 0 else {k: v for k, v in roll.metrics.items() if not k.endswith("_s")}),
                   "rl/kl": float(kl.detach()), "rl/clip_frac": float(clipped.sum() / n.clamp(min=1)),
                   "rl/score_s": time.perf_counter() - t0, "tokens": float(tokens)}
        return (per_token * keep).sum(), n, metrics

    # ---- checkpoints ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The current cycle's rollouts (the prompt stream is the trainer's, checkpointed with it)."""
        return {"buffer": {m: r.state() for m, r in self.buffer.items()}}

    def load_state_dict(self, state: dict) -> None:
        if self.model is None:  # before bind: kept until then
            self._pending = state
            return
        self._pending = None
        device = model_device(unwrapped(self.model))
        self.buffer = {int(m): Rollout.from_state(s, device) for m, s in state["buffer"].items()}
