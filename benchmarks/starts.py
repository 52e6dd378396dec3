"""The studies' pinned starts, kept in the repository (issue 17): the AR parent and warm starts that the
pre-registered plans continue, so that a plan spans sessions. git tracks their manifest, not their weights (model
weights stay out of the repository): the weights live under benchmarks/starts/ on the machine that saved them, and a
machine without them cannot extend a table pinned to them.

A plan's table pins the weights of every start its arms continue (`dlm.evaluation.study.fingerprint`). runs/ does
not survive a session, and rebuilding a start with the plan's commands on another machine does not give the same
bits: on 2026-12-02 the rebuilt AR parent's training loss left the pinned run's at update 40 (2.6164382 against
2.6164372; equal at update 20), so a table pinned to lost weights cannot be extended as it was: its unfinished seeds
can only run again from rebuilt starts (pumba_study.py --restart-seeds, which retires their earlier cells). That
happened on 2026-12-05, when a new session's machine no longer had the weights saved here. A start saved here is
restored instead of rebuilt, on the machine that saved it:

    python benchmarks/starts.py restore                       # every saved start into its runs/ path
    python benchmarks/starts.py save runs/calib-ar-medium     # a start just built: copied in and fingerprinted
    python benchmarks/starts.py list                          # saved starts, and the study tables pinning each

A saved start is benchmarks/starts/<name>/: the run's model/ (fp32 safetensors, tokenizer, spec), recipe.yaml
and metrics.jsonl (the TESS 2 driver reads the last update from it). Its generated tinymath data is not copied:
`restore` regenerates it from the recipe's data settings with the same deterministic generator, as training does,
and checks it against the digests recorded at `save`. The manifest benchmarks/starts/starts.json lists, per start,
its runs/ path, fingerprint and data digests.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STORE = ROOT / "benchmarks" / "starts"
RUN_FILES = ("recipe.yaml", "metrics.jsonl")
DATA_FILES = ("train.jsonl", "validation.jsonl", "test.jsonl", "test_unseen.jsonl")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _manifest(store: Path) -> dict:
    path = store / "starts.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _write_manifest(store: Path, manifest: dict) -> None:
    tmp = store / "starts.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
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
    manifest = _manifest(store)
    manifest[name] = entry
    _write_manifest(store, manifest)
    return entry


def restore(store: Path = STORE, root: Path = ROOT, names=None) -> list[str]:
    """Put every saved start (or `names`) back at its runs/ path, unless that path already holds the same weights;
    regenerate its tinymath data and check it. Returns what was restored."""
    from dlm.config import DataConfig
    from dlm.data.pipeline import load_splits
    from dlm.errors import DlmError
    from studies.plans import fingerprint

    manifest = _manifest(store)
    unknown = sorted(set(names or []) - set(manifest))
    if unknown:
        raise DlmError(f"{store / 'starts.json'}: no saved start {unknown}; saved: {sorted(manifest)}")
    done = []
    for name in names or sorted(manifest):
        entry = manifest[name]
        run = root / entry["path"]
        if (run / "model").is_dir() and fingerprint(run / "model") == entry["fingerprint"]:
            pass  # already there
        else:
            if not any((store / name / "model").glob("*.safetensors")):
                raise DlmError(f"{store / name / 'model'}: no weights here; they are not in git: copy them from "
                               f"the machine that saved them (fingerprint {entry['fingerprint']})")
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("save", help="copy finished runs into benchmarks/starts/")
    p.add_argument("runs", nargs="+")
    p = sub.add_parser("restore", help="put saved starts back under runs/ (all, or the names given)")
    p.add_argument("names", nargs="*")
    sub.add_parser("list", help="saved starts and the tables that pin them")
    args = ap.parse_args(argv)
    from dlm.errors import DlmError

    try:
        if args.command == "save":
            for run in args.runs:
                e = save(run)
                print(f"saved {run}: fingerprint {e['fingerprint']}")
        elif args.command == "restore":
            done = restore(names=args.names or None)
            print("restored: " + (", ".join(done) if done else "nothing (every start already in place)"))
        else:
            pins = pinned_by()
            for name, e in sorted(_manifest(STORE).items()):
                print(f"{name:24s} {e['path']:28s} {e['fingerprint']}  pinned by: "
                      f"{', '.join(pins.get(e['fingerprint'], [])) or '-'}")
    except DlmError as e:
        sys.exit(f"starts.py {args.command}: {e}")


if __name__ == "__main__":
    main()
