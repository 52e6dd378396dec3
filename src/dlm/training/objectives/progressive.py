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
This reading of Table 1 is ours: the paper names the estimators but not where they attach. It diverges (pumba-
bridges.md): the score of a teacher-forced commit has no lower bound. `reinforce_sampled` is the estimator proper:
within the window the committed positions hold a sample of the model (the next passes read it), and the term scores
that sample; across windows the pool stays teacher-forced.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from dlm.diffusion.masking import loss_weight
from dlm.diffusion.progressive import StageConstruction, construction_for, student_forcing_ratio
from dlm.modeling.blocks import block_forward, response_blocks
from dlm.training.objectives.noise import mix, row_generators, rows_rand
from dlm.training.trajectories import TrajectoryPool


def _collective_device() -> torch.device:
    """Where the process group's tensors live (gloo: CPU, NCCL: the GPU)."""
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


class ProgressiveObjective:
    def __init__(self, cfg, mask_token_id: int, seed: int, rank: int, batch_size: int, grad_accum: int,
                 max_length: int, weight_cap: float = 5.0, z_loss: float = 1e-5, block_size: int | None = None,
                 world: int = 1):
        self.cfg, self.mask_token_id, self.block_size = cfg, mask_token_id, block_size
        self.seed, self.rank, self.world = seed, rank, world
        self.stream = None
        self.weight_cap, self.z_loss = weight_cap, z_loss
        self.batch_size, self.grad_accum, self.max_length = batch_size, grad_accum, max_length
        self.generator = torch.Generator().manual_seed(seed * 1_000_003 + rank + 7)
        self.pool: TrajectoryPool | None = None
        self.updates = 0  # optimizer updates so far (drives the K curriculum and student forcing)
        self.micro = 0  # micro-batches so far (which chunk of the pool advances next)
        self._pending_state: dict | None = None

    # ---- set-up ---------------------------------------------------------------------------------------------------
    def construction(self):
        """The construction at the current update (the same rule mask discrepancy rebuilds for a run)."""
        return construction_for(self.cfg, self.updates, self.block_size)

    def attach(self, stream, collate, carry_dim: int | None) -> None:
        """Bind the data stream the pool refills from (called by the trainer before the first update)."""
        size = self.batch_size * self.grad_accum * self.cfg.pool_factor
        self.stream = stream
        self.pool = TrajectoryPool(size, self.max_length, self._draw, collate, self.mask_token_id,
                                   self.construction(), self.generator, self.cfg.pad_in_loss,
                                   carry_dim if self.cfg.carry else None)
        if self._pending_state is not None:
            self._load_pool(self._pending_state)
            self._pending_state = None

    # ---- one window -----------------------------------------------------------------------------------------------
    def plan(self, batch=None, update: int = 0, micro: int = 0) -> dict:
        """Nothing to draw ahead: a window's loss is a mean over its passes, so it counts 1."""
        return {"count": torch.ones(())}

    def loss(self, model, batch=None, plan=None):
        """One BPTT window over the next chunk of the pool: (mean loss of its passes, count 1, metrics).

        Across processes the chunks of all ranks form one global chunk (rank r holds its rows r·b ... r·b + b - 1):
        its width, the number of passes, the loss denominators and the refills are global, and the carry dropout
        is keyed by global row, so 2 processes × b follow 1 process × 2b (threshold construction; student forcing,
        Gumbel noise, random initial masking and the stage construction draw from this rank's generator)."""
        if self.pool is None:
            raise RuntimeError("the pu objective needs attach(stream, collate, carry_dim) before training")
        cfg, pool, g = self.cfg, self.pool, self.generator
        rows = self._next_rows()
        device = next(model.parameters()).device
        # Like a collated batch, the chunk is cut to its longest canvas over all ranks (padding beyond it is never
        # attended).
        width = int(self._all(pool.lengths[rows].max(), "max"))
        loss_mask = pool.loss_mask[rows, :width].to(device)
        attention = torch.ones(len(rows), width, dtype=torch.long, device=device)
        blocks = group = None  # block PUMBA: (prompt_len, width) of each row for the vectorised layout; block ids
        if self.block_size:
            maskable = pool.maskable[rows, :width]
            blocks = (maskable.int().argmax(-1).to(device), pool.lengths[rows].to(device))
            group = response_blocks(maskable, self.block_size).to(device)
        embed = _embedding(model)
        bridge = make_bridge(cfg)
        eps = (student_forcing_ratio(self.updates, cfg.student_forcing_k, cfg.student_forcing_floor,
                                     cfg.student_forcing_warmup) if cfg.student_forcing_k else 1.0)
        carry = pool.carry[rows, :width].to(device) if pool.carry is not None else None
        total = torch.zeros((), device=device)
        passes, metrics = 0, {"masked_fraction": 0.0, "revealed_per_step": 0.0, "active_fraction": 0.0}
        global_rows = self._global_rows(rows)
        for pass_index in range(cfg.window):
            in_loss = (pool.masked(rows) & ~pool.done[rows][:, None])[:, :width].to(device) & loss_mask
            active = in_loss.any(-1)
            if not bool(self._all(active.any().float(), "max")):  # every rank runs the same passes (FSDP gathers)
                break
            keep = None
            if carry is not None and cfg.carry_drop_prob > 0:
                gens = row_generators(self.seed, mix(6, self.micro, pass_index), global_rows)
                keep = rows_rand(gens, 1)[:, 0] < 1 - cfg.carry_drop_prob
            carry_in = drop_carry(carry, cfg.carry_drop_prob, g, keep)
            noise = bridge.noise((len(rows), width, embed.weight.shape[0]), g, device)
            run = _Pass(model, embed, attention, pool.target[rows, :width].to(device), bridge, noise, blocks)
            args = (pool.canvas[rows, :width].to(device), carry_in, bridge.delta)
            if cfg.activation_checkpointing and torch.is_grad_enabled():
                ce, lse, conf, token, hidden, soft = checkpoint(run, *args, use_reentrant=False)
            else:
                ce, lse, conf, token, hidden, soft = run(*args)
            # Selection and commit (no gradient through the policy, Algorithm 1 line 9).
            keep_truth = (torch.rand(len(rows), width, generator=g) < eps) if eps < 1.0 else None
            reveal, _ = pool.advance(rows, conf.detach().cpu(), token.detach().cpu(), keep_truth, width)
            reveal = reveal[:, :width].to(device)
            step_loss, t, _ = pass_loss(ce, lse, in_loss, loss_mask, reveal, self.weight_cap, self.z_loss, group,
                                        cfg.balance_lambda, self._all if self.world > 1 else None)
            extra = bridge.loss_term(ce, in_loss, active)
            if extra is not None:
                total = total + extra
            total = total + step_loss
            passes += 1
            if bool(active.any()):  # under several ranks a pass may have no active row here
                metrics["masked_fraction"] += float(t[active].mean())
                metrics["revealed_per_step"] += float(reveal.sum(-1).float()[active].mean())
            metrics["active_fraction"] += float(active.float().mean())
            # What the next pass receives.
            if carry is not None:
                carry = hidden.float()
            bridge.commit(ce, reveal, soft)
        loss = total * self.world / max(passes, 1)  # × world: the ranks' shares average to the global loss
        metrics = {k: v / max(passes, 1) for k, v in metrics.items()}
        metrics["passes"] = float(passes)
        metrics["tokens"] = float(passes * int(pool.lengths[rows].sum()))  # real canvas positions, not padding
        metrics["retired"] = float(self._end_window(rows, width, carry))
        return loss, torch.ones((), device=device), metrics

    def _next_rows(self) -> torch.Tensor:
        """The chunk of the pool this micro-batch advances (PU+: chunks are visited in turn)."""
        chunk = self.micro % (self.pool.size // self.batch_size)
        return torch.arange(chunk * self.batch_size, (chunk + 1) * self.batch_size)

    def _end_window(self, rows: torch.Tensor, width: int, carry: torch.Tensor | None) -> int:
        """Window boundary (Algorithm 1, line 14): detach and store the carry, refill the retired trajectories;
        returns how many retired."""
        pool = self.pool
        if pool.carry is not None and carry is not None:
            stored = torch.zeros(len(rows), pool.length, carry.shape[-1])
            stored[:, :width] = carry.detach().float().cpu()
            pool.carry[rows] = stored
        retired = rows[pool.done[rows]]
        if self.world > 1:  # refill in global row order from the shared stream, as one process would
            counts = self._gather(torch.tensor([len(retired)]))
            start = int(counts[: self.rank].sum())
            pool.refill(retired, examples=self.stream.take_shared(int(counts.sum()), start, len(retired)))
        else:
            pool.refill(retired)
        self.micro += 1
        if self.micro % self.grad_accum == 0:
            self._end_update()
        return len(retired)

    def _draw(self, n: int) -> list:
        """n examples from the stream; the pool's first fill chunk by chunk under several ranks, so that chunk c of
        rank r holds the examples of global rows c·W·b + r·b ... (as one process with the whole pool would)."""
        if self.world == 1 or n % self.batch_size:
            return self.stream.take(n)
        return [e for _ in range(n // self.batch_size) for e in self.stream.take(self.batch_size)]

    def _global_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Index of each local row in the global pool (chunk c of rank r holds global rows c·W·b + r·b + j)."""
        b = self.batch_size
        return (rows // b) * b * self.world + self.rank * b + rows % b

    def _all(self, value: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """`value` reduced over ranks (sum or max); the identity in one process."""
        if self.world == 1:
            return value
        import torch.distributed as dist

        out = value.detach().float().cpu().clone() if op == "max" else value.float().clone()
        backend_tensor = out.to(_collective_device())
        dist.all_reduce(backend_tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return backend_tensor.to(value.device)

    def _gather(self, value: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        parts = [torch.zeros_like(value).to(_collective_device()) for _ in range(self.world)]
        dist.all_gather(parts, value.to(_collective_device()))
        return torch.cat(parts).cpu()

    def _reinforce(self, logp: torch.Tensor, reward: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        return reinforce_term(logp, reward, active, self.cfg.reinforce_weight)

    def _end_update(self) -> None:
        self.updates += 1
        construction = self.construction()
        if isinstance(construction, StageConstruction) and construction.K != self.pool.construction.K:
            self.pool.restart_all(construction)  # a change of K restarts every trajectory (Table 4 note)

    # ---- persistence ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        stages = None if self.pool is None else getattr(self.pool.construction, "K", None)
        return {"generator": self.generator.get_state(), "updates": self.updates, "micro": self.micro,
                "stages": stages, "pool": None if self.pool is None else self.pool.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.updates, self.micro = state["updates"], state["micro"]
        if self.pool is None:
            self._pending_state = state
        else:
            self._load_pool(state)

    def _load_pool(self, state: dict) -> None:
        self.pool.construction = self.construction()
        if state["pool"] is not None:
            self.pool.load_state_dict(state["pool"])


# ---- the loss of one pass -----------------------------------------------------------------------------------------
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


def drop_carry(carry: torch.Tensor | None, drop_prob: float, generator: torch.Generator,
               keep: torch.Tensor | None = None) -> torch.Tensor | None:
    """Carry dropout (Jo et al. 2026): each row's carry is zeroed with probability `drop_prob` (0: always passed);
    `keep` [B] gives the draw (else from `generator`)."""
    if carry is None or drop_prob <= 0:
        return carry
    if keep is None:
        keep = torch.rand(carry.shape[0], generator=generator) < 1 - drop_prob
    keep = keep.to(carry.device)
    return carry * keep[:, None, None].to(carry.dtype)


# ---- discrete bridges (Table 1, App. C.2) ------------------------------------------------------------------------
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


# ---- one forward pass ---------------------------------------------------------------------------------------------
def _embedding(model):
    inner = getattr(model, "module", model)  # DDP-wrapped
    return inner.backbone.get_input_embeddings()


class _Pass:
    """One forward pass of a window as a function of (canvas, carry, bridge delta), for activation checkpointing.
    Returns per-position CE against the targets and log-sum-exp [B, L] (fp32), confidence and argmax [B, L] (no
    gradient), the last hidden state [B, L, d], and the bridge's soft embedding q·E (or None)."""

    def __init__(self, model, embed, attention, targets, bridge: Bridge, noise, blocks=None):
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
    inner = getattr(model, "module", model)
    return inner.spec.mask_token_id
