"""Progressive unmasking with the carry and truncated BPTT: PUMBA (§3, Algorithm 1, App. B.2, B.4.2).

One call of `loss` is one window: W forward passes over the same trajectories of the pool, each followed by a step of
the construction (teacher-forced commits). The carry produced by a pass is the next pass's input and keeps its
graph inside the window; it is detached when the window ends (Algorithm 1, line 14) and stored in fp32 in the pool.
The window's loss is the mean over its passes (each pass's loss: `pu_pass.pass_loss`). Retired trajectories idle
until the window ends and are then refilled from the data stream (zero carry).

Block PUMBA (§4.2, App. B.4.2): with a block size, every response block is its own trajectory (its own top-u, its
own t_k), all blocks of a sample advance in lockstep in one vectorised pass (`dlm.modeling.blocks`), and the carry
restarts at zero in every block.

Ablations: discrete bridges through the committed tokens at W >= 2 without a carry (§3.2, App. C.2), student forcing
(App. C.3), PU+ (pool of pool_factor × batch visited in turn, random initial masking, loss balance λ of Eq. F.2,
App. F.6.1) and the training-time threshold on/off (App. F.7). The bridges: `bridges`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch.utils.checkpoint import checkpoint

from dlm.diffusion.progressive import StageConstruction, construction_for, student_forcing_ratio
from dlm.modeling.blocks import response_blocks
from dlm.training.objectives.bridges import Bridge, make_bridge, reinforce_term
from dlm.training.objectives.noise import mix, row_generators, rows_rand
from dlm.training.objectives.pu_pass import Pass, embedding, pass_loss
from dlm.training.trajectories import TrajectoryPool


def _collective_device() -> torch.device:
    """Where the process group's tensors live (gloo: CPU, NCCL: the GPU)."""
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


class ExampleStream(Protocol):
    """What the pool refills from (`dlm.data.pipeline.BatchStream`)."""

    def take(self, n: int) -> list: ...

    def take_shared(self, count: int, start: int, n: int) -> list: ...


@dataclass
class _Window:
    """What every pass of one BPTT window reads: its rows of the pool, their width, and the fixed tensors."""

    rows: torch.Tensor
    width: int
    device: torch.device
    loss_mask: torch.Tensor  # [R, width] positions in the loss
    attention: torch.Tensor  # [R, width]
    blocks: tuple[torch.Tensor, torch.Tensor] | None  # block PUMBA: (prompt length, canvas length) of each row
    group: torch.Tensor | None  # block PUMBA: block id of each position
    embed: torch.nn.Embedding
    bridge: Bridge
    eps: float  # student forcing: the probability a commit keeps the ground truth (1: always)
    global_rows: torch.Tensor  # each row's index in the global pool (carry dropout is keyed by it)


class ProgressiveObjective:
    """PU / PUMBA training (PUMBA Algorithm 1): a pool of trajectories advanced one BPTT window per micro-batch."""

    def __init__(self, cfg, mask_token_id: int, seed: int, rank: int, batch_size: int, grad_accum: int,
                 max_length: int, weight_cap: float = 5.0, z_loss: float = 1e-5, block_size: int | None = None,
                 world: int = 1):
        self.cfg, self.mask_token_id, self.block_size = cfg, mask_token_id, block_size
        self.seed, self.rank, self.world = seed, rank, world
        self.stream: ExampleStream | None = None
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

    def attach(self, stream: ExampleStream, collate, carry_dim: int | None) -> None:
        """Bind the data stream the pool refills from (called by the trainer before the first update)."""
        size = self.batch_size * self.grad_accum * self.cfg.pool_factor
        self.stream = stream
        self.pool = TrajectoryPool(size, self.max_length, self._draw, collate, self.mask_token_id,
                                   self.construction(), self.generator, self.cfg.pad_in_loss,
                                   carry_dim if self.cfg.carry else None)
        if self._pending_state is not None:
            self._load_pool(self._pending_state)
            self._pending_state = None

    def _attached(self) -> TrajectoryPool:
        """The pool, which `attach` builds."""
        if self.pool is None:
            raise RuntimeError("the pu objective needs attach(stream, collate, carry_dim) before training")
        return self.pool

    def _stream(self) -> ExampleStream:
        """The data stream the pool refills from, which `attach` binds."""
        if self.stream is None:
            raise RuntimeError("the pu objective needs attach(stream, collate, carry_dim) before drawing examples")
        return self.stream

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
        pool = self._attached()
        window = self._open_window(model, self._next_rows())
        rows, width, device = window.rows, window.width, window.device
        carry = pool.carry[rows, :width].to(device) if pool.carry is not None else None
        total = torch.zeros((), device=device)
        passes, metrics = 0, {"masked_fraction": 0.0, "revealed_per_step": 0.0, "active_fraction": 0.0}
        for pass_index in range(self.cfg.window):
            in_loss = (pool.masked(rows) & ~pool.done[rows][:, None])[:, :width].to(device) & window.loss_mask
            active = in_loss.any(-1)
            if not bool(self._all(active.any().float(), "max")):  # every rank runs the same passes (FSDP gathers)
                break
            ce, lse, conf, token, hidden, soft = self._forward(model, window, carry, pass_index)
            step_loss, t, reveal = self._commit(window, ce, lse, conf, token, in_loss)
            extra = window.bridge.loss_term(ce, in_loss, active)
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
            window.bridge.commit(ce, reveal, soft)
        loss = total * self.world / max(passes, 1)  # × world: the ranks' shares average to the global loss
        metrics = {k: v / max(passes, 1) for k, v in metrics.items()}
        metrics["passes"] = float(passes)
        metrics["tokens"] = float(passes * int(pool.lengths[rows].sum()))  # real canvas positions, not padding
        metrics["retired"] = float(self._end_window(rows, width, carry))
        return loss, torch.ones((), device=device), metrics

    def _open_window(self, model, rows: torch.Tensor) -> _Window:
        """What the window's passes share, on the model's device. Like a collated batch, the chunk is cut to its
        longest canvas over all ranks (padding beyond it is never attended)."""
        cfg, pool = self.cfg, self._attached()
        device = next(model.parameters()).device
        width = int(self._all(pool.lengths[rows].max(), "max"))
        loss_mask = pool.loss_mask[rows, :width].to(device)
        attention = torch.ones(len(rows), width, dtype=torch.long, device=device)
        blocks = group = None  # block PUMBA: (prompt_len, width) of each row for the vectorised layout; block ids
        if self.block_size:
            maskable = pool.maskable[rows, :width]
            blocks = (maskable.int().argmax(-1).to(device), pool.lengths[rows].to(device))
            group = response_blocks(maskable, self.block_size).to(device)
        eps = (student_forcing_ratio(self.updates, cfg.student_forcing_k, cfg.student_forcing_floor,
                                     cfg.student_forcing_warmup) if cfg.student_forcing_k else 1.0)
        return _Window(rows, width, device, loss_mask, attention, blocks, group, embedding(model), make_bridge(cfg),
                       eps, self._global_rows(rows))

    def _forward(self, model, window: _Window, carry: torch.Tensor | None, pass_index: int) -> tuple:
        """One pass of the window (checkpointed when configured): its carry dropped out per row, the bridge's noise
        drawn; returns `Pass`'s (ce, lse, confidence, token, hidden, soft)."""
        cfg, pool, g = self.cfg, self._attached(), self.generator
        rows, width, device = window.rows, window.width, window.device
        keep = None
        if carry is not None and cfg.carry_drop_prob > 0:
            gens = row_generators(self.seed, mix(6, self.micro, pass_index), window.global_rows)
            keep = rows_rand(gens, 1)[:, 0] < 1 - cfg.carry_drop_prob
        carry_in = drop_carry(carry, cfg.carry_drop_prob, g, keep)
        noise = window.bridge.noise((len(rows), width, window.embed.weight.shape[0]), g, device)
        run = Pass(model, window.embed, window.attention, pool.target[rows, :width].to(device), window.bridge, noise,
                   window.blocks)
        args = (pool.canvas[rows, :width].to(device), carry_in, window.bridge.delta)
        if cfg.activation_checkpointing and torch.is_grad_enabled():
            return checkpoint(run, *args, use_reentrant=False)
        return run(*args)

    def _commit(self, window: _Window, ce, lse, conf, token, in_loss) -> tuple:
        """Selection and commit (no gradient through the policy, Algorithm 1 line 9; student forcing keeps the
        ground truth with probability eps), then the pass's loss: (loss, t, reveal)."""
        rows, width, device, g = window.rows, window.width, window.device, self.generator
        keep_truth = (torch.rand(len(rows), width, generator=g) < window.eps) if window.eps < 1.0 else None
        reveal, _ = self._attached().advance(rows, conf.detach().cpu(), token.detach().cpu(), keep_truth, width)
        reveal = reveal[:, :width].to(device)
        step_loss, t, _ = pass_loss(ce, lse, in_loss, window.loss_mask, reveal, self.weight_cap, self.z_loss,
                                    window.group, self.cfg.balance_lambda, self._all if self.world > 1 else None)
        return step_loss, t, reveal

    def _next_rows(self) -> torch.Tensor:
        """The chunk of the pool this micro-batch advances (PU+: chunks are visited in turn)."""
        chunk = self.micro % (self._attached().size // self.batch_size)
        return torch.arange(chunk * self.batch_size, (chunk + 1) * self.batch_size)

    def _end_window(self, rows: torch.Tensor, width: int, carry: torch.Tensor | None) -> int:
        """Window boundary (Algorithm 1, line 14): detach and store the carry, refill the retired trajectories;
        returns how many retired."""
        pool = self._attached()
        if pool.carry is not None and carry is not None:
            stored = torch.zeros(len(rows), pool.length, carry.shape[-1])
            stored[:, :width] = carry.detach().float().cpu()
            pool.carry[rows] = stored
        retired = rows[pool.done[rows]]
        if self.world > 1:  # refill in global row order from the shared stream, as one process would
            counts = self._gather(torch.tensor([len(retired)]))
            start = int(counts[: self.rank].sum())
            pool.refill(retired, examples=self._stream().take_shared(int(counts.sum()), start, len(retired)))
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
            return self._stream().take(n)
        return [e for _ in range(n // self.batch_size) for e in self._stream().take(self.batch_size)]

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
        pool = self._attached()
        if isinstance(construction, StageConstruction) and construction.K != pool.construction.K:
            pool.restart_all(construction)  # a change of K restarts every trajectory (Table 4 note)

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
        pool = self._attached()
        pool.construction = self.construction()
        if state["pool"] is not None:
            pool.load_state_dict(state["pool"])


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
