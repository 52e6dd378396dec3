"""Record sources: jsonl files, HF `datasets` (saved to disk or loadable by name) and plain text, validated with
errors that name the file, line and field."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


class DataError(ValueError):
    """Bad input data; the message names the file, line and field."""


def read_jsonl(path: str | Path, required: Sequence[str] = ("prompt", "response")) -> list[dict]:
    """Records from a jsonl file; each line must be a JSON object with the `required` string fields."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    records = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno}: malformed JSON ({err.msg} at column {err.colno})") from None
            _validate(record, required, f"{path}:{lineno}")
            records.append(record)
    if not records:
        raise DataError(f"{path}: no records")
    return records


def load_hf_dataset(name_or_path: str, split: str = "train", required: Sequence[str] = ("prompt", "response"),
                    field_map: dict[str, str] | None = None) -> list[dict]:
    """Records from an HF dataset saved with `save_to_disk`, a local data file/dir, or a hub name (when online);
    `field_map` renames columns (e.g. {"question": "prompt"})."""
    import datasets

    path = Path(name_or_path)
    if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[split]
    else:
        ds = datasets.load_dataset(str(name_or_path), split=split)
    records = []
    for i, row in enumerate(ds):
        row = {(field_map or {}).get(k, k): v for k, v in row.items()}
        _validate(row, required, f"{name_or_path}[{split}] row {i}")
        records.append(row)
    return records


def load_records(source: str | Path, split: str = "train", required: Sequence[str] = ("prompt", "response")) -> list[dict]:
    """Dispatch on the source: `*.jsonl` → jsonl; anything else → HF datasets."""
    if str(source).endswith(".jsonl"):
        return read_jsonl(source, required)
    return load_hf_dataset(str(source), split=split, required=required)


def read_text(path: str | Path) -> list[str]:
    """Documents of a plain-text file, separated by blank lines."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    docs = [d.strip() for d in path.read_text(encoding="utf-8").split("\n\n")]
    docs = [d for d in docs if d]
    if not docs:
        raise DataError(f"{path}: empty text corpus")
    return docs


def _validate(record: object, required: Sequence[str], where: str) -> None:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for field in required:
        if field not in record:
            raise DataError(f"{where}: record is missing field {field!r} (has: {', '.join(map(str, record)) or 'nothing'})")
        if not isinstance(record[field], str):
            raise DataError(f"{where}: field {field!r} must be a string, got {type(record[field]).__name__}")
