"""Run the pre-registered studies' remaining work in a fixed order until a wall-clock time: one lane per core.

The studies span sessions; each session has a few hours of two cores and must stop its jobs cleanly before it ends.
A lane of benchmarks/study_queue.yaml lists study commands (scripts under benchmarks/, with their arguments); this
runs them in order with OMP_NUM_THREADS=1, giving each `--max-minutes` = the minutes left until --until. Every study
driver resumes where its table stopped and returns at once when its part is complete, so the same lane is run again
next session; a driver stopped by its budget stops a training with a checkpoint (pumba_study, block_study, the TESS 2
drivers) or starts no run that would not fit (local_overfitting_study).

    python benchmarks/study_queue.py A --until 06:40     # core A; in the background: nohup ... > logs/queue-A.log &
    python benchmarks/study_queue.py B --until 06:40
    python benchmarks/study_queue.py A --dry-run         # what lane A would run

A command is started only while at least --min-minutes are left (a training shorter than that rarely reaches a
checkpoint); an entry {run: ..., min_minutes: M} is skipped (the lane goes on) when fewer than M are left, for a
driver whose unit of work cannot stop inside (a D_mask cell). A failing command stops the lane with its exit status:
a plan that refuses to continue needs a person.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from studies.queue import DEFAULT_QUEUE, QueueError, load_lane, run_lane


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("lane", help="a lane of the queue file (one per core)")
    ap.add_argument("--until", default=None, help="HH:MM (local time) by which every command must have stopped")
    ap.add_argument("--queue", default=str(DEFAULT_QUEUE), help="the queue file (default: %(default)s)")
    ap.add_argument("--min-minutes", type=float, default=15, help="start no command with less time left")
    ap.add_argument("--dry-run", action="store_true", help="print the commands with their budgets, run nothing")
    args = ap.parse_args(argv)
    try:
        commands = load_lane(Path(args.queue), args.lane)
        if args.until is None and not args.dry_run:
            raise QueueError("pass --until HH:MM (when the session's jobs must have stopped)")
        return run_lane(commands, args.until or "23:59", args.min_minutes, args.dry_run)
    except QueueError as e:
        print(f"study_queue.py: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
