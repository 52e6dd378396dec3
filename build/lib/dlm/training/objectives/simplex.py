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
from dlm.modeling.simplex import simplex_logits

MASKINGS = ("prefix_lm", "ul2")


def generated_positions(batch: dict, masking: str, label_shift: bool, generator: torch.Generator,
                        ul2_prefix: str = "half",
                        strategy: str | None = None) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(generating [B, L], in_loss [B, L], strategy). Padding is never in the loss; with label shift position 0 has no
    prediction and is never generated. `strategy` fixes the UL2 strategy (else drawn from `generator`)."""
    if masking == "prefix_lm":
        generating, in_loss, strategy = batch["maskable"].clone(), batch["loss_mask"].clone(), "prefix_lm"
    elif masking == "ul2":
        ids = batch["input_ids"]
        positions = torch.arange(ids.shape[1], device=ids.device)[None, :]
        valid = batch["loss_mask"] | (positions < batch["prompt_len"][:, None])  # prompt, response, EOS: not padding
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
                 ul2_prefix: str = "half", ul2_strategy: str | None = None):
        if masking not in MASKINGS:
            raise ValueError(f"unknown simplex masking {masking!r}; choose one of {', '.join(MASKINGS)}")
        self.k, self.T, self.p_sc = simplex_value, timesteps, self_condition_prob
        self.masking, self.label_shift, self.ul2_prefix = masking, label_shift, ul2_prefix
        self.ul2_strategy = ul2_strategy  # fixed strategy (measurements); None = the mixture
        self.alpha_bar = cosine_alpha_bar(timesteps)
        self.generator = torch.Generator().manual_seed(seed * 1_000_003 + rank + 7)  # this rank's noise and spans
        # Per-batch choices (UL2 strategy, self-conditioning) are the same on every rank: a rank that ran an extra
        # forward would desynchronise DDP's collectives.
        self.batch_generator = torch.Generator().manual_seed(seed * 1_000_003 + 5)

    def loss(self, model, batch):
        ids = batch["input_ids"]
        device, g = ids.device, self.generator
        strategy = None
        if self.masking == "ul2":
            strategy = self.ul2_strategy or UL2_STRATEGIES[
                int(torch.randint(len(UL2_STRATEGIES), (1,), generator=self.batch_generator))]
        self_condition = bool(torch.rand(1, generator=self.batch_generator) < self.p_sc)
        generating, in_loss, strategy = generated_positions(batch, self.masking, self.label_shift, g, self.ul2_prefix,
                                                            strategy)
        vocab = getattr(model, "module", model).backbone.get_input_embeddings().weight.shape[0]
        B, L = ids.shape
        t = torch.randint(0, self.T, (B,), generator=g)  # one timestep per sequence
        z = torch.randn(B, L, vocab, generator=g).to(device)
        s0 = to_simplex(ids, vocab, self.k)
        s_t = noise_simplex(s0, self.alpha_bar[t].to(device), z, self.k)  # TESS 2 Eq. 2
        kwargs = dict(attention_mask=batch["attention_mask"])
        previous = None
        if self_condition:  # a first pass at the next-noisier timestep, same ε, without gradient (and outside DDP)
            t_next = (t + 1).clamp(max=self.T - 1)
            s_next = noise_simplex(s0, self.alpha_bar[t_next].to(device), z, self.k)
            with torch.no_grad():
                previous = simplex_logits(getattr(model, "module", model), ids, s_next, generating,
                                          (t_next.float() / self.T).to(device), **kwargs).detach()
        logits = simplex_logits(model, ids, s_t, generating, (t.float() / self.T).to(device), previous, **kwargs)
        ce = F.cross_entropy(logits[in_loss].float(), ids[in_loss], reduction="sum")  # TESS 2 Eq. 3
        metrics = {"self_conditioned": float(self_condition), "t_mean": float(t.float().mean()) / self.T,
                   f"ul2/{strategy}": 1.0, "generated_share": float(generating.float().mean())}
        return ce, in_loss.sum(), metrics

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "batch_generator": self.batch_generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.batch_generator.set_state(state["batch_generator"])
