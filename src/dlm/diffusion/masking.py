"""MDM forward masking and loss (PUMBA Eq. 2.1, with the min-SNR weight cap and z-loss of §B.4)."""

from __future__ import annotations

import torch


def sample_mask(maskable: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row t ~ U[0,1], mask a uniform subset of n = clamp(ceil(t·M), 1, M) maskable positions (PUMBA Eq. 2.1);
    returns (masked [B, L], realised ratio t = n / M [B])."""
    B, L = maskable.shape
    draw_device = generator.device if generator is not None else maskable.device
    t = torch.rand(B, generator=generator, device=draw_device).to(maskable.device)
    scores = torch.rand(B, L, generator=generator, device=draw_device).to(maskable.device)
    return mask_from_uniforms(maskable, t, scores)


def mask_from_uniforms(maskable: torch.Tensor, t: torch.Tensor, scores: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_mask` from given uniforms t [B] and scores [B, L]: the n lowest-scored maskable positions masked."""
    M = maskable.sum(-1)
    n = torch.minimum(torch.ceil(t * M).long().clamp(min=1), M)
    rank = scores.masked_fill(~maskable, float("inf")).argsort(-1).argsort(-1)
    masked = rank < n[:, None]
    return masked, n.float() / M.clamp(min=1).float()


def apply_mask(input_ids: torch.Tensor, masked: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """The noised sequence x_t: masked positions replaced by the mask token (PUMBA §2)."""
    return input_ids.masked_fill(masked, mask_token_id)


def loss_weight(t: torch.Tensor, weight_cap: float = 5.0) -> torch.Tensor:
    """Per-sample weight min(1/t, cap) (PUMBA Eq. 2.1 with the min-SNR cap of §B.4)."""
    return torch.clamp(1.0 / t.float(), max=weight_cap)


def mdm_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    masked: torch.Tensor,
    loss_mask: torch.Tensor,
    t: torch.Tensor,
    weight_cap: float = 5.0,
    z_loss: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_sum, count): Σ min(1/t, cap)·CE + z_loss·lse² over masked & loss_mask (PUMBA Eq. 2.1, §B.4).

    `logits` [B, L, V] are aligned (index i predicts token i). The caller divides by the count summed over
    micro-batches and ranks (the loss is normalised by the positions it is computed on, §B.4)."""
    in_loss = masked & loss_mask
    selected = logits[in_loss].float()  # [N, V]
    lse = torch.logsumexp(selected, dim=-1)
    ce = lse - selected.gather(-1, targets[in_loss][:, None]).squeeze(-1)
    weight = loss_weight(t, weight_cap)[:, None].expand_as(in_loss)[in_loss]
    loss_sum = (weight * ce).sum() + z_loss * lse.square().sum()
    return loss_sum, in_loss.sum()
