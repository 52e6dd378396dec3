"""One pass of a progressive-unmasking window (PUMBA App. B.4.2): the forward pass (per-position CE, log-sum-exp,
confidence and argmax for the commit, the hidden state for the carry) and the pass's loss.

Loss of one pass (§B.4.2): per sequence, cross-entropy on the masked positions in the loss weighted by
min(1/t_k, cap), t_k the realised masked fraction of its positions in the loss, plus z-loss; normalised by the
number of positions in the loss, and rescaled by the fraction of sequences that still have masked positions in the
loss (`pass_loss`; PU+'s balanced loss, Eq. F.2, and block PUMBA's per-block t_k there too).
"""

from __future__ import annotations

import torch

from dlm.diffusion.masking import loss_weight
from dlm.modeling.blocks import block_forward
from dlm.training.objectives.bridges import Bridge


def embedding(model):
    """The model's input embedding (inside a DDP wrapper too)."""
    inner = getattr(model, "module", model)  # DDP-wrapped
    return inner.backbone.get_input_embeddings()


class Pass:
    """One forward pass of a window as a function of (canvas, carry, bridge delta), for activation checkpointing.
    Returns per-position CE against the targets and log-sum-exp [B, L] (fp32), confidence and argmax [B, L] (no
    gradient), the last hidden state [B, L, d], and the bridge's soft embedding q·E (or None). `blocks`: block PUMBA's
    (prompt length, canvas length) of each row."""

    def __init__(self, model, embed, attention, targets, bridge: Bridge, noise,
                 blocks: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.model, self.embed, self.attention, self.targets = model, embed, attention, targets
        self.bridge, self.noise, self.blocks = bridge, noise, blocks

    def __call__(self, ids, carry, delta):
        if self.blocks is not None:  # block PUMBA: every block's step in one vectorised pass
            logits, hidden = block_forward(self.model, ids, self.targets, *self.blocks, carry=carry, return_hidden=True)
        else:
            kwargs = {"carry": carry, "return_hidden": True}
            if delta is not None:
                kwargs["embeds_delta"] = delta
            logits, hidden = self.model(ids, attention_mask=self.attention, **kwargs)
        logits = logits.float()
        lse = torch.logsumexp(logits, dim=-1)
        ce = lse - logits.gather(-1, self.targets[..., None]).squeeze(-1)
        with torch.no_grad():
            conf, token = fast_confidences(logits.detach(), lse.detach(), _mask_id(self.model))
        soft = (self.bridge.from_logits(logits, self.noise, self.embed.weight, self.targets, _mask_id(self.model))
                if self.bridge.reads_logits else None)
        return ce, lse, conf, token, hidden, soft


def fast_confidences(logits: torch.Tensor, lse: torch.Tensor, mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(max probability, argmax) with the mask token excluded, from logits and their log-sum-exp, without a second
    [B, L, V] tensor: the same values as `policies.confidences` (up to float rounding)."""
    top2, idx2 = logits.topk(2, dim=-1)
    first_is_mask = idx2[..., 0] == mask_id
    top = torch.where(first_is_mask, top2[..., 1], top2[..., 0])
    token = torch.where(first_is_mask, idx2[..., 1], idx2[..., 0])
    # where the mask token is not the argmax its probability is < 1/2 and log1p(-p) is accurate
    p_mask = torch.exp(logits[..., mask_id] - lse).clamp(max=0.5)
    lse_without_mask = lse + torch.log1p(-p_mask)
    if bool(first_is_mask.any()):  # rare: recompute those positions exactly
        rows = logits[first_is_mask].clone()
        rows[:, mask_id] = float("-inf")
        lse_without_mask[first_is_mask] = torch.logsumexp(rows, dim=-1)
    return torch.exp(top - lse_without_mask), token


def _mask_id(model) -> int:
    """The model's mask token id (inside a DDP wrapper too)."""
    inner = getattr(model, "module", model)
    return inner.spec.mask_token_id


def pass_loss(ce: torch.Tensor, lse: torch.Tensor, in_loss: torch.Tensor, loss_mask: torch.Tensor,
              reveal: torch.Tensor, weight_cap: float = 5.0, z_loss: float = 1e-5, group: torch.Tensor | None = None,
              balance_lambda: float | None = None, reduce=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, t [B], active [B]) of one pass (App. B.4.2) from per-position CE and log-sum-exp [B, L].

    `in_loss` [B, L]: masked positions in the loss; `loss_mask`: all positions in the loss; t = the masked fraction of
    each row's positions in the loss. Loss: Σ min(1/t, cap)·CE over `in_loss` (t per block under block PUMBA, with
    block ids `group`) / |in_loss|, or with `balance_lambda` λ PU+'s λ·mean CE on the positions this step reveals +
    (1-λ)·mean CE on those still masked (Eq. F.2); plus z-loss · mean lse²; × the fraction of rows still active.
    With `reduce` (a sum over ranks) every count and fraction is global: this rank's share of the global loss."""
    reduce = reduce or (lambda x: x)
    active = in_loss.any(-1)
    count = reduce(in_loss.sum()).clamp(min=1)
    t = in_loss.sum(-1).float() / loss_mask.sum(-1).clamp(min=1).float()
    if balance_lambda is not None:  # PU+ Eq. F.2
        def part(sel):
            return (ce * sel).sum() / reduce(sel.sum()).clamp(min=1)

        loss = balance_lambda * part(in_loss & reveal) + (1 - balance_lambda) * part(in_loss & ~reveal)
    else:
        if group is None:
            weight = torch.where(active, loss_weight(t.clamp(min=1e-6), weight_cap), 0.0)[:, None]
        else:  # t_k of each block separately
            weight = block_weights(in_loss, loss_mask, group, weight_cap)
        loss = ((weight * ce) * in_loss).sum() / count
    loss = loss + z_loss * (lse.square() * in_loss).sum() / count
    share = reduce(active.float().sum()) / reduce(torch.tensor(float(active.numel()), device=active.device))
    return loss * share, t, active


def block_weights(in_loss: torch.Tensor, loss_mask: torch.Tensor, group: torch.Tensor, cap: float) -> torch.Tensor:
    """Per-position weight min(1/t_k, cap), t_k the masked fraction of the position's block [B, L]."""
    n = int(group.max()) + 1
    masked = torch.zeros(group.shape[0], n, device=group.device).scatter_add_(1, group, in_loss.float())
    total = torch.zeros(group.shape[0], n, device=group.device).scatter_add_(1, group, loss_mask.float())
    t = (masked / total.clamp(min=1)).gather(1, group)
    return torch.where(in_loss, loss_weight(t.clamp(min=1e-6), cap), 0.0)
