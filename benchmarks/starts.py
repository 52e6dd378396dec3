"""The studies' pinned starts, kept in the repository (issue 17): the AR parent and warm starts that the
pre-registered plans continue, so that a plan spans sessions. git tracks their manifest, not their weights (model
weights stay out of the repository): the weights live under benchmarks/starts/ on the machine that saved them, and a
machine without them cannot extend a table pinned to them.

A plan's table pins the weights of every start its arms continue (`studies.plans.fingerprint`). runs/ does
not survive a session, and rebuilding a start with the plan's commands on another machine does not give the same
bits: on 2026-12-02 the rebuilt AR parent's training loss left the pinned run's at update 40 (2.6164382 against
2.6164372; equal at update 20), so a table pinned to lost weights cannot be extended as it was: its unfinished seeds
can only run again from rebuilt starts (pumba_study.py --restart-seeds, which retires their earlier cells). That
happened on 2026-12-05, when a new session's machine no longer had the weights saved here. A start saved here is
restored instead of rebuilt, on the machine that saved it. Restoring is an optimisation, never a requirement
(issue 48): on a machine without the weights, `restore` says which are absent and exits 0, and the drivers build a
missing start with its plan's commands:

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
import sys

from studies.starts import manifest, pinned_by, restore, save


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
            absent: list[str] = []
            done = restore(names=args.names or None, absent=absent)
            print("restored: " + (", ".join(done) if done else "nothing"))
            if absent:  # a fresh clone: restoring is an optimisation, the plans' commands build what they need
                print(f"not on this machine (weights are kept out of git): {', '.join(absent)}; the study drivers "
                      "build a missing start with its plan's commands (settings.starts), which on another machine "
                      "gives other bits than a table pinned (its unfinished seeds then need --restart-seeds)")
        else:
            pins = pinned_by()
            for name, e in sorted(manifest().items()):
                print(f"{name:24s} {e['path']:28s} {e['fingerprint']}  pinned by: "
                      f"{', '.join(pins.get(e['fingerprint'], [])) or '-'}")
    except DlmError as e:
        sys.exit(f"starts.py {args.command}: {e}")


if __name__ == "__main__":
    main()
