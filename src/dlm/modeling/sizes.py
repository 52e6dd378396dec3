"""Sizes written as text (`5GB`, `500MB`): the shard size `dlm convert` and `dlm export` share, defined once here
where the CLI can read it without importing torch."""

from __future__ import annotations

import re

from dlm.errors import DlmError

SHARD_SIZE = "5GB"  # the largest safetensors shard written (transformers' own default)


def parse_size(text: str | int) -> int:
    """Bytes from `2GB`, `500MB`, `64KB` (powers of 1024) or a plain number."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)I?B?\s*", str(text).upper())
    if m is None or float(m.group(1)) <= 0:
        raise DlmError(f"shard size {text!r}: expected a size such as 2GB, 500MB or a number of bytes")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2) or " "))
