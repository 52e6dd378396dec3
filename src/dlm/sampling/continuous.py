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

`Batch` holds the running rows and one key/value cache for all of them: per layer [R, H, C, D] plus which of the C
columns are each row's (`valid` [R, C]; a row's own keys need not be contiguous). A step lays the rows' segments out
right-padded in one [R, Q] pass against that cache, with an additive mask that lets every query see exactly the keys
it would see alone (its row's cached keys and its own segment's pattern; padding queries see only themselves), so
greedy decoding gives each row the tokens it gets decoded alone. The columns a step keeps (the AR tokens, a block's
clean part) are appended; rows that leave are dropped by index and joining rows enter with no columns, one tensor
operation per layer either way; the cache is compacted when more than half of it is padding. A sampled row
draws from its own generator (shared by the rows of one request), so its result depends on its seed only, not on
the traffic beside it. Each row applies its own unmasking rule (policy, u, tau), temperature and block size.

`budget` caps a row's forward passes (NFE): a row that reaches it stops with what it has committed (`truncated`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer

from dlm.modeling.backbone import align_logits, kv_shape
from dlm.modeling.blocks import block_causal_allowed, canvas_blocks, num_blocks
from dlm.sampling.autoregressive import pick_tokens
from dlm.sampling.block_cache import _block_logits
from dlm.sampling.steps import finished, first_index, make_rule, reveal_step


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
            if self.reset and current != self.last_block:
                self.carry = torch.zeros_like(self.carry)
            self.last_block = current
            carry, carry_mask = self.carry, torch.ones(L, dtype=torch.bool, device=self.canvas.device)
        return Segment(self.canvas[0], self.positions, allowed, 0, carry, carry_mask)

    def advance(self, raw: torch.Tensor, hidden: torch.Tensor | None) -> None:
        if self.uses_carry:
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


class _SlotLayer(DynamicLayer):
    """One layer's cache for a step of rows a:b: the step's keys (values) are written into the batch's buffer at
    columns [C, C + Q) and attention reads columns [0, C + Q) of those rows; nothing is copied."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, C: int):
        super().__init__()
        self.keys, self.values, self.C, self.device, self.is_initialized = keys, values, C, keys.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.C + key_states.shape[2]
        self.keys[:, :, self.C : end] = key_states
        self.values[:, :, self.C : end] = value_states
        return self.keys[:, :, :end], self.values[:, :, :end]


class _SlotCache(Cache):
    def __init__(self, layers: list[_SlotLayer]):
        super().__init__(layers=layers)


class Batch:
    """The running rows and their shared key/value cache: per layer keys and values [rows, H, columns, D] in buffers
    with room to grow, `valid` [rows, columns] marking which columns hold each row's keys (a row's need not be
    contiguous) and C, the columns in use. A step writes every row's new keys at columns [C, C + Q) in place and keeps
    as many as the widest `keep` (the rest of a row's are marked invalid); a row that leaves is replaced by the last
    row (one row copied), a row that joins takes the next free slot; buffers double when full and are compacted when
    over half the used columns are padding. `add` and `drop` change the rows between steps; `step` runs one."""

    def __init__(self, model, pad_id: int):
        self.model, self.pad_id = model, pad_id
        self.rows: list[Row] = []
        self.cached = model.spec.family == "autoregressive" or model.spec.attention == "block_causal"
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.valid: torch.Tensor | None = None
        self.C = 0

    def __len__(self) -> int:
        return len(self.rows)

    def _reserve(self, rows: int, columns: int) -> None:
        """Buffers of at least `rows` x `columns`, growing by doubling (the used part copied)."""
        model = self.model
        R0, C0 = (0, 0) if self.valid is None else self.valid.shape
        if rows <= R0 and columns <= C0:
            return
        R1, C1 = max(rows, 2 * R0 if rows > R0 else R0, 8), max(columns, 2 * C0 if columns > C0 else C0, 64)
        param = next(model.parameters())
        heads, head_dim = kv_shape(model.config)
        n = len(self.rows)
        valid = torch.zeros(R1, C1, dtype=torch.bool, device=param.device)
        if self.valid is not None:
            valid[:n, : self.C] = self.valid[:n, : self.C]
        keys, values = [], []
        for layer in range(model.config.num_hidden_layers):
            # zeros, not empty: a padding column is masked, but a NaN in uninitialised memory would still reach
            # the scores (NaN + finfo.min is NaN) and the weighted values (0 x NaN)
            k = torch.zeros(R1, heads, C1, head_dim, dtype=param.dtype, device=param.device)
            v = torch.zeros_like(k)
            if self.keys:
                k[:n, :, : self.C], v[:n, :, : self.C] = self.keys[layer][:n, :, : self.C], \
                    self.values[layer][:n, :, : self.C]
            keys.append(k)
            values.append(v)
        self.keys, self.values, self.valid = keys, values, valid

    @torch.inference_mode()  # the buffers are inference tensors, updated in place
    def add(self, rows: list[Row]) -> None:
        """Rows join with no cached keys (their first segment computes their prompt)."""
        if not rows:
            return
        if self.cached:
            n = len(self.rows)
            self._reserve(n + len(rows), self.C)
            self.valid[n : n + len(rows)] = False
        self.rows += rows

    @torch.inference_mode()
    def drop(self, leaving: list[Row]) -> None:
        """Remove rows (finished, or their client left): each slot freed takes the last row."""
        gone = {id(r) for r in leaving}
        for i in reversed([i for i, r in enumerate(self.rows) if id(r) in gone]):
            last = len(self.rows) - 1
            if self.cached and i != last:
                for t in (*self.keys, *self.values):
                    t[i, :, : self.C] = t[last, :, : self.C]
                self.valid[i, : self.C] = self.valid[last, : self.C]
            self.rows[i] = self.rows[last]
            self.rows.pop()
        if not self.rows:
            self.C = 0

    def _compact(self) -> None:
        """Keep only the columns some row uses, each row's in order, when over half the used ones are padding."""
        n = len(self.rows)
        valid = self.valid[:n, : self.C]
        used = valid.sum(1)
        width = int(used.max()) if n else 0
        if self.C <= 2 * width + 16:
            return
        order = torch.sort((~valid).to(torch.uint8), dim=1, stable=True).indices[:, :width]  # valid first, in order
        for t in (*self.keys, *self.values):
            t[:n, :, :width] = t[:n, :, : self.C].gather(2, order[:, None, :, None].expand(n, t.shape[1], width,
                                                                                           t.shape[3]))
        self.valid[:n, :width] = torch.arange(width, device=used.device)[None] < used[:, None]
        self.C = width

    @torch.inference_mode()
    def step(self) -> list[Row]:
        """Every row's next segment, then each row's own step; returns the rows that finished (they have left the
        batch). Rows whose segments are of similar width share a forward pass; a joining row's prompt runs in its
        own, so that decoding rows are not padded to a prompt's width."""
        segments = [r.segment() for r in self.rows]
        widths = [len(s.ids) for s in segments]
        if self.cached:
            self._reserve(len(self.rows), self.C + max(widths))
        # a cached batch pays a copy for a group that is not a run of slots, an uncached one pays nothing: the
        # cached batch groups tighter (block rows at a block's first step, twice as wide, run on their own)
        for group in _groups(widths, 1.25 if self.cached else 2.0):
            self._forward(group, [segments[i] for i in group])
        if self.cached:
            width = max(s.keep for s in segments)
            keeps = torch.tensor([s.keep for s in segments], device=self.valid.device)
            self.valid[: len(self.rows), self.C : self.C + width] = \
                torch.arange(width, device=keeps.device)[None] < keeps[:, None]
            self.C += width
        finished = [r for r in self.rows if r.done]
        self.drop(finished)
        if self.cached and self.rows:
            self._compact()
        return finished

    def _forward(self, group: list[int], segments: list[Segment]) -> None:
        """One forward pass for the rows `group` (ascending slot indices), right-padded; each row advances. Slots
        a..b-1 in a run are read and written in place; other groups work on a copy of their rows' cache and write
        the step's columns back."""
        model = self.model
        device, dtype = segments[0].ids.device, next(model.parameters()).dtype
        R, Q, C = len(group), max(len(s.ids) for s in segments), self.C
        a, b = group[0], group[-1] + 1
        run = b - a == R
        index = None if run else torch.tensor(group, device=device)
        ids = torch.full((R, Q), self.pad_id, dtype=torch.long, device=device)
        positions = torch.zeros(R, Q, dtype=torch.long, device=device)
        own = torch.eye(Q, dtype=torch.bool, device=device).repeat(R, 1, 1)  # padding queries see themselves only
        real = torch.zeros(R, Q, dtype=torch.bool, device=device)
        uses_carry = any(s.carry is not None for s in segments)
        carry = torch.zeros(R, Q, model.config.hidden_size, device=device, dtype=dtype) if uses_carry else None
        carry_mask = torch.zeros(R, Q, dtype=torch.bool, device=device) if uses_carry else None
        for i, seg in enumerate(segments):  # each segment left-aligned, padded on the right
            q = len(seg.ids)
            ids[i, :q], positions[i, :q], own[i, :q, :q], real[i, :q] = seg.ids, seg.positions, seg.allowed, True
            if seg.carry is not None:
                carry[i, :q], carry_mask[i, :q] = seg.carry, seg.carry_mask
        valid = None if C == 0 else (self.valid[a:b, :C] if run else self.valid[index, :C])
        allowed = own if C == 0 else torch.cat([valid[:, None, :] & real[:, :, None], own], dim=2)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
        inputs = dict(attention_mask=mask[:, None], position_ids=positions, align=False)
        if self.cached:
            if run:
                buffers = [(k[a:b], v[a:b]) for k, v in zip(self.keys, self.values)]
            else:
                buffers = [(k[index, :, : C + Q], v[index, :, : C + Q]) for k, v in zip(self.keys, self.values)]
            inputs.update(cache=_SlotCache([_SlotLayer(k, v, C) for k, v in buffers]), use_cache=True)
        if uses_carry:
            raw, hidden = model(ids, carry=carry, carry_mask=carry_mask, return_hidden=True, **inputs)
        else:
            raw, hidden = model(ids, **inputs), None
        if self.cached and not run:  # the step's columns back into the batch's buffers
            for (k, v), (gk, gv) in zip(zip(self.keys, self.values), buffers):
                k[index, :, C : C + Q], v[index, :, C : C + Q] = gk[:, :, C:], gv[:, :, C:]
        for i, (row, seg) in enumerate(zip([self.rows[j] for j in group], segments)):
            q = len(seg.ids)
            row.advance(raw[i, :q], hidden[i, :q] if hidden is not None else None)


def _groups(widths: list[int], ratio: float) -> list[list[int]]:
    """Row indices grouped by segment width (each group ascending): sorted by width, a group takes rows up to `ratio`
    times its narrowest's width, so padding costs a group at most that factor of its work."""
    groups: list[list[int]] = []
    for i in sorted(range(len(widths)), key=lambda i: widths[i]):
        if groups and widths[i] <= ratio * widths[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return [sorted(g) for g in groups]


def has_rows(model, options) -> bool:
    """Whether `options` decode row by row on this model: not simplex models (TESS 2's reverse process draws its noise
    for the whole batch), not Fast-dLLM's approximate caches, not a block-causal model without its KV cache (the
    uncached reference); those decode as a whole batch."""
    spec = model.spec
    if spec.family == "autoregressive":
        return True
    if spec.family != "masked" or options.cache is not None:
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
