"""Masked diffusion (MDM): mask a random subset of the maskable positions at a random level t, predict the tokens
under the masks; cross-entropy weighted by min(1/t, 5), plus z-loss (PUMBA Eq. 2.1, App. B.4)."""

from __future__ import annotations

from dlm.diffusion.masking import apply_mask, mask_from_uniforms, mdm_loss
from dlm.training.objectives.noise import ExampleNoise


class MDMObjective:
    def __init__(self, mask_token_id: int, seed: int, rank: int = 0, weight_cap: float = 5.0, z_loss: float = 1e-5,
                 max_length: int = 0):
        self.mask_token_id, self.weight_cap, self.z_loss = mask_token_id, weight_cap, z_loss
        self.noise = ExampleNoise(seed, max_length)  # per-example masking noise (`rank` no longer enters it)

    def plan(self, batch, update: int = 0, micro: int = 0) -> dict:
        """The masks (PUMBA Eq. 2.1): t and one score per position from each example's own generator."""
        maskable = batch["maskable"].cpu()
        ids = self.noise.ids(batch)
        gens = self.noise.generators(ids, salt=1)
        t, scores = self.noise.uniforms(gens, maskable.shape[1])
        masked, t = mask_from_uniforms(maskable, t, scores)
        device = batch["input_ids"].device
        masked, t = masked.to(device), t.to(device)
        return {"masked": masked, "t": t, "count": (masked & batch["loss_mask"]).sum()}

    def loss(self, model, batch, plan=None):
        plan = plan if plan is not None else self.plan(batch)
        masked, t = plan["masked"], plan["t"]
        noised = apply_mask(batch["input_ids"], masked, self.mask_token_id)
        logits = model(noised, attention_mask=batch["attention_mask"])
        loss_sum, count = mdm_loss(logits, batch["input_ids"], masked, batch["loss_mask"], t, self.weight_cap,
                                   self.z_loss)
        return loss_sum, count, {"mask_ratio": float(t.mean())}

    def state_dict(self) -> dict:
        return self.noise.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.noise.load_state_dict(state)
