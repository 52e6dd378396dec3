"""Split-invariant noise: every example draws its noise from its own generator, seeded from (run seed, stream, the
example's position in the global data stream), so 2 processes × b draw exactly what 1 process × 2b draws, and a
resumed run what the uninterrupted one drew; nothing to save."""

from __future__ import annotations

import torch

from dlm.modeling.device import make_generator

_MASK64 = (1 << 64) - 1


def mix(*values: int) -> int:
    """A well-spread 63-bit seed from integers (splitmix64 over each value in turn)."""
    x = 0
    for v in values:
        x = (x + (int(v) & _MASK64) + 0x9E3779B97F4A7C15) & _MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        x ^= x >> 31
    return x >> 1


def row_generators(seed: int, stream: int, example_id: torch.Tensor, device="cpu") -> list[torch.Generator]:
    """One generator per row of a batch, from `example_id` [B] (global stream positions, `BatchStream`), on `device`
    (the CPU for the small draws, which are then the same on any machine)."""
    return [make_generator(mix(seed, stream, i), device) for i in example_id.tolist()]


def batch_generator(seed: int, stream: int, update: int) -> torch.Generator:
    """The generator of per-batch choices (e.g. UL2 strategy, self-conditioning) of an update: the same on every
    rank and every micro-batch."""
    return torch.Generator().manual_seed(mix(seed, stream, update))


def rows_rand(generators: list[torch.Generator], *shape: int) -> torch.Tensor:
    """[B, *shape] uniforms, row i from generator i (a fixed-size draw per row: the values do not depend on B)."""
    return torch.stack([torch.rand(*shape, generator=g) for g in generators])


class ExampleNoise:
    """The per-example generators of one objective. Batches from `BatchStream` carry `example_id`; a batch without
    it (an objective called directly, outside the trainer) takes consecutive ids from a counter. Draws per row have a
    fixed size (`max_length` positions) and are cut to the batch width, so they do not depend on the padding."""

    def __init__(self, seed: int, max_length: int = 0):
        self.seed, self.max_length = seed, max_length
        self.direct = 0

    def ids(self, batch: dict) -> torch.Tensor:
        if "example_id" in batch:
            return batch["example_id"].cpu()
        n = batch["input_ids"].shape[0]
        self.direct += n
        return torch.arange(self.direct - n, self.direct)

    def generators(self, ids: torch.Tensor, salt: int, device="cpu") -> list[torch.Generator]:
        return row_generators(self.seed, salt, ids, device)

    def width(self, length: int) -> int:
        return max(self.max_length, length)

    def uniforms(self, generators: list[torch.Generator], length: int, levels: int = 1
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(levels [B] (or [B, levels]), scores [B, length]) uniforms: the levels first, then one per position."""
        t = rows_rand(generators, levels)
        scores = torch.stack([torch.rand(self.width(length), generator=g)[:length] for g in generators])
        return (t[:, 0] if levels == 1 else t), scores

    def state_dict(self) -> dict:
        return {}  # stateless: the noise of an example is a function of the run seed and its stream position

    def load_state_dict(self, state: dict) -> None:
        pass  # checkpoints of the per-rank generator streams (before split-invariant noise) carry nothing to keep
