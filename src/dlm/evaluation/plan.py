"""`dlm eval` as one library call: which evaluation a request means (dlm's own task, an lm-eval task, the mask
discrepancy, intrinsic metrics), the arguments each one refuses, the smoke-scale caps, and the lines it reports."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dlm.errors import DlmError
from dlm.sampling.options import SamplingSettings


class EvalRequestError(DlmError, ValueError):
    """Evaluation arguments that contradict each other; the message names them and what to drop."""


@dataclass
class EvalRequest:
    """What `dlm eval` was asked for, one field per flag (its default is the flag's): a plain record for Python."""

    models: Sequence[str]
    task: str = "tinymath"
    metric: str = "accuracy"
    data: str | None = None
    n: int | None = None
    truncate_prompts: bool = False
    sweep: str | None = None
    batch_size: int = 50
    max_new_tokens: int | None = None
    temperature: float | None = None
    seed: int = 0
    samples: str | None = None
    samples_per_problem: int = 1
    pass_k: str | None = None
    reference_model: str | None = None
    no_mauve: bool = False
    num_fewshot: int | None = None
    apply_chat_template: bool = False
    mc_num: int = 128
    lm_eval_include: Sequence[str] | None = None
    dtype: str = "auto"
    device: str = "auto"
    out: str | None = None


def run_eval(request: EvalRequest, settings: SamplingSettings | None = None, *,
             names: Mapping[str, str] | None = None) -> None:
    """Run the evaluation `request` means with sampling `settings`, printing its results; `names`: how the caller
    spells each sampling option in messages (the CLI: its flags)."""
    settings = settings or SamplingSettings()
    request = smoke_capped(request)
    if request.task.startswith("lm-eval:"):
        return _lm_eval(request, settings)
    if request.metric != "accuracy" and request.samples:
        raise EvalRequestError(f"--samples writes graded problems (--metric accuracy), not --metric {request.metric}")
    if request.metric == "mask-discrepancy":
        return _mask_discrepancy(request, settings, names or {})
    if request.metric == "intrinsic":
        return _intrinsic(request, settings)
    return _accuracy(request, settings)


def smoke_capped(request: EvalRequest) -> EvalRequest:
    """`request` at toy scale under DLM_SMOKE (the documented commands checked as written), said on stderr."""
    from dlm.config import SMOKE_ENV, SMOKE_N, SMOKE_TOKENS, smoke

    if not smoke():
        return request
    n = min(request.n or SMOKE_N, SMOKE_N)
    length = min(request.max_new_tokens or SMOKE_TOKENS, SMOKE_TOKENS)  # HumanEval's 512: minutes a problem
    print(f"{SMOKE_ENV}=1: --n {n} --max-new-tokens {length}; not a result", file=sys.stderr)
    return dataclasses.replace(request, n=n, max_new_tokens=length)


def _lm_eval(r: EvalRequest, settings: SamplingSettings) -> None:
    """An lm-eval task for each model; several models write their files as OUT.0, OUT.1, ..."""
    from dlm.evaluation.lm_eval import run_lm_eval

    if r.sweep or r.metric != "accuracy" or r.samples_per_problem != 1 or r.pass_k:
        raise EvalRequestError("--sweep, --metric, --samples-per-problem and --pass-k are for dlm's own tasks; an "
                               "lm-eval task sets its samples per problem (repeats) and metrics in its YAML (e.g. "
                               "dlm_humaneval_sampled)")
    one = len(r.models) == 1
    for i, model in enumerate(r.models):
        out = r.out if one or not r.out else f"{r.out}.{i}"
        samples = r.samples if one or not r.samples else f"{r.samples}.{i}"
        result = run_lm_eval(model, r.task.removeprefix("lm-eval:"), settings, n=r.n, batch_size=r.batch_size,
                             max_new_tokens=r.max_new_tokens, temperature=r.temperature, seed=r.seed, dtype=r.dtype,
                             device=r.device, mc_num=r.mc_num, num_fewshot=r.num_fewshot,
                             apply_chat_template=r.apply_chat_template, include_path=r.lm_eval_include or (),
                             data=r.data, samples=samples, out=out)
        print(f"{model}\n{result['table']}")
        for line in (f"results: {out}" if out else "", f"samples: {samples}" if samples else ""):
            if line:
                print(line)


def _mask_discrepancy(r: EvalRequest, settings: SamplingSettings, names: Mapping[str, str]) -> None:
    """D_mask(t) of the top-u sampler (PUMBA Def. 1): on the CPU in float32, with u alone."""
    from dlm.evaluation.mask_discrepancy import run_mask_discrepancy
    from dlm.evaluation.run import default_task_file

    if r.dtype not in ("auto", "float32") or r.device not in ("auto", "cpu"):
        raise EvalRequestError("--metric mask-discrepancy runs on the CPU in float32 (its trajectory pools live "
                               "there); drop --device and --dtype")
    unused = [names.get(k, k) for k in settings.model_fields_set if k != "reveal_count"]
    if unused or r.sweep:
        raise EvalRequestError(f"--metric mask-discrepancy measures the top-u sampler with --u alone; "
                               f"{', '.join(unused + ['--sweep'] * bool(r.sweep))} would be ignored: drop it")
    data = r.data or default_task_file(r.models[0], r.task)
    run_mask_discrepancy(r.models, data, u=settings.reveal_count, n=r.n or 50, seed=r.seed, out=r.out)


def _intrinsic(r: EvalRequest, settings: SamplingSettings) -> None:
    """Perplexity under a held-out reference model, dist-n, entropy and MAUVE (TESS 2 §4.1): one setting a model."""
    from dlm.evaluation.intrinsic import run_intrinsic
    from dlm.evaluation.run import default_max_new_tokens, default_task_file

    if not r.reference_model:
        raise EvalRequestError("--metric intrinsic needs --reference-model (a held-out AR model directory)")
    if r.sweep:
        raise EvalRequestError("--metric intrinsic scores one setting per model; --sweep would be ignored: drop it")
    data = r.data or default_task_file(r.models[0], r.task)
    length = r.max_new_tokens or default_max_new_tokens(r.task, r.models[0])
    run_intrinsic(r.models, data, r.reference_model, settings, n=r.n, batch_size=r.batch_size,
                  max_new_tokens=length, seed=r.seed, with_mauve=not r.no_mauve, out=r.out,
                  dtype=r.dtype, device=r.device, truncate_prompts=r.truncate_prompts)


def _accuracy(r: EvalRequest, settings: SamplingSettings) -> None:
    """dlm's own task (tinymath, humaneval): accuracy or pass@k, NFE and time, over a sweep if one is given."""
    from dlm.evaluation.sweeps import run_sweep, write_sweep

    ks = [int(k) for k in r.pass_k.split(",")] if r.pass_k else [1]
    result = run_sweep(r.models, r.data, settings, task=r.task, sweep=r.sweep, n=r.n, batch_size=r.batch_size,
                       max_new_tokens=r.max_new_tokens, seed=r.seed, dtype=r.dtype, device=r.device,
                       truncate_prompts=r.truncate_prompts, temperature=r.temperature or 0.0,
                       samples_per_problem=r.samples_per_problem, ks=ks, samples=r.samples)
    if result["trivial_baseline"] is not None:
        print(f"trivial baseline (most common answer): {100 * result['trivial_baseline']:.1f}% on {result['n']} "
              "problems")
    if r.out:
        table, png = write_sweep(result, r.out)
        print(f"results: {table}\nplot:    {png}")
    if r.samples:
        print(f"samples: {r.samples}")
