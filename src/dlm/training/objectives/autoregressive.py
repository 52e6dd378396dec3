"""The AR baseline: next-token cross-entropy on the response tokens up to and including the first EOS (PUMBA §B.3)."""

from __future__ import annotations

import torch.nn.functional as F


class AutoregressiveObjective:
    def plan(self, batch, update: int = 0, micro: int = 0) -> dict:
        return {"count": batch["loss_mask"][:, 1:].sum()}

    def loss(self, model, batch, plan=None):
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"])
        targets = batch["input_ids"][:, 1:]
        mask = batch["loss_mask"][:, 1:]
        ce = F.cross_entropy(logits[:, :-1][mask].float(), targets[mask], reduction="sum")
        return ce, mask.sum(), {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
