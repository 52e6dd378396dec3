"""TESS 2 simplex diffusion: noise the k-logit simplices of the generated positions at one timestep per sequence,
predict the clean tokens with cross-entropy (Eq. 3), with self-conditioning and label shift (§3.1–3.3).

Which positions are generated: `prefix_lm` — the response (and its EOS), the prompt given (instruction tuning,
§3.3); `ul2` — the UL2 mixture over the whole valid sequence, one strategy per batch (adaptation, App. A.1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dlm.data.ul2 import STRATEGIES as UL2_STRATEGIES
from dlm.data.ul2 import ul2_mask
from dlm.diffusion.simplex import cosine_alpha_bar, noise_simplex, to_simplex
from dlm.modeling.simplex import input_embeddings, simplex_logits
from dlm.training.objectives.noise import ExampleNoise, batch_generator
from dlm.training.sharding import forward_with_inputs, is_sharded

MASKINGS = ("prefix_lm", "ul2")


def generated_positions(batch: dict, masking: str, label_shift: bool,
                        generator: torch.Generator | list[torch.Generator], ul2_prefix: str = "half",
                        strategy: str | None = None) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(generating [B, L], in_loss [B, L], strategy). Padding is never in the loss; with label shift position 0 has no
    prediction and is never generated. `strategy` fixes the UL2 strategy (else drawn from `generator`); a list of
    generators places each row's spans from its own generator."""
    if masking == "prefix_lm":
        generating, in_loss, strategy = batch["maskable"].clone(), batch["loss_mask"].clone(), "prefix_lm"
    elif masking == "ul2":
        ids = batch["input_ids"]
        positions = torch.arange(ids.shape[1], device=ids.device)[None, :]
        valid = batch["loss_mask"] | (positions < batch["prompt_len"][:, None])  # prompt, response, EOS: not padding
        if isinstance(generator, list):  # one generator per row (split-invariant noise)
            if strategy is None:
                raise ValueError("per-row UL2 spans need the batch's strategy")
            rows = [ul2_mask(v[None], g, strategy, prefix=ul2_prefix)[0] for v, g in zip(valid.cpu(), generator)]
            generating = torch.cat(rows)
        else:
            generating, strategy = ul2_mask(valid.cpu(), generator, strategy, prefix=ul2_prefix)
        generating = generating.to(ids.device)
        in_loss = generating & valid
    else:
        raise ValueError(f"unknown simplex masking {masking!r}; choose one of {', '.join(MASKINGS)}")
    if label_shift:
        generating[:, 0] = False
        in_loss[:, 0] = False
    return generating, in_loss, strategy


class SimplexObjective:
    def __init__(self, simplex_value: float = 5.0, timesteps: int = 5000, self_condition_prob: float = 0.5,
                 masking: str = "prefix_lm", label_shift: bool = False, seed: int = 0, rank: int = 0,
                 ul2_prefix: str = "half", ul2_strategy: str | None = None, max_length: int = 0):
        if masking not in MASKINGS:
            raise ValueError(f"unknown simplex masking {masking!r}; choose one of {', '.join(MASKINGS)}")
        self.k, self.T, self.p_sc = simplex_value, timesteps, self_condition_prob
        self.masking, self.label_shift, self.ul2_prefix = masking, label_shift, ul2_prefix
        self.ul2_strategy = ul2_strategy  # fixed strategy (measurements); None = the mixture
        self.alpha_bar = cosine_alpha_bar(timesteps)
        self.seed = seed
        self.noise = ExampleNoise(seed, max_length)  # each example's spans, timestep and ε (`rank` does not enter)
        self.direct_batches = 0  # per-batch keys of batches planned outside the trainer

    def plan(self, batch, update: int | None = None, micro: int = 0) -> dict:
        """Per-batch choices (UL2 strategy, self-conditioning), keyed by the update: the same on every rank (a rank
        that ran an extra forward would desynchronise DDP's collectives) and for every micro-batch of the update (so
        accumulation over micro-batches equals one large batch); each example's spans and timestep. ε [B, L, V] is
        drawn in `loss` (from the example's own generator), so a plan holds no vocabulary-sized tensor."""
        if update is None:
            update = -1 - self.direct_batches
            self.direct_batches += 1
        shared = batch_generator(self.seed, 5, update)
        strategy = None
        if self.masking == "ul2":
            strategy = self.ul2_strategy or UL2_STRATEGIES[int(torch.randint(len(UL2_STRATEGIES), (1,),
                                                                             generator=shared))]
        self_condition = bool(torch.rand(1, generator=shared) < self.p_sc)
        ids = self.noise.ids(batch)
        gens = self.noise.generators(ids, salt=3)
        generating, in_loss, strategy = generated_positions(batch, self.masking, self.label_shift, gens,
                                                            self.ul2_prefix, strategy)
        t = torch.cat([torch.randint(0, self.T, (1,), generator=g) for g in gens])  # one timestep per sequence
        return {"strategy": strategy, "self_condition": self_condition, "generating": generating, "in_loss": in_loss,
                "t": t, "example_id": ids, "count": in_loss.sum()}

    def loss(self, model, batch, plan=None):
        plan = plan if plan is not None else self.plan(batch)
        ids = batch["input_ids"]
        device, t, generating, in_loss = ids.device, plan["t"], plan["generating"], plan["in_loss"]
        vocab = getattr(model, "module", model).backbone.get_input_embeddings().weight.shape[0]
        L = ids.shape[1]
        z = self.epsilon(plan["example_id"], L, vocab, device)
        s0 = to_simplex(ids, vocab, self.k)
        s_t = noise_simplex(s0, self.alpha_bar[t].to(device), z, self.k)  # TESS 2 Eq. 2
        kwargs = dict(attention_mask=batch["attention_mask"])
        previous = None
        if plan["self_condition"]:  # a first pass at the next-noisier timestep, same ε, without gradient
            t_next = (t + 1).clamp(max=self.T - 1)
            s_next = noise_simplex(s0, self.alpha_bar[t_next].to(device), z, self.k)
            with torch.no_grad():
                previous = _logits(_inner(model), ids, s_next, generating, (t_next.float() / self.T).to(device),
                                   **kwargs).detach()
        logits = _logits(model, ids, s_t, generating, (t.float() / self.T).to(device), previous, **kwargs)
        ce = F.cross_entropy(logits[in_loss].float(), ids[in_loss], reduction="sum")  # TESS 2 Eq. 3
        metrics = {"self_conditioned": float(plan["self_condition"]), "t_mean": float(t.float().mean()) / self.T,
                   f"ul2/{plan['strategy']}": 1.0, "generated_share": float(generating.float().mean())}
        return ce, in_loss.sum(), metrics

    def epsilon(self, example_id: torch.Tensor, length: int, vocab: int, device="cpu") -> torch.Tensor:
        """ε [B, length, vocab] ~ N(0, I) of TESS 2 Eq. 2, each row from its example's own generator, made on
        `device` (the model's): a vocabulary-sized draw is not made on the CPU and copied every update. Split
        invariance holds on any device; a CUDA generator's stream differs from the CPU's for the same seed."""
        return torch.stack([torch.randn(self.noise.width(length), vocab, generator=g, device=device)[:length]
                            for g in self.noise.generators(example_id, salt=4, device=device)])

    def state_dict(self) -> dict:
        return self.noise.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.noise.load_state_dict(state)  # old checkpoints: per-rank generator states, nothing to keep


def _logits(model, input_ids, noisy, generating, time, previous=None, attention_mask=None):
    """`simplex_logits`; under FSDP2 the input path (which reads the embedding weights) runs inside the forward."""
    if not is_sharded(model):
        return simplex_logits(model, input_ids, noisy, generating, time, previous, attention_mask=attention_mask)
    return forward_with_inputs(model, lambda: input_embeddings(model, input_ids, noisy, generating, time, previous),
                               None, attention_mask=attention_mask)


def _inner(model):
    """The module under a DDP wrapper (the no-gradient pass runs outside DDP); FSDP2 modules are their own."""
    return getattr(model, "module", model)
