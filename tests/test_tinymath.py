import json
import random
import re
from collections import Counter

import pytest

from dlm.data.tinymath import (
    LEVELS,
    NAMES,
    OBJECTS,
    Difficulty,
    corrupt_program,
    count_steps,
    generate_problem,
    generate_splits,
    run_solution,
    write_tinymath,
)


def _nums(text):
    return [int(x) for x in re.findall(r"\b\d+\b", text)]


def _dedupe(xs):
    out = []
    for x in xs:
        if x not in out:
            out.append(x)
    return out


_PROBLEMS = {name: [generate_problem(random.Random(1000 + i), lv) for i in range(300)] for name, lv in LEVELS.items()}


@pytest.mark.parametrize("level", list(LEVELS))
def test_programs_return_the_answer_within_step_bounds(level):
    lv = LEVELS[level]
    for r in _PROBLEMS[level]:
        assert set(r) == {"prompt", "response", "answer"}
        assert type(r["answer"]) is int and 0 <= r["answer"] <= min(10 * lv.max_number, 10_000)
        value = run_solution(r["response"])
        assert type(value) is int and value == r["answer"], r
        assert lv.min_steps <= count_steps(r["response"]) <= lv.max_steps
        assert r["response"].startswith("def solution():\n") and r["response"].split("\n")[-1].startswith("    return ")
        assert len(r["prompt"].split()) <= 80
        assert "#" not in r["response"]


@pytest.mark.parametrize("level", list(LEVELS))
def test_all_intermediate_values_are_bounded_non_negative_ints(level):
    lv = LEVELS[level]
    for r in _PROBLEMS[level][:100]:
        scope = {"__builtins__": {}}
        body = r["response"].replace("def solution():\n", "").replace("    return", "_ret =")
        exec("\n".join(line.strip() for line in body.split("\n")), scope)
        values = [v for k, v in scope.items() if k != "__builtins__"]
        assert all(type(v) is int and 0 <= v <= min(10 * lv.max_number, 10_000) for v in values), r


def test_easy_level_shape():
    for r in _PROBLEMS["easy"]:
        ops = re.findall(r" (\+|-|\*|//) ", r["response"])
        assert set(ops) <= {"+", "-"}
        prompt_nums = _nums(r["prompt"])
        assert all(x <= 20 for x in prompt_nums)
        # every number is used, and in the order the program uses them (no distractors, no shuffling)
        assert _dedupe(prompt_nums) == _dedupe(_nums(r["response"]))
        first_var = r["response"].split("\n")[1].split(" = ")[0].strip()
        assert first_var in {plural for _, plural in OBJECTS}  # one entity: the quantity is named after the object


def test_division_is_integral_and_used():
    divisions = 0
    for level in ("medium", "hard"):
        for r in _PROBLEMS[level]:
            for line in r["response"].split("\n"):
                if " // " in line:
                    divisions += 1
                    scope = {"__builtins__": {}}
                    exec("\n".join(ln.strip() for ln in r["response"].split("\n")[1:]).replace("return", "_r ="), scope)
                    lhs, rhs = line.strip().split(" = ")
                    a, b = rhs.split(" // ")
                    num = scope[a] if a in scope else int(a)
                    den = scope[b] if b in scope else int(b)
                    assert num % den == 0, r
    assert divisions > 50


def test_medium_and_hard_use_all_ops_and_relations():
    for level in ("medium", "hard"):
        ops = Counter(o for r in _PROBLEMS[level] for o in re.findall(r" (\+|-|\*|//) ", r["response"]))
        assert all(ops[o] > 20 for o in ("+", "-", "*", "//")), ops
        rel = sum(bool(re.search(r"(more|fewer) \w+ than|as many \w+ as|the number of \w+ that", r["prompt"]))
                  for r in _PROBLEMS[level])
        assert rel > 0.3 * len(_PROBLEMS[level])


def test_hard_has_distractors_and_out_of_order_facts():
    probs = _PROBLEMS["hard"]
    distracted = sum(any(x not in set(_nums(r["response"])) for x in _nums(r["prompt"])) for r in probs)
    assert distracted > 0.4 * len(probs)
    out_of_order = 0
    for r in probs:
        in_prompt, in_prog = set(_nums(r["prompt"])), set(_nums(r["response"]))
        prompt_order = _dedupe([x for x in _nums(r["prompt"]) if x in in_prog])
        prog_order = _dedupe([x for x in _nums(r["response"]) if x in in_prompt])
        out_of_order += prompt_order != prog_order
    assert out_of_order > 0.3 * len(probs)
    entities = [sum(n in r["prompt"].replace(".", " ").replace(",", " ").replace("'s", " ").split() for n, _ in NAMES)
                for r in probs]
    assert max(entities) >= 4


def test_template_variety():
    names = {n for n, _ in NAMES}
    words = {w for pair in OBJECTS for w in pair}
    for level, minimum in (("easy", 40), ("medium", 150), ("hard", 200)):
        skeletons = set()
        for r in _PROBLEMS[level]:
            toks = re.findall(r"[A-Za-z']+|\d+|[^\sA-Za-z\d]", r["prompt"])
            skel = ("#" if t.isdigit() else "N" if t in names else "O" if t in words else t for t in toks)
            skeletons.add(" ".join(skel))
        assert len(skeletons) >= minimum, (level, len(skeletons))
    assert len(NAMES) >= 40 and len(OBJECTS) >= 30


def test_determinism():
    a = [generate_problem(random.Random(7), "hard") for _ in range(5)]
    b = [generate_problem(random.Random(7), "hard") for _ in range(5)]
    assert a == b
    assert generate_splits(30, 5, 5, "medium", seed=3) == generate_splits(30, 5, 5, "medium", seed=3)
    assert generate_splits(30, 5, 5, "medium", seed=3) != generate_splits(30, 5, 5, "medium", seed=4)
    state = random.getstate()
    generate_splits(10, 2, 2, "hard", seed=0)
    assert random.getstate() == state  # global random state untouched


def test_splits_disjoint_and_test_independent_of_n_train():
    small = generate_splits(50, 20, 20, "easy", seed=1)
    big = generate_splits(400, 20, 20, "easy", seed=1)
    assert small["test"] == big["test"] and small["validation"] == big["validation"]
    for splits in (small, big):
        prompts = {k: [r["prompt"] for r in v] for k, v in splits.items()}
        assert [len(prompts[k]) for k in ("train", "validation", "test")] == [len(splits["train"]), 20, 20]
        for _k, ps in prompts.items():
            assert len(set(ps)) == len(ps)
        assert not set(prompts["train"]) & set(prompts["validation"])
        assert not set(prompts["train"]) & set(prompts["test"])
        assert not set(prompts["validation"]) & set(prompts["test"])


def test_custom_difficulty_and_bad_level():
    lv = Difficulty("mul", 1, 3, 12, ("*", "+"), False, 0, False, 1)
    for i in range(50):
        r = generate_problem(random.Random(i), lv)
        assert run_solution(r["response"]) == r["answer"] and 1 <= count_steps(r["response"]) <= 3
        assert set(re.findall(r" (\+|-|\*|//) ", r["response"])) <= {"*", "+"}
    with pytest.raises(ValueError):
        generate_splits(1, 1, 1, "impossible")
    with pytest.raises(ValueError):
        Difficulty("bad", 1, 2, 20, ("^",))


def test_write_tinymath(tmp_path):
    paths = write_tinymath(tmp_path / "tm", n_train=40, n_val=10, n_test=10, level="hard", seed=5)
    assert set(paths) == {"train", "validation", "test", "test_unseen", "corpus", "meta"}
    assert all(p.is_file() for p in paths.values())
    splits = ("train", "validation", "test")
    rows = {s: [json.loads(line) for line in paths[s].read_text().splitlines()] for s in splits}
    assert [len(rows[s]) for s in ("train", "validation", "test")] == [40, 10, 10]
    for rs in rows.values():
        for r in rs:
            assert set(r) == {"prompt", "response", "answer"} and run_solution(r["response"]) == r["answer"]
    assert rows == generate_splits(40, 10, 10, "hard", seed=5)
    corpus = paths["corpus"].read_text()
    blocks = corpus.strip().split("\n\n")
    assert len(blocks) == 40
    assert blocks[0] == f"user: {rows['train'][0]['prompt']}\nassistant: {rows['train'][0]['response']}"
    meta = json.loads(paths["meta"].read_text())
    assert meta["seed"] == 5 and meta["level"]["name"] == "hard" and meta["level"]["max_steps"] == 6
    assert meta["counts"] == {"train": 40, "validation": 10, "test": 10, "test_unseen": 10}
    again = write_tinymath(tmp_path / "tm2", n_train=40, n_val=10, n_test=10, level="hard", seed=5)
    assert all(again[k].read_bytes() == paths[k].read_bytes() for k in paths)


def test_corrupt_program_is_always_wrong():
    rng = random.Random(0)
    kinds = Counter()
    for level in LEVELS:
        for r in _PROBLEMS[level][:150]:
            bad = corrupt_program(rng, r)
            assert bad != r["response"]
            assert run_solution(bad) != r["answer"]
            try:
                compile(bad, "<t>", "exec")
                kinds["runs" if run_solution(bad) is not None else "crashes"] += 1
            except SyntaxError:
                kinds["syntax"] += 1
    assert kinds["runs"] > 50 and kinds["syntax"] > 20, kinds
    r = _PROBLEMS["hard"][0]
    assert corrupt_program(random.Random(3), r) == corrupt_program(random.Random(3), r)
