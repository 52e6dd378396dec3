"""Rewards for RL post-training (`rl.reward`): per completion, a weighted sum of terms, each scored where it is safe.

- `tinymath`: 1 when the completion, run in the sandbox (`dlm.evaluation.sandbox`: a separate process with time
  and memory limits, no network, writes only to its temp dir), returns the record's `answer`; else 0.
- `answer`: 1 when the completion's final answer (the last `\\boxed{...}`, else what follows the last `####`, else
  its last number) equals the record's `answer` (numbers to 1e-3); read, never run. For reasoning in text (GSM8K).
- `format`: 1 when the completion parses as Python and defines `solution` at top level. It is parsed (`ast.parse`
  of at most `MAX_PARSE` characters), never executed.
- `unit_tests`: 1 when a HumanEval-style record's `test` passes on prompt + completion, in the sandbox
  (`dlm.evaluation.humaneval.program`).
- `reward_model`: a dlm Bradley-Terry model's score R(prompt, completion) (TESS 2 App. C), loaded once.

A term that raises, or a sandbox run that times out, runs out of memory or crashes, scores 0 for the completion and
is counted in `failures` (the run's `reward/failures` metric): a completion never stops the run. A program that runs
and returns a wrong value or raises its own exception is a wrong answer (0), not a failure."""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from dlm.evaluation.sandbox import SandboxResult, Status, answers_match, run_programs

MAX_PARSE = 20_000  # characters the format term parses (a completion is bounded by the rollout length anyway)
FAILED = (Status.TIMEOUT, Status.MEMORY, Status.BAD_OUTPUT)  # the sandbox, not the program, gave no verdict


@dataclass
class Scores:
    """Per completion: the total reward and each term's raw score; failures per term."""

    total: list[float]
    terms: dict[str, list[float]]
    failures: dict[str, int] = field(default_factory=dict)


def _tinymath(records: Sequence[dict], completions: Sequence[str], timeout: float) -> tuple[list[float], int]:
    results = run_programs(list(completions), timeout=timeout)
    return ([float(r.ok and answers_match(r.value, rec["answer"])) for r, rec in zip(results, records)],
            _failed(results))


def _unit_tests(records: Sequence[dict], completions: Sequence[str], timeout: float) -> tuple[list[float], int]:
    from dlm.evaluation.humaneval import CHECK_ENTRY, program

    results = run_programs([program(rec, c) for rec, c in zip(records, completions)], entry=CHECK_ENTRY,
                           timeout=timeout)
    return [float(r.ok and r.value is True) for r in results], _failed(results)


def _failed(results: Sequence[SandboxResult]) -> int:
    return sum(r.status in FAILED or (r.status is Status.ERROR and (r.error or "").startswith("sandbox"))
               for r in results)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_answer(text: str) -> str | None:
    """The completion's final answer: the last `\\boxed{...}`, else the text after the last `####`, else its last
    number (commas dropped); None when there is none."""
    text = text[-MAX_PARSE:]
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    tail = boxed[-1] if boxed else text.rsplit("####", 1)[1] if "####" in text else text
    numbers = _NUMBER.findall(tail)
    return numbers[-1].replace(",", "") if numbers else (tail.strip() or None) if boxed else None


def answer_matches(text: str, expected) -> bool:
    got = final_answer(text)
    if got is None:
        return False
    try:
        return answers_match(float(got), float(expected))
    except (TypeError, ValueError):
        return got.strip() == str(expected).strip()


def has_solution(text: str) -> bool:
    """Whether `text` parses as Python with a top-level `def solution` (parsed, never run)."""
    if len(text) > MAX_PARSE:
        return False
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return any(isinstance(node, ast.FunctionDef) and node.name == "solution" for node in tree.body)


class Rewards:
    """The weighted sum of `terms` (`dlm.config.RewardTerm`s); `__call__(records, completions) -> Scores`.
    `batch_size`: rows per reward-model forward. GRPO passes its group size, so a prompt's completions are scored as
    one batch of their own whose bits do not depend on the other prompts of the update (padding, batch shape), the
    same in every process layout; that matters because a group whose rewards nearly tie turns float noise in them
    into O(1) differences of its normalised advantages."""

    def __init__(self, terms, timeout: float = 1.0, device=None, batch_size: int = 50):
        self.terms, self.timeout, self.device, self.batch_size = list(terms), timeout, device, batch_size
        self._reward_models: dict[str, tuple] = {}

    def __call__(self, records: Sequence[dict], completions: Sequence[str]) -> Scores:
        total = [0.0] * len(completions)
        terms: dict[str, list[float]] = {}
        failures: dict[str, int] = {}
        for term in self.terms:
            key = term.name if term.name not in terms else f"{term.name}{len(terms)}"
            try:
                scores, failed = self._score(term, records, completions)
            except Exception:  # noqa: BLE001 - a reward that raises scores 0 and is counted, never fatal
                scores, failed = [0.0] * len(completions), len(completions)
            terms[key], failures[key] = scores, failed
            total = [t + term.weight * s for t, s in zip(total, scores)]
        return Scores(total, terms, failures)

    def _score(self, term, records, completions) -> tuple[list[float], int]:
        if term.name == "tinymath":
            return _tinymath(records, completions, self.timeout)
        if term.name == "unit_tests":
            return _unit_tests(records, completions, self.timeout)
        if term.name == "format":
            return [float(has_solution(c)) for c in completions], 0
        if term.name == "answer":
            return [float(answer_matches(c, r["answer"])) for r, c in zip(records, completions)], 0
        return self._reward_model(term.path, records, completions), 0

    def _reward_model(self, path: str, records, completions) -> list[float]:
        from dlm.evaluation.reward import score_texts
        from dlm.sampling import load_for_inference

        if path not in self._reward_models:
            self._reward_models[path] = load_for_inference(path, device=self.device or "cpu")
        model, tok = self._reward_models[path]
        return score_texts(model, tok, [r["prompt"] for r in records], list(completions), self.batch_size)
