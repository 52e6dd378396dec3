"""Reward models: the Bradley–Terry loss −log σ(R(x, y_c) − R(x, y_r)) on preference pairs (TESS 2 App. C). A batch
holds the B chosen canvases then the B rejected ones (`collate_pairs`); each is scored at its EOS."""

from __future__ import annotations

import torch

from dlm.modeling.reward import bradley_terry_loss, last_token_index, reward_scores


class RewardObjective:
    def loss(self, model, batch):
        scores = reward_scores(model, last_token_index(batch["loss_mask"]), input_ids=batch["input_ids"],
                               attention_mask=batch["attention_mask"])
        B = scores.shape[0] // 2
        chosen, rejected = scores[:B], scores[B:]
        margin = (chosen - rejected).detach()
        metrics = {"pair_accuracy": float((margin > 0).float().mean()), "reward_margin": float(margin.mean())}
        return bradley_terry_loss(chosen, rejected), torch.tensor(B, device=scores.device), metrics

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
