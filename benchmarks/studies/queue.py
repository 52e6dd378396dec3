"""The study queue (benchmarks/study_queue.py is its command line and says how it is used): a lane of
benchmarks/study_queue.yaml lists study commands, run in order with OMP_NUM_THREADS=1, each given the minutes left
until a wall-clock time as its --max-minutes, so every session runs the same lanes again and stops cleanly."""

from __future__ import annotations

import datetime
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from studies.plans import read_yaml

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_QUEUE = ROOT / "benchmarks" / "study_queue.yaml"


class QueueError(Exception):
    """A queue file, lane or --until that cannot be run: one line naming it."""


def load_lane(path: Path, lane: str) -> list[tuple[list[str], float | None]]:
    """The lane's commands as (argument list, minutes it needs to start or None): each entry is a command line (a
    script under benchmarks/ that takes --max-minutes) or {run: LINE, min_minutes: M} for a driver whose unit of
    work cannot stop inside (a D_mask cell)."""
    raw = read_yaml(path, "queue", QueueError)
    lanes = raw.get("lanes") if isinstance(raw, dict) else None
    if not isinstance(lanes, dict) or lane not in lanes:
        raise QueueError(f"{path}: no lane {lane!r} under 'lanes' (lanes: {', '.join(lanes or {}) or 'none'})")
    commands = []
    for i, entry in enumerate(lanes[lane] or []):
        line, need = (entry.get("run"), entry.get("min_minutes")) if isinstance(entry, dict) else (entry, None)
        if need is not None and not (isinstance(need, (int, float)) and need > 0):
            raise QueueError(f"{path}: lanes.{lane}[{i}].min_minutes must be a positive number, got {need!r}")
        argv = shlex.split(line) if isinstance(line, str) else []
        script = ROOT / "benchmarks" / argv[0] if argv else None
        if script is None or script.suffix != ".py" or not script.is_file():
            raise QueueError(f"{path}: lanes.{lane}[{i}] {line!r} must start with a script under benchmarks/")
        if "--max-minutes" in argv:
            raise QueueError(f"{path}: lanes.{lane}[{i}] sets --max-minutes; the queue gives each command its own")
        commands.append((argv, need))
    return commands


def minutes_until(until: str, now: datetime.datetime) -> float:
    """Minutes from `now` to the next HH:MM (today, or tomorrow if already past)."""
    try:
        hh, mm = (int(x) for x in until.split(":"))
        target = now.replace(hour=hh, minute=mm, second=0, microsecond=0)
    except ValueError:
        raise QueueError(f"--until {until!r}: give a time as HH:MM") from None
    if target <= now:
        target += datetime.timedelta(days=1)
    return (target - now).total_seconds() / 60


def run_lane(commands: list[tuple[list[str], float | None]], until: str, min_minutes: float = 15,
             dry_run: bool = False, runner=subprocess.call, clock=datetime.datetime.now) -> int:
    """Run `commands` in order until fewer than `min_minutes` are left, skipping one whose own min_minutes do not
    fit; returns the first nonzero exit status, or 0."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    deadline = None  # resolved once: a command that ends past `until` must not see it as tomorrow's
    for argv, need in commands:
        now = clock()
        if deadline is None:
            deadline = now + datetime.timedelta(minutes=minutes_until(until, now))
        left = (deadline - now).total_seconds() / 60
        if left < min_minutes:
            print(f"queue: {left:.0f} min left (< --min-minutes {min_minutes:g}); stopping before "
                  f"{shlex.join(argv)}", flush=True)
            return 0
        if need is not None and left < need:  # its unit of work would not fit: the next command may
            print(f"queue: {left:.0f} min left (< the {need:g} it needs); skipping {shlex.join(argv)}", flush=True)
            continue
        budget = f"{math.floor(left * 10) / 10:g}"  # rounded down: a budget never reaches past the deadline
        full = [sys.executable, str(ROOT / "benchmarks" / argv[0]), *argv[1:], "--max-minutes", budget]
        print(f"queue [{clock():%H:%M}] {shlex.join(['python', 'benchmarks/' + argv[0], *full[2:]])}", flush=True)
        if dry_run:
            continue
        start = time.time()
        rc = runner(full, cwd=ROOT, env=env)
        print(f"queue: exit {rc} after {(time.time() - start) / 60:.1f} min", flush=True)
        if rc != 0:
            return rc
    return 0
