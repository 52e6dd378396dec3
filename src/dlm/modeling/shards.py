"""Safetensors shards written as they fill, so converting or merging a model holds at most one shard in memory;
named and indexed as transformers expects (`model.safetensors`, or `model-0000i-of-0000n.safetensors` + index)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from dlm.modeling.sizes import SHARD_SIZE, parse_size

DEFAULT_SHARD_BYTES = parse_size(SHARD_SIZE)
INDEX_FILE = "model.safetensors.index.json"


class ShardWriter:
    """Shards of at most `max_bytes` in `directory` (a tensor larger than that gets a shard of its own): each is
    written, and its tensors released, once the next tensor would overflow it."""

    def __init__(self, directory: str | Path, max_bytes: int = DEFAULT_SHARD_BYTES):
        self.directory, self.max_bytes = Path(directory), max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.size = self.total = 0
        self.files: list[list[str]] = []  # the keys of each written shard

    def add(self, key: str, tensor: torch.Tensor) -> None:
        n = tensor.numel() * tensor.element_size()
        if self.pending and self.size + n > self.max_bytes:
            self._flush()
        self.pending[key] = tensor.contiguous()
        self.size += n

    def _flush(self) -> None:
        save_file(self.pending, self.directory / f"part-{len(self.files)}.safetensors", metadata={"format": "pt"})
        self.files.append(list(self.pending))
        self.total += self.size
        self.pending, self.size = {}, 0

    def close(self) -> list[str]:
        """Write what is pending, give the shards their final names (+ index); returns the file names."""
        if self.pending or not self.files:
            self._flush()
        n = len(self.files)
        if n == 1:
            os.rename(self.directory / "part-0.safetensors", self.directory / "model.safetensors")
            return ["model.safetensors"]
        names, weight_map = [], {}
        for i, keys in enumerate(self.files):
            names.append(f"model-{i + 1:05d}-of-{n:05d}.safetensors")
            os.rename(self.directory / f"part-{i}.safetensors", self.directory / names[-1])
            weight_map.update(dict.fromkeys(keys, names[-1]))
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return names
