"""Reward models: the Bradley–Terry loss −log σ(R(x, y_c) − R(x, y_r)) on preference pairs (TESS 2 App. C). A batch
holds the B chosen canvases then the B rejected ones (`collate_pairs`); each is scored at its EOS.

The forward runs through the (possibly DDP-wrapped) model so that gradients are synchronised; the final hidden state
is read with a forward hook on the decoder, and the unused LM-head logits enter the loss with weight 0 so that every
parameter takes part in the backward (DDP without find_unused_parameters)."""

from __future__ import annotations

import torch

from dlm.modeling.reward import REWARD_HEAD, bradley_terry_loss, last_token_index


def scores_through_wrapper(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(R [2B] at each canvas's EOS, the LM logits of the same forward)."""
    inner = getattr(model, "module", model)
    captured: dict[str, torch.Tensor] = {}
    hook = inner.backbone.base_model.register_forward_hook(
        lambda module, args, output: captured.__setitem__("hidden", output.last_hidden_state))
    try:
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"])
    finally:
        hook.remove()
    last = last_token_index(batch["loss_mask"])
    hidden = captured["hidden"][torch.arange(last.shape[0], device=last.device), last]
    return getattr(inner.backbone, REWARD_HEAD)(hidden).squeeze(-1).float(), logits


class RewardObjective:
    def plan(self, batch, update: int = 0, micro: int = 0) -> dict:
        return {"count": batch["input_ids"].new_tensor(batch["input_ids"].shape[0] // 2)}  # pairs

    def loss(self, model, batch, plan=None):
        scores, logits = scores_through_wrapper(model, batch)
        B = scores.shape[0] // 2
        chosen, rejected = scores[:B], scores[B:]
        margin = (chosen - rejected).detach()
        metrics = {"pair_accuracy": float((margin > 0).float().mean()), "reward_margin": float(margin.mean())}
        loss = bradley_terry_loss(chosen, rejected) + 0.0 * logits.float().sum()
        return loss, torch.tensor(B, device=scores.device), metrics

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
