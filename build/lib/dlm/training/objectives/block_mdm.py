"""Vectorised block MDM (block diffusion, Arriola et al. 2025; PUMBA §4.2, App. B.4.1).

Every response block is masked at its own level t ~ U[0, 1] (n = clamp(ceil(t·S), 1, S) of its S positions, the EOS
filler included) and all blocks train in one forward pass over the interleaved clean/noised layout of
`dlm.modeling.blocks`. Loss: cross-entropy on the masked positions weighted by min(1/t_block, cap), plus z-loss,
normalised by the number of masked positions (as for the full-canvas MDM).
"""

from __future__ import annotations

import torch

from dlm.diffusion.masking import apply_mask, loss_weight
from dlm.diffusion.policies import confidence_rank
from dlm.modeling.blocks import block_forward, response_blocks


def sample_block_mask(maskable: torch.Tensor, block_size: int, generator: torch.Generator | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block, t ~ U[0, 1] and a uniform subset of n = clamp(ceil(t·S), 1, S) of its positions masked (Eq. 2.1 per
    block); returns (masked [B, L], realised level t = n / S of each position's block [B, L], 1 outside)."""
    B, L = maskable.shape
    group = response_blocks(maskable, block_size)
    n_groups = int(group.max()) + 1
    t = torch.rand(B, n_groups, generator=generator)
    n = torch.ceil(t * block_size).long().clamp(1, block_size)
    scores = torch.rand(B, L, generator=generator)
    rank = confidence_rank(scores, maskable, group)  # a uniformly random order inside each block
    n_pos = n.gather(1, group)
    masked = maskable & (rank < n_pos)
    level = torch.where(maskable, n_pos.float() / block_size, 1.0)
    return masked, level


class BlockMDMObjective:
    def __init__(self, mask_token_id: int, block_size: int, seed: int, rank: int = 0, weight_cap: float = 5.0,
                 z_loss: float = 1e-5):
        self.mask_token_id, self.block_size, self.weight_cap, self.z_loss = (
            mask_token_id, block_size, weight_cap, z_loss)
        self.generator = torch.Generator().manual_seed(seed * 1_000_003 + rank)  # masking noise, saved for resume

    def loss(self, model, batch):
        device = batch["input_ids"].device
        masked, level = sample_block_mask(batch["maskable"].cpu(), self.block_size, self.generator)
        masked, level = masked.to(device), level.to(device)
        return block_mdm_loss(model, batch, masked, level, self.mask_token_id, self.weight_cap, self.z_loss)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


def block_mdm_loss(model, batch, masked, level, mask_token_id, weight_cap=5.0, z_loss=1e-5):
    """(loss_sum, count, metrics) of one vectorised pass with the given masks and per-position block levels."""
    target = batch["input_ids"]
    width = batch["attention_mask"].sum(-1)  # prompt + response blocks of each row
    noised = apply_mask(target, masked, mask_token_id)
    logits = block_forward(model, noised, target, batch["prompt_len"], width).float()
    in_loss = masked & batch["loss_mask"]
    selected = logits[in_loss]
    lse = torch.logsumexp(selected, dim=-1)
    ce = lse - selected.gather(-1, target[in_loss][:, None]).squeeze(-1)
    weight = loss_weight(level[in_loss], weight_cap)
    loss_sum = (weight * ce).sum() + z_loss * lse.square().sum()
    return loss_sum, in_loss.sum(), {"mask_ratio": float(level[batch["maskable"]].mean())}
