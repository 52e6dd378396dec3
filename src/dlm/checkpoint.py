"""Atomic checkpoints: everything is written into a temporary folder beside the target, marked COMPLETE, then
renamed into place; `latest` is replaced atomically. Every byte is written before anything is renamed, so a crash or
a full disk at any point leaves the previous checkpoint as `latest`."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from dlm.errors import DlmError


class CheckpointError(DlmError, OSError):
    """A checkpoint could not be written (e.g. a full disk); the previous one is still `latest`."""


COMPLETE = "COMPLETE"
LATEST = "latest"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def begin(root: Path, step: int) -> Path:
    """A fresh temporary folder for the checkpoint of `step` (same filesystem as `root`, so rename is atomic)."""
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".tmp-step_{step:07d}-", dir=root))


def commit(root: Path, tmp: Path, step: int, keep: int) -> Path:
    """Mark `tmp` complete, move it to `step_XXXXXXX`, point `latest` at it and prune older checkpoints. The two
    small files are written first: what can fail for lack of space fails before anything is renamed."""
    final = root / f"step_{step:07d}"
    pointer = root / f".{LATEST}.tmp"
    try:
        (tmp / COMPLETE).write_text(str(step))
        pointer.write_text(final.name)
    except OSError:
        pointer.unlink(missing_ok=True)
        raise
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    os.replace(pointer, root / LATEST)
    _fsync_dir(root)
    for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-step_*"):
        shutil.rmtree(stale, ignore_errors=True)
    return final


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    pointer = root / LATEST
    candidates = []
    if pointer.is_file():
        candidates.append(root / pointer.read_text().strip())
    candidates += sorted((p for p in root.glob("step_*") if p.is_dir()), reverse=True)
    for c in candidates:
        if (c / COMPLETE).is_file():
            return c
    return None


def step_of(checkpoint: Path) -> int:
    """The update a complete checkpoint was written at (its COMPLETE marker), without loading its state."""
    return int((checkpoint / COMPLETE).read_text().strip())
