"""benchmarks/power.py: variance components of a seeds x problems table and the sizes a comparison needs."""

from __future__ import annotations

import json

import numpy as np
import pytest


def test_components_recover_the_simulated_variances():
    from power import components

    rng = np.random.default_rng(0)
    S, n = 40, 400
    D = 0.1 + rng.normal(0, 0.05, (S, 1)) + rng.normal(0, 0.2, (1, n)) + rng.normal(0, 0.3, (S, n))
    c = components(D)
    assert c["seed"] == pytest.approx(0.05 ** 2, rel=0.35) and c["problem"] == pytest.approx(0.2 ** 2, rel=0.2)
    assert c["noise"] == pytest.approx(0.3 ** 2, rel=0.05) and c["difference"] == pytest.approx(D.mean())


def test_mde_falls_with_seeds_and_problems_and_the_seed_spread_bounds_it():
    from power import mde, smallest_n

    comp = {"seed": 0.03 ** 2, "problem": 0.1 ** 2, "noise": 0.25 ** 2}
    assert mde(comp, 5, 200) < mde(comp, 3, 200) and mde(comp, 5, 500) < mde(comp, 5, 200)
    # with infinitely many problems only Var(seed)/S is left: an effect below that bound needs more seeds, not n
    floor3 = mde({**comp, "problem": 0.0, "noise": 0.0}, 3, 1)
    assert smallest_n(comp, 3, 0.9 * floor3, 10 ** 6) is None
    n = smallest_n(comp, 8, 0.06, 10 ** 5)
    assert n is not None and mde(comp, 8, n) <= 0.06 < mde(comp, 8, n - 1)


def test_cli_reads_a_study_table(tmp_path, capsys):
    from power import main

    rng = np.random.default_rng(1)
    cells = [{"arm": arm, "seed": s, "eval": "test", "correct": [int(x) for x in rng.random(60) < p]}
             for s in range(3) for arm, p in (("a", 0.5), ("b", 0.3))]
    (tmp_path / "t.json").write_text(json.dumps({"cells": cells}))
    main([str(tmp_path / "t.json"), "--a", "a", "--b", "b", "--eval", "test", "--seeds", "3,5", "--n", "60,120"])
    out = capsys.readouterr().out
    assert "3 seeds x 60 problems" in out and out.count("\n") == 5
    with pytest.raises(SystemExit, match="no seed has both"):
        main([str(tmp_path / "t.json"), "--a", "a", "--b", "c", "--eval", "test"])
