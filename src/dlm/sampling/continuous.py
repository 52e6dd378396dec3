"""Row-level decoding for continuous batching: each request row is a small state machine that says what it needs
computed next (a *segment*: query tokens, their positions and which keys they may attend), and one forward pass
serves every row of a step, whatever their prompt lengths, options, stage or join time (`dlm serve`'s scheduler).

Row kinds (one per decoding path of `dlm.sampling.generate`):
- `MaskedRow`, a full-canvas masked model (with or without a block_size, with or without a carry): its whole
  [prompt | response] canvas each step, as `masked.decode` computes it; no cache.
- `BlockRow`, a block-causal model with its exact KV cache (`block_cache.decode_block_causal`): the keys and values
  of its prompt and finished blocks are cached; a step computes [just-finished clean block | noised block] (the
  prompt at the first block) or the noised block alone, against them.
- `ARRow`, the AR baseline with its KV cache (`autoregressive.generate`): the prompt, then one token per step.

`Batch` (`dlm.sampling.continuous_batch`) runs the rows: one forward pass per step for all of them against one
shared key/value cache. A sampled row draws from its own generator (shared by the rows of one request), so its result
depends on its seed only, not on the traffic beside it. Each row applies its own unmasking rule (policy, u, tau),
temperature and block size.

`budget` caps a row's forward passes (NFE): a row that reaches it stops with what it has committed (`truncated`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dlm.modeling.backbone import align_logits
from dlm.modeling.blocks import block_causal_allowed, canvas_blocks, num_blocks
from dlm.sampling.autoregressive import pick_tokens
from dlm.sampling.block_cache import _block_logits
from dlm.sampling.continuous_batch import Batch
from dlm.sampling.options import DECODER_RULES
from dlm.sampling.steps import finished, first_index, make_rule, reveal_step

__all__ = ["Batch", "Segment", "Row", "MaskedRow", "BlockRow", "ARRow", "has_rows", "make_row"]


@dataclass
class Segment:
    """What a row computes in a step: `ids` [Q] at `positions` [Q]; `allowed` [Q, Q], which of its own queries each
    query attends (besides every cached key of its row); the first `keep` positions' keys and values join the row's
    cache after the step; `carry` [Q, d] and `carry_mask` [Q] for a model with a carry."""

    ids: torch.Tensor
    positions: torch.Tensor
    allowed: torch.Tensor
    keep: int = 0
    carry: torch.Tensor | None = None
    carry_mask: torch.Tensor | None = None


class Row:
    """One sequence being decoded. Subclasses define `segment` and `advance`; `done`, `nfe`, `truncated` and
    `tokens()` (the generated ids before the first EOS) are read by the scheduler."""

    def __init__(self, budget: int | None):
        self.budget = budget
        self.nfe = 0
        self.done = False
        self.truncated = False

    def count(self) -> None:
        """One forward pass taken; a row over its budget stops with what it has."""
        self.nfe += 1
        if not self.done and self.budget is not None and self.nfe >= self.budget:
            self.done = self.truncated = True

    def segment(self) -> Segment:
        """What the row computes in its next step."""
        raise NotImplementedError

    def advance(self, raw: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """The row's step from its segment's raw outputs [Q, V] and last hidden states [Q, d] (None without a carry)."""
        raise NotImplementedError

    def tokens(self) -> list[int]:
        """The generated ids before the first EOS."""
        raise NotImplementedError


class _Masked(Row):
    """What both masked rows share: the canvas [1, P + G], the rule, the sampling draw, the step record."""

    def __init__(self, model, prompt, gen_length, eos_id, mask_id, options, temperature, generator, budget):
        super().__init__(budget)
        device = next(model.parameters()).device
        self.P, self.G = len(prompt), gen_length
        self.canvas = torch.cat([torch.as_tensor(prompt, dtype=torch.long, device=device),
                                 torch.full((gen_length,), mask_id, dtype=torch.long, device=device)])[None]
        self.positions = torch.arange(self.P + gen_length, device=device)
        self.eos_id, self.mask_id = eos_id, mask_id
        self.rule = make_rule(options.policy, options.reveal_count, options.confidence_threshold)
        self.temperature, self.generator = temperature, generator
        self.label_shift = model.spec.label_shift
        self.last: dict | None = None  # the last step: revealed [G] and confidence [G], for a live view

    def reveal(self, start: int, logits: torch.Tensor, eligible: torch.Tensor) -> None:
        """One denoising step on canvas[start : start + W] from logits [W, V]."""
        reveal, confidence, _ = reveal_step(self.canvas, slice(None), start, logits[None], eligible[None], self.rule,
                                            self.mask_id, self.temperature, self.generator)
        W = logits.shape[0]
        revealed = torch.zeros(self.G, dtype=torch.bool, device=self.canvas.device)
        shown = torch.zeros(self.G, device=self.canvas.device)
        revealed[start - self.P : start - self.P + W] = reveal[0]
        shown[start - self.P : start - self.P + W] = torch.where(reveal[0], confidence[0], 0.0)
        self.last = {"revealed": revealed, "confidence": shown}
        self.done = bool(finished(self.canvas[:, self.P :], self.eos_id, self.mask_id)[0])
        self.count()

    def region(self) -> torch.Tensor:
        return self.canvas[0, self.P :]

    def tokens(self) -> list[int]:
        region = self.region()
        end = int(first_index(region == self.eos_id))
        if self.truncated:  # only what was committed: the revealed prefix
            end = min(end, int(first_index(region == self.mask_id)))
        return region[:end].tolist()


class MaskedRow(_Masked):
    """A full-canvas masked model: the whole canvas every step (`masked.decode`), left to right in blocks when the
    options give a block_size, the carry passed from step to step (reset per block with reset_carry_per_block)."""

    def __init__(self, model, prompt, gen_length, eos_id, mask_id, options, temperature=0.0, generator=None,
                 budget=None):
        super().__init__(model, prompt, gen_length, eos_id, mask_id, options, temperature, generator, budget)
        L = self.P + gen_length
        self.block_of = torch.arange(gen_length, device=self.canvas.device) // (options.block_size or
                                                                                 max(gen_length, 1))
        self.uses_carry = bool(model.spec.carry)
        self.reset = options.reset_carry_per_block
        dtype = next(model.parameters()).dtype
        self.carry = torch.zeros(L, model.config.hidden_size, device=self.canvas.device, dtype=dtype) \
            if self.uses_carry else None
        self.last_block = 0
        self.done = bool(finished(self.canvas[:, self.P :], eos_id, mask_id)[0])

    def current(self) -> int:
        masked = self.region() == self.mask_id
        return int(self.block_of[first_index(masked).clamp(max=self.G - 1)])

    def segment(self) -> Segment:
        L = self.canvas.shape[1]
        allowed = torch.ones(L, L, dtype=torch.bool, device=self.canvas.device)
        carry = carry_mask = None
        if self.uses_carry:
            current = self.current()
            carry = self.carry
            assert carry is not None, "set by __init__ and by every advance under uses_carry"
            if self.reset and current != self.last_block:
                carry = self.carry = torch.zeros_like(carry)
            self.last_block = current
            carry_mask = torch.ones(L, dtype=torch.bool, device=self.canvas.device)
        return Segment(self.canvas[0], self.positions, allowed, 0, carry, carry_mask)

    def advance(self, raw: torch.Tensor, hidden: torch.Tensor | None) -> None:
        if self.uses_carry:
            if hidden is None:
                raise ValueError("MaskedRow.advance: a model with a carry needs its hidden states (return_hidden=True)")
            self.carry = hidden
        logits = align_logits(raw[None], self.label_shift)[0, self.P :]
        masked = self.region() == self.mask_id
        eligible = masked & (self.block_of == self.current())
        self.reveal(self.P, logits, eligible)


class BlockRow(_Masked):
    """A block-causal model with its exact KV cache (`block_cache.decode_block_causal`), block by block: the first
    step of a block computes [the clean block before it (the prompt for the first) | the block], keeps the clean
    part's keys and values and, under label shift, the prediction of the block's first token; later steps compute
    the block alone against the cache. The carry restarts from zero at each block and passes inside it."""

    def __init__(self, model, prompt, gen_length, eos_id, mask_id, options, temperature=0.0, generator=None,
                 budget=None):
        bs = options.block_size or model.spec.block_size
        super().__init__(model, prompt, num_blocks(gen_length, bs) * bs, eos_id, mask_id, options, temperature,
                         generator, budget)
        self.bs = bs
        self.blocks = canvas_blocks(self.P, self.G, bs, 1, self.canvas.device)[0]
        self.uses_carry = bool(model.spec.carry)
        self.hidden_size, self.dtype = model.config.hidden_size, next(model.parameters()).dtype
        self.s = self.P  # the current block's start
        self.first = True  # the next step is the block's first
        self.boundary = self.carry = None

    def segment(self) -> Segment:
        s, e = self.s, self.s + self.bs
        c = (0 if s == self.P else s - self.bs) if self.first else s
        device = self.canvas.device
        noised = torch.arange(c, e, device=device) >= s
        q_blocks = self.blocks[None, c:e]
        allowed = block_causal_allowed(q_blocks, noised[None], q_blocks, noised[None])[0]  # cached keys: all allowed
        carry = carry_mask = None
        if self.uses_carry:
            carry_mask = noised
            carry = torch.zeros(e - c, self.hidden_size, device=device, dtype=self.dtype) if self.first else \
                self.carry
        return Segment(self.canvas[0, c:e], self.positions[c:e], allowed, s - c, carry, carry_mask)

    def advance(self, raw: torch.Tensor, hidden: torch.Tensor | None) -> None:
        s, e = self.s, self.s + self.bs
        if self.first:  # the clean part (prompt or just-finished block) went into the cache
            c = 0 if s == self.P else s - self.bs
            self.boundary = raw[s - c - 1][None] if self.label_shift else None
            raw, hidden = raw[s - c :], (hidden[s - c :] if hidden is not None else None)
            self.first = False
        if self.uses_carry:
            self.carry = hidden
        logits = _block_logits(raw[None], self.boundary, self.bs)[0]
        self.reveal(s, logits, self.canvas[0, s:e] == self.mask_id)
        if not self.done and not bool((self.canvas[0, s:e] == self.mask_id).any()):
            self.s, self.first = e, True  # the block is finished: the next step starts the next one


class ARRow(Row):
    """The AR baseline with its KV cache: the prompt, then one token per step, until EOS or max_new_tokens."""

    def __init__(self, model, prompt, max_new_tokens, eos_id, temperature=0.0, generator=None, budget=None):
        super().__init__(budget)
        self.device = next(model.parameters()).device
        self.prompt = torch.as_tensor(prompt, dtype=torch.long, device=self.device)
        self.max_new, self.eos_id = max_new_tokens, eos_id
        self.temperature, self.generator = temperature, generator
        self.out: list[int] = []

    def segment(self) -> Segment:
        if not self.out:
            P = len(self.prompt)
            allowed = torch.ones(P, P, dtype=torch.bool, device=self.device).tril()
            return Segment(self.prompt, torch.arange(P, device=self.device), allowed, P)
        at = len(self.prompt) + len(self.out) - 1
        return Segment(torch.tensor([self.out[-1]], device=self.device), torch.tensor([at], device=self.device),
                       torch.ones(1, 1, dtype=torch.bool, device=self.device), 1)

    def advance(self, raw: torch.Tensor, hidden: torch.Tensor | None) -> None:
        token = int(pick_tokens(raw[-1:], self.temperature, self.generator)[0])
        self.out.append(token)
        self.done = token == self.eos_id or len(self.out) >= self.max_new
        self.count()

    def tokens(self) -> list[int]:
        return self.out[:-1] if self.out and self.out[-1] == self.eos_id else list(self.out)


def has_rows(model, options) -> bool:
    """Whether `options` decode row by row on this model: not simplex models (TESS 2's reverse process draws its noise
    for the whole batch), not Fast-dLLM's approximate caches, not the decoders' extra rules (sub-blocks, remasking,
    in-block reuse, EOS-aware stopping, an NFE budget: `steps.Step`), not a block-causal model without its KV cache (the
    uncached reference); those decode as a whole batch."""
    spec = model.spec
    if spec.family == "autoregressive":
        return True
    if spec.family != "masked" or options.cache is not None:
        return False
    if any(getattr(options, rule) is not None for rule in DECODER_RULES):  # the whole-batch decoders' rules
        return False
    return spec.attention != "block_causal" or options.kv_cache


@torch.inference_mode()  # the row's tensors are updated in place by `step`, under inference mode
def make_row(model, prompt, options, *, max_new_tokens: int, eos_id: int, temperature: float = 0.0,
             generator=None, budget: int | None = None) -> Row:
    """The row that decodes `prompt` with `options` (the model family's SamplingOptions) as `generate` would; a
    ValueError where that path has no row form (`has_rows`)."""
    if not has_rows(model, options):
        raise ValueError(f"{options!r} on a {model.spec.family} model decodes as a whole batch, not row by row")
    spec = model.spec
    if spec.family == "autoregressive":
        return ARRow(model, prompt, max_new_tokens, eos_id, temperature, generator, budget)
    kind = BlockRow if spec.attention == "block_causal" else MaskedRow
    return kind(model, prompt, max_new_tokens, eos_id, spec.mask_token_id, options, temperature, generator, budget)
