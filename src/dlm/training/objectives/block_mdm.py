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
from dlm.training.objectives.noise import ExampleNoise


def sample_block_mask(maskable: torch.Tensor, block_size: int, generator: torch.Generator | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block, t ~ U[0, 1] and a uniform subset of n = clamp(ceil(t·S), 1, S) of its positions masked (Eq. 2.1 per
    block); returns (masked [B, L], realised level t = n / S of each position's block [B, L], 1 outside)."""
    B, L = maskable.shape
    n_groups = int(response_blocks(maskable, block_size).max()) + 1
    t = torch.rand(B, n_groups, generator=generator)
    scores = torch.rand(B, L, generator=generator)
    return block_mask_from_uniforms(maskable, block_size, t, scores)


def block_mask_from_uniforms(maskable: torch.Tensor, block_size: int, t: torch.Tensor, scores: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_block_mask` from given uniforms: t [B, >= number of blocks] and scores [B, L]."""
    group = response_blocks(maskable, block_size)
    t = t[:, : int(group.max()) + 1]
    n = torch.ceil(t * block_size).long().clamp(1, block_size)
    rank = confidence_rank(scores, maskable, group)  # a uniformly random order inside each block
    n_pos = n.gather(1, group)
    masked = maskable & (rank < n_pos)
    level = torch.where(maskable, n_pos.float() / block_size, 1.0)
    return masked, level


class BlockMDMObjective:
    def __init__(self, mask_token_id: int, block_size: int, seed: int, rank: int = 0, weight_cap: float = 5.0,
                 z_loss: float = 1e-5, max_length: int = 0):
        self.mask_token_id, self.block_size, self.weight_cap, self.z_loss = (
            mask_token_id, block_size, weight_cap, z_loss)
        self.noise = ExampleNoise(seed, max_length)  # per-example masking noise (`rank` no longer enters it)

    def plan(self, batch, update: int = 0, micro: int = 0) -> dict:
        """Each example's block levels and masks from its own generator (one level per possible block)."""
        device = batch["input_ids"].device
        maskable = batch["maskable"].cpu()
        gens = self.noise.generators(self.noise.ids(batch), salt=2)
        levels = self.noise.width(maskable.shape[1]) // self.block_size + 2
        t, scores = self.noise.uniforms(gens, maskable.shape[1], levels)
        masked, level = block_mask_from_uniforms(maskable, self.block_size, t, scores)
        masked, level = masked.to(device), level.to(device)
        return {"masked": masked, "level": level, "count": (masked & batch["loss_mask"]).sum()}

    def loss(self, model, batch, plan=None):
        plan = plan if plan is not None else self.plan(batch)
        return block_mdm_loss(model, batch, plan["masked"], plan["level"], self.mask_token_id, self.weight_cap,
                              self.z_loss)

    def state_dict(self) -> dict:
        return self.noise.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.noise.load_state_dict(state)


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
