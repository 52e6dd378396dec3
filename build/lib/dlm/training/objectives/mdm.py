"""Masked diffusion (MDM): mask a random subset of the maskable positions at a random level t, predict the tokens
under the masks; cross-entropy weighted by min(1/t, 5), plus z-loss (PUMBA Eq. 2.1, App. B.4)."""

from __future__ import annotations

import torch

from dlm.diffusion.masking import apply_mask, mdm_loss, sample_mask


class MDMObjective:
    def __init__(self, mask_token_id: int, seed: int, rank: int = 0, weight_cap: float = 5.0, z_loss: float = 1e-5):
        self.mask_token_id, self.weight_cap, self.z_loss = mask_token_id, weight_cap, z_loss
        self.generator = torch.Generator().manual_seed(seed * 1_000_003 + rank)  # masking noise, saved for resume

    def loss(self, model, batch):
        masked, t = sample_mask(batch["maskable"].cpu(), self.generator)
        masked, t = masked.to(batch["input_ids"].device), t.to(batch["input_ids"].device)
        noised = apply_mask(batch["input_ids"], masked, self.mask_token_id)
        logits = model(noised, attention_mask=batch["attention_mask"])
        loss_sum, count = mdm_loss(logits, batch["input_ids"], masked, batch["loss_mask"], t, self.weight_cap,
                                   self.z_loss)
        return loss_sum, count, {"mask_ratio": float(t.mean())}

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
