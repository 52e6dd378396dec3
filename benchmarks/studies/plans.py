"""A study's plan, fixed before its first cell (issue 17): arms, seeds, evaluations and settings from a YAML file
under benchmarks/plans/, with a digest that its table records; and what identifies the weights and problems a cell
used (`fingerprint`, `problems_digest`)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dlm.errors import DlmError


class StudyError(DlmError):
    """A plan that cannot be read, or a cell that does not belong to the table's plan."""


@dataclass(frozen=True)
class Plan:
    """What a study runs, fixed before its first cell: arms (in report order), seeds, evaluation keys and every other
    setting. `digest` identifies it; a table records the digest of the plan its cells came from."""

    name: str
    arms: tuple[str, ...]
    seeds: tuple[int, ...]
    evals: tuple[str, ...]
    settings: Mapping = field(default_factory=dict)
    source: str = "<plan>"

    def __post_init__(self):
        for name in ("arms", "seeds", "evals"):
            values = getattr(self, name)
            if not values:
                raise StudyError(f"{self.source}: field '{name}' is empty; list at least one")
            if len(set(values)) != len(values):
                raise StudyError(f"{self.source}: field '{name}' lists a value twice: {list(values)}")

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        path = Path(path)
        raw = read_yaml(path, "plan", StudyError)
        if not isinstance(raw, dict):
            raise StudyError(f"{path}: a plan is a mapping with name, arms, seeds, evals and settings")
        unknown = set(raw) - {"name", "arms", "seeds", "evals", "settings"}
        if unknown:
            raise StudyError(f"{path}: unknown field(s) {sorted(unknown)}; a plan has name, arms, seeds, evals, "
                             "settings")
        for name, kind in (("name", str), ("arms", list), ("seeds", list), ("evals", list)):
            if not isinstance(raw.get(name), kind):
                raise StudyError(f"{path}: field '{name}' must be a {kind.__name__}, got {raw.get(name)!r}")
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in raw["seeds"]):
            raise StudyError(f"{path}: field 'seeds' must list integers, got {raw['seeds']!r}")
        settings = raw.get("settings") or {}
        if not isinstance(settings, dict):
            raise StudyError(f"{path}: field 'settings' must be a mapping, got {settings!r}")
        return cls(raw["name"], tuple(str(a) for a in raw["arms"]), tuple(raw["seeds"]),
                   tuple(str(e) for e in raw["evals"]), settings, str(path))

    def as_dict(self) -> dict:
        return {"name": self.name, "arms": list(self.arms), "seeds": list(self.seeds), "evals": list(self.evals),
                "settings": json.loads(json.dumps(dict(self.settings), sort_keys=True))}

    def planned_arms(self, key: str) -> list[str]:
        """The arms evaluated on `key`: all, unless settings.eval_arms ({eval: [arms]}) names a subset."""
        return list((self.settings.get("eval_arms") or {}).get(key, self.arms))

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()[:16]


def fingerprint(model_dir: str | Path) -> str:
    """sha256 (first 16 hex digits) over a saved model's weight files, in name order: equal fingerprints mean the
    same weights, so a warm start rebuilt in a later session can be checked against the one the cells came from."""
    model_dir = Path(model_dir)
    files = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin")) if model_dir.is_dir() else []
    if not files:
        raise StudyError(f"{model_dir}: no .safetensors or .bin weight files to fingerprint")
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode())
        with p.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def problems_digest(records) -> str:
    """Identifies the problem list a cell was scored on (prompts and answers, in order): cells compare only on equal
    digests."""
    h = hashlib.sha256()
    for r in records:
        h.update(json.dumps([r["prompt"], r.get("answer")], sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def subset(flag: str, given, planned) -> list:
    """A driver's --seeds / --arms / --evals: the plan's items in the given order, or all of them (None). It only
    orders or limits what one run does, never what a cell means; an item the plan does not list is refused."""
    chosen = list(planned) if given is None else list(given)
    stray = [x for x in chosen if x not in planned]
    if stray:
        raise StudyError(f"--{flag} {stray} not in the plan's {flag} {list(planned)}; --{flag} only orders or limits")
    return chosen


def read_yaml(path: Path, what: str, error: type[Exception]):
    """The YAML document at `path`; a missing file or bad YAML is one `error` naming the file (`what`: its kind)."""
    import yaml

    try:
        return yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise error(f"{path}: {what} file not found") from None
    except yaml.YAMLError as e:
        raise error(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
