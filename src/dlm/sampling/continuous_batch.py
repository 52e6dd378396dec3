"""Continuous batching's shared step (`dlm serve`'s scheduler): `Batch` holds the running rows of
`dlm.sampling.continuous` and one key/value cache for all of them: per layer [R, H, C, D] plus which of the C
columns are each row's (`valid` [R, C]; a row's own keys need not be contiguous). A step lays the rows' segments out
right-padded in one [R, Q] pass against that cache, with an additive mask that lets every query see exactly the keys
it would see alone (its row's cached keys and its own segment's pattern; padding queries see only themselves), so
greedy decoding gives each row the tokens it gets decoded alone. The columns a step keeps (the AR tokens, a block's
clean part) are appended; rows that leave are dropped by index and joining rows enter with no columns, one tensor
operation per layer either way; the cache is compacted when more than half of it is padding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache

from dlm.modeling.backbone import kv_shape
from dlm.sampling.block_cache import InPlaceLayer

if TYPE_CHECKING:
    from dlm.sampling.continuous import Row, Segment


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
        # [rows, columns], allocated by `_reserve`; empty until then, on the model's device
        self.valid = next(model.parameters()).new_zeros((0, 0), dtype=torch.bool)
        self.C = 0

    def __len__(self) -> int:
        return len(self.rows)

    def _reserve(self, rows: int, columns: int) -> None:
        """Buffers of at least `rows` x `columns`, growing by doubling (the used part copied)."""
        model = self.model
        R0, C0 = self.valid.shape
        if rows <= R0 and columns <= C0:
            return
        R1, C1 = max(rows, 2 * R0 if rows > R0 else R0, 8), max(columns, 2 * C0 if columns > C0 else C0, 64)
        param = next(model.parameters())
        heads, head_dim = kv_shape(model.config)
        n = len(self.rows)
        valid = torch.zeros(R1, C1, dtype=torch.bool, device=param.device)
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
        for i, seg in enumerate(segments):  # each segment left-aligned, padded on the right
            q = len(seg.ids)
            ids[i, :q], positions[i, :q], own[i, :q, :q], real[i, :q] = seg.ids, seg.positions, seg.allowed, True
        if C == 0:
            allowed = own
        else:
            valid = self.valid[a:b, :C] if run else self.valid[index, :C]
            allowed = torch.cat([valid[:, None, :] & real[:, :, None], own], dim=2)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
        inputs = dict(attention_mask=mask[:, None], position_ids=positions, align=False)
        if self.cached:
            if run:
                buffers = [(k[a:b], v[a:b]) for k, v in zip(self.keys, self.values)]
            else:
                buffers = [(k[index, :, : C + Q], v[index, :, : C + Q]) for k, v in zip(self.keys, self.values)]
            inputs.update(cache=Cache(layers=[InPlaceLayer(k, v, C) for k, v in buffers]), use_cache=True)
        if any(s.carry is not None for s in segments):
            carry, carry_mask = _carry(segments, Q, model.config.hidden_size, dtype)
            raw, hidden = model(ids, carry=carry, carry_mask=carry_mask, return_hidden=True, **inputs)
        else:
            raw, hidden = model(ids, **inputs), None
        if self.cached and not run:  # the step's columns back into the batch's buffers
            for (k, v), (gk, gv) in zip(zip(self.keys, self.values), buffers):
                k[index, :, C : C + Q], v[index, :, C : C + Q] = gk[:, :, C:], gv[:, :, C:]
        for i, (row, seg) in enumerate(zip([self.rows[j] for j in group], segments)):
            q = len(seg.ids)
            row.advance(raw[i, :q], hidden[i, :q] if hidden is not None else None)


def _carry(segments: list[Segment], Q: int, hidden_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The carry [R, Q, d] and carry mask [R, Q] of the segments right-padded to Q (zero on padding and on the rows
    without a carry)."""
    device = segments[0].ids.device
    carry = torch.zeros(len(segments), Q, hidden_size, device=device, dtype=dtype)
    carry_mask = torch.zeros(len(segments), Q, dtype=torch.bool, device=device)
    for i, seg in enumerate(segments):
        if seg.carry is not None:
            if seg.carry_mask is None:
                raise ValueError("a Segment with a carry needs its carry_mask (which of its positions take the carry)")
            carry[i, : len(seg.ids)], carry_mask[i, : len(seg.ids)] = seg.carry, seg.carry_mask
    return carry, carry_mask


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
