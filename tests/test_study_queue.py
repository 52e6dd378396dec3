"""The study queue (benchmarks/study_queue.py, studies.queue): lanes of study commands run in order, each
given the minutes left until a time."""

import datetime
import shlex
from pathlib import Path

import pytest

import study_queue
from studies import queue as q

ROOT = Path(__file__).resolve().parents[1]


def _clock(times):
    it = iter(times)
    return lambda: next(it)


def test_a_lane_gives_each_command_the_minutes_left_skips_what_cannot_fit_and_stops_in_time(tmp_path):
    queue = tmp_path / "study_queue.yaml"
    queue.write_text("lanes:\n  A:\n    - block_study.py --plan p.yaml --seeds 0\n"
                     "    - {run: mask_discrepancy_study.py run --plan d.yaml, min_minutes: 60}\n"
                     "    - local_overfitting_study.py run --plan o.yaml\n"
                     "    - tess2_tinymath.py study --plan t.yaml\n")
    commands = q.load_lane(queue, "A")
    assert [c[1] for c in commands] == [None, 60, None, None]
    day = datetime.datetime(2026, 12, 5)
    ran = []

    def runner(argv, cwd, env):
        assert env["OMP_NUM_THREADS"] == "1" and Path(cwd) == ROOT
        ran.append([Path(argv[1]).name, *argv[2:]])
        return 0

    # 06:00 -> 07:00: the first gets 60 min; at 06:30 the D_mask entry (needs 60) is skipped and the next gets 30;
    # at 06:50 fewer than 15 are left: the lane stops before the last command
    clock = _clock([day.replace(hour=6), day.replace(hour=6), day.replace(hour=6, minute=30),
                    day.replace(hour=6, minute=30), day.replace(hour=6, minute=30), day.replace(hour=6, minute=50)])
    assert q.run_lane(commands, "07:00", 15, runner=runner, clock=clock) == 0
    assert ran == [["block_study.py", "--plan", "p.yaml", "--seeds", "0", "--max-minutes", "60"],
                   ["local_overfitting_study.py", "run", "--plan", "o.yaml", "--max-minutes", "30"]]

    ran.clear()  # a failing command stops the lane with its status
    assert q.run_lane(commands[:1] + commands[2:], "23:00", 15, runner=lambda *a, **k: 3,
                      clock=lambda: day.replace(hour=6)) == 3


def test_a_command_that_ends_past_the_deadline_stops_the_lane_instead_of_wrapping_to_tomorrow():
    """--until is resolved once, when the lane starts: a command that overruns it (a cell that began in time) leaves
    no minutes, not the 24 hours until that time tomorrow."""
    day = datetime.datetime(2026, 12, 5)
    commands = [(["block_study.py", "--seeds", "0"], None), (["block_study.py", "--seeds", "1"], None)]
    ran = []
    clock = _clock([day.replace(hour=18), day.replace(hour=18), day.replace(hour=18, minute=48, second=30)])
    assert q.run_lane(commands, "18:48", 15, runner=lambda argv, **k: ran.append(argv) or 0, clock=clock) == 0
    assert len(ran) == 1 and ran[0][-2:] == ["--max-minutes", "48"]


def test_bad_queue_entries_are_one_line_naming_the_entry(tmp_path, capsys):
    queue = tmp_path / "study_queue.yaml"
    for body, message in (("lanes:\n  A:\n    - rm -rf runs\n", "lanes.A[0] 'rm -rf runs' must start with a script"),
                          ("lanes:\n  A:\n    - block_study.py --max-minutes 5\n", "sets --max-minutes"),
                          ("lanes:\n  A:\n    - {run: block_study.py, min_minutes: -1}\n", "min_minutes must be"),
                          ("lanes:\n  B: []\n", "no lane 'A'")):
        queue.write_text(body)
        assert study_queue.main(["A", "--queue", str(queue), "--until", "06:00"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("study_queue.py: ") and message in err and err.count("\n") == 1
    assert study_queue.main(["A", "--queue", str(ROOT / "benchmarks" / "study_queue.yaml")]) == 2  # --until is required
    assert "pass --until" in capsys.readouterr().err


def test_minutes_until_wraps_to_tomorrow_and_refuses_a_non_time():
    now = datetime.datetime(2026, 12, 5, 23, 30)
    assert q.minutes_until("23:45", now) == 15 and q.minutes_until("00:15", now) == 45
    with pytest.raises(q.QueueError, match="HH:MM"):
        q.minutes_until("soon", now)


def test_the_shipped_queue_names_existing_scripts_and_plans_and_no_seed_twice():
    lanes = {name: q.load_lane(ROOT / "benchmarks" / "study_queue.yaml", name) for name in ("A", "B")}
    seen = {}
    for name, commands in lanes.items():
        for argv, _ in commands:
            plan = argv[argv.index("--plan") + 1]
            assert (ROOT / plan).is_file(), plan
            seeds = argv[argv.index("--seeds") + 1] if "--seeds" in argv else "all"
            if argv[0] == "block_study.py":  # two lanes must never train one seed of a plan into one run dir
                assert (plan, seeds) not in seen or seen[(plan, seeds)] == name, shlex.join(argv)
                seen[(plan, seeds)] = name


def test_a_commands_budget_is_rounded_down_never_past_the_deadline():
    """47 min 40 s left gives --max-minutes 47.6 (rounding to whole minutes gave 48: a training stopped 20 s late)."""
    day = datetime.datetime(2026, 12, 5)
    ran = []
    clock = _clock([day.replace(hour=18, second=20)] * 2)
    q.run_lane([(["block_study.py"], None)], "18:48", 15, runner=lambda argv, **k: ran.append(argv) or 0, clock=clock)
    assert ran[0][-2:] == ["--max-minutes", "47.6"]
