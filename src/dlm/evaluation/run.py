"""`dlm eval`: score a trained model on a task and write the results as JSON."""

from __future__ import annotations

import json
from pathlib import Path

from dlm.data.sources import DataError, read_jsonl
from dlm.errors import DlmError
from dlm.evaluation.tasks import evaluate, trivial_baseline
from dlm.modeling.backbone import resolve_model_dir
from dlm.sampling import dtype_name, load_for_inference, resolve_options

TASKS = ("tinymath",)


def default_task_file(model_path: str | Path, task: str) -> Path:
    """The test split the model's run generated (run_dir/data/test.jsonl), if any."""
    for base in (Path(model_path), Path(model_path).parent):
        candidate = base / "data" / "test.jsonl"
        if candidate.is_file():
            return candidate
    resolve_model_dir(model_path)  # a missing model is said first
    raise DataError(f"no --data given and no {task} test split found beside {model_path}; "
                    f"pass --data PATH.jsonl (make one with `dlm data tinymath --out DIR`)")


def evaluate_model(model_path: str | Path, task: str = "tinymath", data: str | Path | None = None, n: int | None = None,
                   options=None, *, batch_size: int = 50, max_new_tokens: int = 128, temperature: float = 0.0,
                   seed: int = 0, out: str | Path | None = None, progress: bool = True, dtype=None,
                   truncate_prompts: bool = False) -> dict:
    """Accuracy, NFE and timing of a model on a program-answer task; optionally written to `out` (JSON). The model
    samples with `options` (its family's SamplingOptions, SamplingSettings or None; another family's options give the
    defaults); `dtype` (e.g. "bfloat16") is the precision the model is loaded and run at."""
    if task not in TASKS:
        raise DlmError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    path = Path(data) if data else default_task_file(model_path, task)
    records = read_jsonl(path, required=("prompt", "response"))
    if any("answer" not in r for r in records):
        raise DataError(f"{path}: every record needs an 'answer' field to be graded")
    records = records[:n] if n else records
    model, tok = load_for_inference(model_path, dtype=dtype)
    options = resolve_options(model.spec.family, options, strict=False)
    result = evaluate(model, tok, records, options, batch_size=batch_size, max_new_tokens=max_new_tokens,
                      temperature=temperature, seed=seed, progress=progress, truncate_prompts=truncate_prompts)
    result.update({"model": str(model_path), "task": task, "data": str(path), "dtype": dtype_name(dtype),
                   "trivial_baseline": trivial_baseline(records)})
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return result
