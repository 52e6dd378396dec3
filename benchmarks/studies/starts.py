"""The studies' pinned starts, kept in the repository (issue 17): the AR parent and warm starts that the
pre-registered plans continue, so that a plan spans sessions. git tracks their manifest (benchmarks/starts/starts.json:
per start its runs/ path, fingerprint and data digests), not their weights, which live under benchmarks/starts/ on the
machine that saved them. `save` copies a finished run in; `restore` puts it back and regenerates its tinymath data,
checked against the digests; benchmarks/starts.py is the command line and says why starts are kept."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STORE = ROOT / "benchmarks" / "starts"
RUN_FILES = ("recipe.yaml", "metrics.jsonl")
DATA_FILES = ("train.jsonl", "validation.jsonl", "test.jsonl", "test_unseen.jsonl")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def manifest(store: Path = STORE) -> dict:
    """The saved starts' manifest: {name: {path, fingerprint, data}}, empty before the first save."""
    path = store / "starts.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _write_manifest(store: Path, saved: dict) -> None:
    tmp = store / "starts.json.tmp"
    tmp.write_text(json.dumps(saved, indent=1, sort_keys=True) + "\n")
    tmp.replace(store / "starts.json")


def _data_dir(run: Path) -> tuple[Path | None, dict | None]:
    """The tinymath directory a run trained on and the settings that regenerate it (None for other sources)."""
    import yaml

    recipe = yaml.safe_load((run / "recipe.yaml").read_text())
    data = recipe.get("data") or {}
    if data.get("source") != "tinymath":
        return None, None
    directory = Path(data["dir"]) if data.get("dir") else run / "data"
    return directory, data


def save(run: str | Path, store: Path = STORE, root: Path = ROOT) -> dict:
    """Copy a finished run's model (and recipe, metrics) into the store under the run's directory name."""
    from dlm.errors import DlmError
    from studies.plans import fingerprint

    run = Path(run)
    absolute = run if run.is_absolute() else root / run
    if not (absolute / "model" / "config.json").is_file() or not all((absolute / f).is_file() for f in RUN_FILES):
        raise DlmError(f"{run}: not a finished run (needs model/, {', '.join(RUN_FILES)})")
    name = absolute.name
    target = store / name
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(absolute / "model", target / "model")
    for f in RUN_FILES:
        shutil.copy2(absolute / f, target / f)
    entry = {"path": str(run), "fingerprint": fingerprint(target / "model")}
    directory, data = _data_dir(absolute)
    if directory is not None:
        d = directory if directory.is_absolute() else root / directory
        if d.resolve().is_relative_to(root.resolve()):
            directory = d.resolve().relative_to(root.resolve())  # the manifest holds no machine's absolute paths
        entry["data"] = {"dir": str(directory), **{f: _sha(d / f) for f in DATA_FILES if (d / f).is_file()}}
    saved = manifest(store)
    saved[name] = entry
    _write_manifest(store, saved)
    return entry


def restore(store: Path = STORE, root: Path = ROOT, names=None, absent: list | None = None) -> list[str]:
    """Put every saved start (or `names`) back at its runs/ path, unless that path already holds the same weights;
    regenerate its tinymath data and check it. Returns what was restored. A start whose weights are not in the store
    (a fresh clone: weights stay out of git) is an optimisation missed, not an error: it is listed in `absent` (when
    given) and skipped; the plans build their starts with their own commands (issue 48)."""
    from dlm.config import DataConfig
    from dlm.data.pipeline import load_splits
    from dlm.errors import DlmError
    from studies.plans import fingerprint

    saved = manifest(store)
    unknown = sorted(set(names or []) - set(saved))
    if unknown:
        raise DlmError(f"{store / 'starts.json'}: no saved start {unknown}; saved: {sorted(saved)}")
    done = []
    for name in names or sorted(saved):
        entry = saved[name]
        run = root / entry["path"]
        if (run / "model").is_dir() and fingerprint(run / "model") == entry["fingerprint"]:
            pass  # already there
        else:
            if not any((store / name / "model").glob("*.safetensors")):
                if absent is None:
                    raise DlmError(f"{store / name / 'model'}: no weights here; they are not in git: copy them from "
                                   f"the machine that saved them (fingerprint {entry['fingerprint']})")
                absent.append(name)
                continue
            if (run / "model").exists():
                raise DlmError(f"{run}: holds another model than the saved start {name} "
                               f"({fingerprint(run / 'model')} vs {entry['fingerprint']}); move it away first")
            run.mkdir(parents=True, exist_ok=True)
            shutil.copytree(store / name / "model", run / "model")
            for f in RUN_FILES:
                shutil.copy2(store / name / f, run / f)
            if fingerprint(run / "model") != entry["fingerprint"]:
                raise DlmError(f"{store / name}: its weights do not match the manifest's fingerprint")
            done.append(name)
        if "data" in entry:
            directory = root / entry["data"]["dir"]
            _, data = _data_dir(run)
            load_splits(DataConfig(**{**data, "dir": str(directory)}), directory)  # as training generates it
            for f, digest in entry["data"].items():
                if f != "dir" and _sha(directory / f) != digest:
                    raise DlmError(f"{directory / f}: regenerated data differ from what {name} trained on "
                                   f"({_sha(directory / f)} vs {digest})")
    return done


def pinned_by(results: Path = ROOT / "docs" / "results") -> dict[str, list[str]]:
    """fingerprint -> the study tables (by name) that pin it."""
    out: dict[str, list[str]] = {}
    for path in sorted(results.glob("*.json")):
        try:
            pins = json.loads(path.read_text()).get("pins")
        except (json.JSONDecodeError, AttributeError):
            continue
        for value in (pins or {}).values() if isinstance(pins, dict) else ():
            out.setdefault(value, []).append(path.stem)
    return out
