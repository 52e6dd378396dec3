"""From a recipe's data section to tokenized examples and a resumable, rank-aware batch stream."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dlm.data.canvas import collate, collate_packed, make_example, pack_documents
from dlm.data.sources import DataError, load_records, read_text
from dlm.data.tokenizer import corpus_texts, encode_pair, load_tokenizer, train_bpe_tokenizer

if TYPE_CHECKING:  # the recipe's sections, read by field: data sits below the recipe schema
    from dlm.config import DataConfig, ModelConfig

SPLITS = ("train", "validation", "test")


def load_splits(cfg: DataConfig, default_dir: Path, required: Sequence[str] = ("prompt", "response")
                ) -> dict[str, list[dict]]:
    """Records of each available split, each with the `required` fields (a missing one is an error naming the file
    and line); tinymath is generated (once, deterministically) into `cfg.dir`."""
    if cfg.source == "tinymath":
        from dlm.data.tinymath import write_tinymath

        directory = Path(cfg.dir) if cfg.dir else default_dir
        wanted = {"level": cfg.level, "seed": cfg.seed, "n_train": cfg.n_train, "n_val": cfg.n_validation,
                  "n_test": cfg.n_test}
        meta = directory / "request.json"
        if not (meta.is_file() and json.loads(meta.read_text()) == wanted and (directory / "test.jsonl").is_file()):
            write_tinymath(directory, n_train=cfg.n_train, n_val=cfg.n_validation, n_test=cfg.n_test, level=cfg.level,
                           seed=cfg.seed)
            meta.write_text(json.dumps(wanted))
        paths: dict[str, str | None] = {s: str(directory / f"{s}.jsonl") for s in SPLITS}
    elif cfg.source == "text":
        return {s: [{"text": d} for d in read_text(p)] for s, p in
                {"train": cfg.train, "validation": cfg.validation}.items() if p}
    else:
        paths = {"train": cfg.train, "validation": cfg.validation, "test": cfg.test}
    splits = {s: load_records(p, split=s, required=required) for s, p in paths.items() if p}
    if cfg.preference_pairs and cfg.source == "tinymath":  # reward models: correct vs corrupted program (App. C)
        from dlm.data.tinymath import add_rejected

        splits = {s: add_rejected(records, seed=cfg.seed + i) for i, (s, records) in enumerate(splits.items())}
    return splits


def build_tokenizer(cfg: ModelConfig, train_records: Sequence[dict], cache_dir: Path):
    if cfg.tokenizer == "builtin":
        texts = [r["text"] for r in train_records] if "text" in train_records[0] else corpus_texts(train_records)
        return train_bpe_tokenizer(texts, cfg.vocab_size, cache_dir=cache_dir)
    return load_tokenizer(cfg.tokenizer)


def encode_examples(tok, records: Sequence[dict], max_length: int,
                    block_size: int | None = None) -> tuple[list, Callable]:
    """Training examples and the collate function that batches them: prompt/response canvases (responses rounded up
    to whole blocks with `block_size`), or packed rows of `max_length` tokens for plain text (pretraining-style
    objectives)."""
    if block_size and records and ("text" in records[0] or "rejected" in records[0]):
        raise DataError("block diffusion trains on prompt/response records (not plain text or preference pairs)")
    if records and "text" in records[0]:
        docs = [tok(r["text"], add_special_tokens=False)["input_ids"] for r in records]
        return list(pack_documents(docs, max_length, tok.eos_token_id)), _collate_packed
    if records and "rejected" in records[0]:  # preference pairs: (chosen = response, rejected)
        pairs = [(make_example(*encode_pair(tok, r["prompt"], r["response"]), max_length),
                  make_example(*encode_pair(tok, r["prompt"], r["rejected"]), max_length)) for r in records]
        return pairs, partial(_collate_pairs, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    examples = [make_example(*encode_pair(tok, r["prompt"], r["response"]), max_length, block_size=block_size)
                for r in records]
    return examples, partial(collate, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, block_size=block_size)


def _collate_pairs(pairs, eos_id: int, pad_id: int, pad_to: int | None = None) -> dict[str, torch.Tensor]:
    return collate([c for c, _ in pairs] + [r for _, r in pairs], eos_id, pad_id, pad_to=pad_to)


def _collate_packed(rows, pad_to: int | None = None) -> dict[str, torch.Tensor]:
    return collate_packed(rows)  # packed rows all have max_length tokens


class BatchStream:
    """Shuffled epochs over a fixed example list. Each global batch holds `batch_size × world_size` examples and rank
    r takes its slice, so 2 processes × b see exactly what 1 process × 2b sees: the same examples, padded to the same
    width (the longest canvas of the global batch: bidirectional models attend to padding), each with its position
    in the global stream (`example_id`, which keys its noise). `state_dict` makes resume exact."""

    def __init__(self, examples: Sequence, batch_size: int, collate_fn: Callable, seed: int = 0, rank: int = 0,
                 world_size: int = 1):
        global_batch = batch_size * world_size
        if len(examples) < global_batch:
            raise DataError(f"{len(examples)} training examples is fewer than one global batch ({global_batch}): "
                            "add data or lower train.batch_size")
        self.examples, self.batch_size, self.collate_fn = examples, batch_size, collate_fn
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.epoch, self.cursor = 0, 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> torch.Tensor:
        return torch.randperm(len(self.examples), generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))

    def __iter__(self):
        return self

    def __next__(self):
        return self.next_batches(1)[0]

    def next_batches(self, count: int) -> list[dict[str, torch.Tensor]]:
        """This rank's next `count` micro-batches (one update's accumulation), all padded to the longest canvas among
        the `count × batch_size × world_size` examples of the update, with `example_id` [B]."""
        steps = [self._advance(self.batch_size) for _ in range(count)]
        every = [self.examples[i] for _, idx in steps for i in idx]
        width = self.collate_fn(every)["input_ids"].shape[1] if self.world_size > 1 or count > 1 else None
        batches = []
        for first, idx in steps:
            mine = idx[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
            batch = self.collate_fn([self.examples[i] for i in mine], pad_to=width)
            start = first + self.rank * self.batch_size
            batch["example_id"] = torch.arange(start, start + self.batch_size)
            batches.append(batch)
        return batches

    def take(self, n: int) -> list:
        """The next `n` examples of this rank (the global stream advances by n × world size); trajectory pools
        refill from here one sample at a time."""
        _, idx = self._advance(n)
        return [self.examples[i] for i in idx[self.rank * n : (self.rank + 1) * n]]

    def take_shared(self, count: int, start: int, n: int) -> list:
        """The global stream advances by `count` examples (shared by all ranks, e.g. the trajectories retired on all
        of them, in rank order); this rank takes those at offsets [start, start + n)."""
        if count > len(self.examples):
            raise ValueError(f"cannot draw {count} examples from {len(self.examples)}")
        if count == 0:
            return []
        if self.cursor + count > len(self.examples):
            self.epoch, self.cursor = self.epoch + 1, 0
            self._perm = self._permutation(self.epoch)
        idx = self._perm[self.cursor + start : self.cursor + start + n].tolist()
        self.cursor += count
        return [self.examples[i] for i in idx]

    def _advance(self, n: int) -> tuple[int, list[int]]:
        """(global stream position of the first, example indices) of the next global batch of n × world size."""
        global_n = n * self.world_size
        if global_n > len(self.examples):
            raise ValueError(f"cannot draw {global_n} examples from {len(self.examples)}")
        if self.cursor + global_n > len(self.examples):
            self.epoch, self.cursor = self.epoch + 1, 0
            self._perm = self._permutation(self.epoch)
        first = self.epoch * len(self.examples) + self.cursor
        idx = self._perm[self.cursor : self.cursor + global_n].tolist()
        self.cursor += global_n
        return first, idx

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._perm = self._permutation(self.epoch)
