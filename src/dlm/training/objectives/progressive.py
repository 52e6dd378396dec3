"""Progressive unmasking with the carry and truncated BPTT: PUMBA (§3, Algorithm 1, App. B.2, B.4.2).

One call of `loss` is one window: W forward passes over the same trajectories of the pool, each followed by a step of
the construction (teacher-forced commits). The carry produced by a pass is the next pass's input and keeps its
graph inside the window; it is detached when the window ends (Algorithm 1, line 14) and stored in fp32 in the pool.

Loss of one pass (§B.4.2): per sequence, cross-entropy on the masked positions in the loss weighted by
min(1/t_k, cap), t_k the realised masked fraction of its positions in the loss, plus z-loss; normalised by the
number of positions in the loss, and rescaled by the fraction of sequences that still have masked positions in the
loss. The window's loss is the mean over its passes. Retired trajectories idle until the window ends and are then
refilled from the data stream (zero carry).

Block PUMBA (§4.2, App. B.4.2): with a block size, every response block is its own trajectory (its own top-u, its
own t_k), all blocks of a sample advance in lockstep in one vectorised pass (`dlm.modeling.blocks`), and the carry
restarts at zero in every block.

Ablations: discrete bridges through the committed tokens at W >= 2 without a carry (§3.2, App. C.2), student forcing
(App. C.3), PU+ (pool of pool_factor × batch visited in turn, random initial masking, loss balance λ of Eq. F.2,
App. F.6.1) and the training-time threshold on/off (App. F.7).

The bridges keep the forward pass teacher-forced (committed positions hold the ground truth, so targets never
contradict the context) and differ only in the gradient they let through the commit: straight-through adds
q·E - sg(q·E) to the committed position's embedding with q = softmax(logits), Gumbel-softmax the same with
q = softmax((logits + g) / T), and REINFORCE adds the score-function term -w · sg(A) · log p(committed tokens), where
A is the next pass's negative per-sequence loss with a leave-one-out baseline, normalised to unit standard deviation.
This reading of Table 1 is ours: the paper names the estimators but not where they attach.
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from dlm.diffusion.masking import loss_weight
from dlm.training.trajectories import StageConstruction, ThresholdConstruction, TrajectoryPool, stage_count


def student_forcing_ratio(update: int, k: float, floor: float, warmup: int) -> float:
    """eps(s) = max(floor, k / (k + exp(s / k))), s counted after the warm-up (App. C.3, Bengio et al. 2015)."""
    if update < warmup:
        return 1.0
    s = update - warmup
    x = s / k
    return max(floor, k / (k + math.exp(x))) if x < 700 else floor


class ProgressiveObjective:
    def __init__(self, cfg, mask_token_id: int, seed: int, rank: int, batch_size: int, grad_accum: int,
                 max_length: int, weight_cap: float = 5.0, z_loss: float = 1e-5, block_size: int | None = None):
        self.cfg, self.mask_token_id, self.block_size = cfg, mask_token_id, block_size
        self.weight_cap, self.z_loss = weight_cap, z_loss
        self.batch_size, self.grad_accum, self.max_length = batch_size, grad_accum, max_length
        self.generator = torch.Generator().manual_seed(seed * 1_000_003 + rank + 7)
        self.pool: TrajectoryPool | None = None
        self.updates = 0  # optimizer updates so far (drives the K curriculum and student forcing)
        self.micro = 0  # micro-batches so far (which chunk of the pool advances next)
        self.stages = stage_count(0, cfg.stages_start, cfg.stages_end, cfg.stages_increment, cfg.stages_every,
                                  cfg.stages_from)
        self._pending_state: dict | None = None

    # ---- set-up ---------------------------------------------------------------------------------------------------
    def construction(self):
        c = self.cfg
        if c.construction == "stages":
            return StageConstruction(self.stages, c.threshold)
        return ThresholdConstruction(c.reveal_count, c.threshold, c.random_initial_masking, self.block_size)

    def attach(self, stream, collate, carry_dim: int | None) -> None:
        """Bind the data stream the pool refills from (called by the trainer before the first update)."""
        size = self.batch_size * self.grad_accum * self.cfg.pool_factor
        self.pool = TrajectoryPool(size, self.max_length, stream.take, collate, self.mask_token_id,
                                   self.construction(), self.generator, self.cfg.pad_in_loss,
                                   carry_dim if self.cfg.carry else None)
        if self._pending_state is not None:
            self._load_pool(self._pending_state)
            self._pending_state = None

    # ---- one window -----------------------------------------------------------------------------------------------
    def loss(self, model, batch=None):
        if self.pool is None:
            raise RuntimeError("the pu objective needs attach(stream, collate, carry_dim) before training")
        cfg, pool = self.cfg, self.pool
        n_chunks = pool.size // self.batch_size
        chunk = self.micro % n_chunks
        rows = torch.arange(chunk * self.batch_size, (chunk + 1) * self.batch_size)
        device = next(model.parameters()).device
        # Like a collated batch, the chunk is cut to its longest canvas (padding beyond it is never attended).
        width = int(pool.lengths[rows].max())
        attention = torch.ones(len(rows), width, dtype=torch.long, device=device)
        embed = _embedding(model)
        blocks = None  # block PUMBA: (prompt_len, width) of each row for the vectorised layout, block ids
        if self.block_size:
            from dlm.training.objectives.block_mdm import response_blocks

            maskable = pool.maskable[rows, :width]
            blocks = (maskable.int().argmax(-1).to(device), pool.lengths[rows].to(device))
            group = response_blocks(maskable, self.block_size).to(device)
        carry = pool.carry[rows, :width].to(device) if pool.carry is not None else None
        delta = None  # bridge: gradient-carrying zero added to the embeddings of committed positions
        total = torch.zeros((), device=device)
        passes, metrics = 0, {"masked_fraction": 0.0, "revealed_per_step": 0.0, "active_fraction": 0.0}
        reinforce_logp: torch.Tensor | None = None
        eps = (student_forcing_ratio(self.updates, cfg.student_forcing_k, cfg.student_forcing_floor,
                                     cfg.student_forcing_warmup) if cfg.student_forcing_k else 1.0)
        for _ in range(cfg.window):
            masked = (pool.masked(rows) & ~pool.done[rows][:, None])[:, :width]
            in_loss = (masked & pool.loss_mask[rows, :width]).to(device)
            active = in_loss.any(-1)
            if not bool(active.any()):
                break
            ids = pool.canvas[rows, :width].to(device)
            targets = pool.target[rows, :width].to(device)
            carry_in = carry
            if carry_in is not None and cfg.carry_dropout < 1.0:
                keep = (torch.rand(len(rows), generator=self.generator) < cfg.carry_dropout).to(device)
                carry_in = carry_in * keep[:, None, None].to(carry_in.dtype)
            gumbel = None
            if cfg.bridge == "gumbel":
                u = torch.rand(len(rows), width, embed.weight.shape[0], generator=self.generator)
                gumbel = (-torch.log(-torch.log(u.clamp(1e-10, 1 - 1e-7)))).to(device)
            run = _Pass(model, embed, attention, targets, cfg.bridge, cfg.gumbel_temperature, gumbel, blocks)
            args = (ids, carry_in, delta)
            if cfg.activation_checkpointing and torch.is_grad_enabled():
                ce, lse, conf, token, hidden, soft = checkpoint(run, *args, use_reentrant=False)
            else:
                ce, lse, conf, token, hidden, soft = run(*args)
            # Selection and commit (no gradient through the policy, Algorithm 1 line 9).
            keep_truth = None
            if eps < 1.0:
                keep_truth = (torch.rand(len(rows), width, generator=self.generator) < eps)
            reveal, _ = pool.advance(rows, conf.detach().cpu(), token.detach().cpu(), keep_truth, width)
            reveal = reveal[:, :width].to(device)
            # Loss of this pass.
            t = in_loss.sum(-1).float() / pool.loss_mask[rows, :width].to(device).sum(-1).clamp(min=1).float()
            weight = torch.where(active, loss_weight(t.clamp(min=1e-6), self.weight_cap), 0.0)[:, None]
            if blocks is not None:  # t_k of each block separately (App. B.4.2)
                weight = _block_weights(in_loss, pool.loss_mask[rows, :width].to(device), group, self.weight_cap)
            if cfg.balance_lambda is not None:
                lam = cfg.balance_lambda
                rev, rest = in_loss & reveal, in_loss & ~reveal
                part = lambda sel: (ce * sel).sum() / sel.sum().clamp(min=1)  # noqa: E731
                step_loss = lam * part(rev) + (1 - lam) * part(rest)
            else:
                step_loss = ((weight * ce) * in_loss).sum() / in_loss.sum().clamp(min=1)
            step_loss = step_loss + self.z_loss * (lse.square() * in_loss).sum() / in_loss.sum().clamp(min=1)
            active_fraction = active.float().mean()
            step_loss = step_loss * active_fraction
            if cfg.bridge == "reinforce" and reinforce_logp is not None:
                # reward of the previous commit = minus this pass's per-sequence loss
                per_seq = ((ce * in_loss).sum(-1) / in_loss.sum(-1).clamp(min=1)).detach()
                total = total + self._reinforce(reinforce_logp, -per_seq, active)
            total = total + step_loss
            passes += 1
            metrics["masked_fraction"] += float(t[active].mean())
            metrics["revealed_per_step"] += float(reveal.sum(-1).float()[active].mean())
            metrics["active_fraction"] += float(active_fraction)
            # What the next pass receives.
            if pool.carry is not None:
                carry = hidden.float()
            if cfg.bridge in ("straight_through", "gumbel"):
                piece = torch.where(reveal[..., None], soft - soft.detach(), torch.zeros_like(soft))
                delta = piece if delta is None else delta + piece
            if cfg.bridge == "reinforce":
                logp = -(ce * reveal).sum(-1)  # log p(committed tokens) under this pass
                reinforce_logp = logp
        loss = total / max(passes, 1)
        # Window boundary: detach and store the carry, refill the retired trajectories.
        if pool.carry is not None and carry is not None:
            stored = torch.zeros(len(rows), pool.length, carry.shape[-1])
            stored[:, :width] = carry.detach().float().cpu()
            pool.carry[rows] = stored
        retired = rows[pool.done[rows]]
        pool.refill(retired)
        self.micro += 1
        if self.micro % self.grad_accum == 0:
            self._end_update()
        metrics = {k: v / max(passes, 1) for k, v in metrics.items()}
        metrics["passes"] = float(passes)
        metrics["retired"] = float(len(retired))
        return loss, torch.ones((), device=device), metrics

    def _reinforce(self, logp: torch.Tensor, reward: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """Score-function term with a leave-one-out baseline and normalised advantages (App. C.2)."""
        r = reward[active]
        n = r.numel()
        if n < 2:
            return torch.zeros((), device=logp.device)
        baseline = (r.sum() - r) / (n - 1)
        adv = r - baseline
        adv = adv / adv.std().clamp(min=1e-6)
        return -self.cfg.reinforce_weight * (adv.detach() * logp[active]).mean()

    def _end_update(self) -> None:
        self.updates += 1
        c = self.cfg
        if c.construction == "stages":
            K = stage_count(self.updates, c.stages_start, c.stages_end, c.stages_increment, c.stages_every, c.stages_from)
            if K != self.stages:
                self.stages = K
                self.pool.restart_all(self.construction())

    # ---- persistence ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "updates": self.updates, "micro": self.micro,
                "stages": self.stages, "pool": None if self.pool is None else self.pool.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.updates, self.micro, self.stages = state["updates"], state["micro"], state["stages"]
        if self.pool is None:
            self._pending_state = state
        else:
            self._load_pool(state)

    def _load_pool(self, state: dict) -> None:
        self.pool.construction = self.construction()
        if state["pool"] is not None:
            self.pool.load_state_dict(state["pool"])


def _block_weights(in_loss: torch.Tensor, loss_mask: torch.Tensor, group: torch.Tensor, cap: float) -> torch.Tensor:
    """Per-position weight min(1/t_k, cap), t_k the masked fraction of the position's block [B, L]."""
    n = int(group.max()) + 1
    masked = torch.zeros(group.shape[0], n, device=group.device).scatter_add_(1, group, in_loss.float())
    total = torch.zeros(group.shape[0], n, device=group.device).scatter_add_(1, group, loss_mask.float())
    t = (masked / total.clamp(min=1)).gather(1, group)
    return torch.where(in_loss, loss_weight(t.clamp(min=1e-6), cap), 0.0)


def _embedding(model):
    inner = getattr(model, "module", model)  # DDP-wrapped
    return inner.backbone.get_input_embeddings()


class _Pass:
    """One forward pass of a window as a function of (canvas, carry, bridge delta), for activation checkpointing.
    Returns per-position CE against the targets and log-sum-exp [B, L] (fp32), confidence and argmax [B, L] (no
    gradient), the last hidden state [B, L, d], and the soft embedding q·E of the bridges (or None)."""

    def __init__(self, model, embed, attention, targets, bridge, temperature, gumbel, blocks=None):
        self.model, self.embed, self.attention, self.targets = model, embed, attention, targets
        self.bridge, self.temperature, self.gumbel, self.blocks = bridge, temperature, gumbel, blocks

    def __call__(self, ids, carry, delta):
        if self.blocks is not None:  # block PUMBA: every block's step in one vectorised pass
            from dlm.modeling.blocks import block_forward

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
        soft = None
        if self.bridge in ("straight_through", "gumbel"):
            z = logits if self.gumbel is None else (logits + self.gumbel) / self.temperature
            soft = torch.softmax(z, dim=-1) @ self.embed.weight.float()
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
    inner = getattr(model, "module", model)
    return inner.spec.mask_token_id
