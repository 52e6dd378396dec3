"""tinymath generation is frozen: the same seeds give exactly the problems recorded in tests/data/tinymath_frozen.jsonl.

The fixture was written with the generator as it stood before the builder rewrite of issue 47 (commit 05a1fde):
``python tests/test_tinymath_frozen.py --write`` regenerates it (only do that on purpose, when the data must change).
"""

import json
import random
import sys
from pathlib import Path

import pytest

from dlm.data.tinymath import (
    LEVELS,
    PHRASINGS,
    Difficulty,
    add_rejected,
    corrupt_program,
    generate_problem,
    generate_splits,
    generate_unseen_test,
)

FIXTURE = Path(__file__).parent / "data" / "tinymath_frozen.jsonl"
SEEDS = (0, 1, 2)
# levels beyond LEVELS that reach the builder's rarer paths: only * or /, many entities, tight number ranges
EXTRA_LEVELS = {
    "mul-only": Difficulty("mul-only", 1, 3, 12, ("*",), True, 1, False, 3),
    "div-only": Difficulty("div-only", 1, 2, 30, ("/",), True, 0, True, 2),
    "tight": Difficulty("tight", 2, 3, 12, ("+", "-", "*", "/"), True, 1, True, 3),
}


def frozen_records() -> list[dict]:
    """Every record the fixture holds, each tagged with the call that made it, in a fixed order."""
    out = []
    for seed in SEEDS:
        for name, level in {**LEVELS, **EXTRA_LEVELS}.items():
            for phrasing in PHRASINGS:
                rng = random.Random(f"frozen:{seed}:{name}:{phrasing}")
                for i in range(10):
                    out.append({"call": f"generate_problem:{seed}:{name}:{phrasing}:{i}",
                                **generate_problem(rng, level, phrasing)})
                out.append({"call": f"rng_after:{seed}:{name}:{phrasing}", "value": rng.random()})
        splits = generate_splits(4, 2, 2, "medium", seed)
        for split, records in splits.items():
            out += [{"call": f"generate_splits:{seed}:{split}", **r} for r in records]
        out += [{"call": f"generate_unseen_test:{seed}", **r} for r in generate_unseen_test(3, "hard", seed)]
        out += [{"call": f"add_rejected:{seed}", **r} for r in add_rejected(splits["train"], seed)]
        rng = random.Random(seed)
        out += [{"call": f"corrupt_program:{seed}", "rejected": corrupt_program(rng, r)} for r in splits["test"]]
    return out


def test_generation_matches_the_frozen_records():
    expected = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    got = frozen_records()
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g == e, f"{FIXTURE.name}: first difference at {e['call']}"


@pytest.mark.parametrize("name", sorted(EXTRA_LEVELS))
def test_extra_levels_yield_problems_within_their_bounds(name):
    level = EXTRA_LEVELS[name]
    rng = random.Random(name)
    for _ in range(5):
        record = generate_problem(rng, level)
        assert 1 <= record["answer"] <= 10 * level.max_number


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    FIXTURE.write_text("".join(json.dumps(r) + "\n" for r in frozen_records()))
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size} bytes)")
