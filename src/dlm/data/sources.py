"""Record sources: jsonl files, HF `datasets` (saved to disk or loadable by name) and plain text, validated with
errors that name the file, line and field."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from dlm.errors import DlmError


class DataError(DlmError, ValueError):
    """Bad input data; the message names the file, line and field."""


class Record(dict):
    """A record that remembers where it was read (`file:line`), so later checks (e.g. a prompt too long for the
    model) can point there. Compares and serialises as the plain dict it is."""

    where: str = ""


class Line(str):
    """A prompt read from a file, with where it was read (`file:line`)."""

    where: str = ""


def read_utf8(path: str | Path, error: type[Exception] = DataError) -> str:
    """The text of a UTF-8 file (a leading BOM dropped); a missing, unreadable or non-UTF-8 file raises `error` with
    the file (and, for bad bytes, the line and column)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except IsADirectoryError:
        raise error(f"{path}: is a directory, not a file") from None
    except OSError as err:
        raise error(f"{path}: cannot read it ({err.strerror or err})") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - data.rfind(b"\n", 0, err.start)
        raise error(f"{path}:{line}: not UTF-8 text (byte 0x{data[err.start]:02x} at column {column}); "
                    f"save the file as UTF-8") from None


def read_jsonl(path: str | Path, required: Sequence[str] = ("prompt", "response")) -> list[dict]:
    """Records from a jsonl file; each line must be a JSON object with the `required` string fields."""
    path = Path(path)
    records: list[dict] = []
    for lineno, line in enumerate(read_utf8(path).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{lineno}: malformed JSON ({err.msg} at column {err.colno})") from None
        _validate(record, required, f"{path}:{lineno}")
        record = Record(record)
        record.where = f"{path}:{lineno}"
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
        try:
            ds = datasets.load_dataset(str(name_or_path), split=split)
        except (FileNotFoundError, ConnectionError) as err:  # no such local path, hub offline or no such dataset
            raise DataError(f"{name_or_path}: no such file or dataset ({' '.join(str(err).split())})") from None
    records = []
    for i, row in enumerate(ds):
        row = {(field_map or {}).get(k, k): v for k, v in row.items()}
        _validate(row, required, f"{name_or_path}[{split}] row {i}")
        records.append(row)
    return records


def load_records(source: str | Path, split: str = "train",
                 required: Sequence[str] = ("prompt", "response")) -> list[dict]:
    """Dispatch on the source: `*.jsonl` → jsonl; anything else → HF datasets."""
    if str(source).endswith(".jsonl"):
        return read_jsonl(source, required)
    return load_hf_dataset(str(source), split=split, required=required)


def read_text(path: str | Path) -> list[str]:
    """Documents of a plain-text file, separated by blank lines."""
    docs = [d.strip() for d in read_utf8(path).split("\n\n")]
    docs = [d for d in docs if d]
    if not docs:
        raise DataError(f"{path}: empty text corpus")
    return docs


def read_prompts(path: str | Path) -> list[Line]:
    """Prompts of a file, one per non-empty line: plain text, or a JSON object with a "prompt" string field."""
    path = Path(path)
    prompts = []
    for lineno, line in enumerate(read_utf8(path).split("\n"), start=1):
        line = line.strip()
        if not line:
            continue
        where = f"{path}:{lineno}"
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{where}: malformed JSON ({err.msg} at column {err.colno})") from None
            _validate(record, ("prompt",), where)
            line = record["prompt"]
        prompt = Line(line)
        prompt.where = where
        prompts.append(prompt)
    if not prompts:
        raise DataError(f"{path}: no prompts (one per line: plain text or {{\"prompt\": ...}})")
    return prompts


def _validate(record: object, required: Sequence[str], where: str) -> None:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for field in required:
        if field not in record:
            has = ", ".join(map(str, record)) or "nothing"
            raise DataError(f"{where}: record is missing field {field!r} (has: {has})")
        value = record[field]
        if field == "answer":  # graded against: a number or a string
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise DataError(f"{where}: field 'answer' must be a number or a string, got {type(value).__name__}")
        elif not isinstance(value, str):
            raise DataError(f"{where}: field {field!r} must be a string, got {type(value).__name__}")
