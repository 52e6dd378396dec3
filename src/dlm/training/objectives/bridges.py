"""Discrete bridges for progressive unmasking (PUMBA Table 1, §3.2, App. C.2): what crosses from one pass of a
window to the next through the committed tokens, besides the carry.

The bridges keep the forward pass teacher-forced (committed positions hold the ground truth, so targets never
contradict the context) and differ only in the gradient they let through the commit: straight-through adds
q·E - sg(q·E) to the committed position's embedding with q = softmax(logits), Gumbel-softmax the same with
q = softmax((logits + g) / T), and REINFORCE adds the score-function term -w · sg(A) · log p(committed tokens), where
A is the next pass's negative per-sequence loss with a leave-one-out baseline, normalised to unit standard deviation.
This reading of Table 1 is ours: the paper names the estimators but not where they attach. It diverges (pumba-
bridges.md): the score of a teacher-forced commit has no lower bound. `reinforce_sampled` is the estimator proper:
within the window the committed positions hold a sample of the model (the next passes read it), and the term scores
that sample; across windows the pool stays teacher-forced.
"""

from __future__ import annotations

import torch


class Bridge:
    """No bridge (plain PU): committed tokens are constants, nothing but the carry crosses from pass to pass.

    A bridge lives for one window. Per pass it may draw `noise` (before the pass), turn the logits into a soft
    embedding (inside it), add a `loss_term` (before the pass's loss) and, after the commit, prepare `delta`, which
    the next pass adds to its token embeddings."""

    reads_logits = False  # whether the pass hands its logits to `from_logits` (inside the pass, for checkpointing)

    def __init__(self):
        self.delta: torch.Tensor | None = None

    def noise(self, shape, generator: torch.Generator, device) -> torch.Tensor | None:
        return None

    def from_logits(self, logits: torch.Tensor, noise: torch.Tensor | None, weight: torch.Tensor,
                    targets: torch.Tensor, mask_id: int):
        """What the pass's logits give the commit (a soft embedding, or a sample and its log-probability)."""
        raise NotImplementedError

    def loss_term(self, ce: torch.Tensor, in_loss: torch.Tensor, active: torch.Tensor) -> torch.Tensor | None:
        return None

    def commit(self, ce: torch.Tensor, reveal: torch.Tensor, soft: torch.Tensor | None) -> None:
        pass


class SoftBridge(Bridge):
    """Straight-through (`temperature` None: q = softmax(logits)) or Gumbel-softmax (q = softmax((logits + g) / T)):
    committed positions receive q·E - sg(q·E) in the next passes, zero forward and q's gradient backward."""

    reads_logits = True

    def __init__(self, temperature: float | None = None):
        super().__init__()
        self.temperature = temperature

    def noise(self, shape, generator, device):
        return None if self.temperature is None else gumbel_noise(shape, generator, device)

    def from_logits(self, logits, noise, weight, targets, mask_id):
        z = logits if noise is None else (logits + noise) / self.temperature
        return torch.softmax(z, dim=-1) @ weight.float()

    def commit(self, ce, reveal, soft):
        piece = torch.where(reveal[..., None], soft - soft.detach(), torch.zeros_like(soft))
        self.delta = piece if self.delta is None else self.delta + piece


class ReinforceBridge(Bridge):
    """REINFORCE: the next pass's negative per-sequence loss rewards log p(committed tokens) of this pass."""

    def __init__(self, weight: float):
        super().__init__()
        self.weight, self.logp = weight, None

    def loss_term(self, ce, in_loss, active):
        if self.logp is None:
            return None
        per_seq = ((ce * in_loss).sum(-1) / in_loss.sum(-1).clamp(min=1)).detach()
        return reinforce_term(self.logp, -per_seq, active, self.weight)

    def commit(self, ce, reveal, soft):
        self.logp = -(ce * reveal).sum(-1)  # log p(committed tokens) under this pass


class SampledReinforceBridge(ReinforceBridge):
    """REINFORCE on sampled commits (`reinforce_sampled`): inside the window every committed position holds a token
    a ~ p(·) drawn from this pass's prediction (mask token excluded; Gumbel-max on the objective's generator), so the
    next passes read the model's own choice, and -w · sg(A) · log p(a) rewards it with the next pass's negative
    per-sequence loss (A: leave-one-out baseline, unit sd; App. C.2). The pool still commits the ground truth, so the
    next window starts teacher-forced and no target changes. The action is sampled: E_a[∇ log p(a)] = 0, so the term
    adds no drift of its own. `reinforce` scores the teacher-forced commits, which the reward does not depend on; its
    term has no lower bound for a negative advantage (it drives log p(ground truth) to -∞)."""

    reads_logits = True

    def noise(self, shape, generator, device):
        return gumbel_noise(shape, generator, device)

    def from_logits(self, logits, noise, weight, targets, mask_id):
        z = logits.masked_fill(torch.arange(logits.shape[-1], device=logits.device) == mask_id, float("-inf"))
        token = (z.detach() + noise).argmax(-1)
        logp = z.gather(-1, token[..., None]).squeeze(-1) - torch.logsumexp(z, dim=-1)
        delta = (weight[token] - weight[targets]).detach().float()  # embedding of the sample in place of the truth
        return logp, delta

    def commit(self, ce, reveal, out):
        logp, delta = out
        self.logp = (logp * reveal).sum(-1)  # log p(sampled tokens at this pass's commits)
        piece = torch.where(reveal[..., None], delta, torch.zeros_like(delta))
        self.delta = piece if self.delta is None else self.delta + piece


def gumbel_noise(shape, generator: torch.Generator, device) -> torch.Tensor:
    u = torch.rand(*shape, generator=generator)
    return (-torch.log(-torch.log(u.clamp(1e-10, 1 - 1e-7)))).to(device)


def make_bridge(cfg) -> Bridge:
    if cfg.bridge == "straight_through":
        return SoftBridge()
    if cfg.bridge == "gumbel":
        return SoftBridge(cfg.gumbel_temperature)
    if cfg.bridge == "reinforce":
        return ReinforceBridge(cfg.reinforce_weight)
    if cfg.bridge == "reinforce_sampled":
        return SampledReinforceBridge(cfg.reinforce_weight)
    return Bridge()


def reinforce_term(logp: torch.Tensor, reward: torch.Tensor, active: torch.Tensor, weight: float) -> torch.Tensor:
    """Score-function term with a leave-one-out baseline and normalised advantages (App. C.2)."""
    r = reward[active]
    n = r.numel()
    if n < 2:
        return torch.zeros((), device=logp.device)
    baseline = (r.sum() - r) / (n - 1)
    adv = r - baseline
    adv = adv / adv.std().clamp(min=1e-6)
    return -weight * (adv.detach() * logp[active]).mean()
