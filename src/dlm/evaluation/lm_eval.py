"""dlm as an lm-eval (0.4.x) model, registered as `dlm`: any run, model or checkpoint directory of any family, decoded
by dlm's own samplers with the typed sampling options as model args.

lm-eval finds models only in its registry (no entry points in 0.4.13), so the registration runs when this module is
imported: `dlm lm-eval ...` (lm-eval's CLI with this module imported and dlm's packaged tasks on --include_path), or
in Python `import dlm.evaluation.lm_eval` before `lm_eval.simple_evaluate(model="dlm", ...)`.

    generate_until         every family: dlm.sampling.generate (any policy, blocks, caches, carry); `until` strings
                           cut the decoded text, `max_gen_toks` is the AR token limit / the diffusion canvas
    loglikelihood          AR: exact; masked: the Monte-Carlo ELBO (dlm.evaluation.elbo; mc_num, seed); simplex: error
    loglikelihood_rolling  AR and masked, over lm-eval's rolling windows of the model's context

NFE, tokens/s and the sampling options land in the results' `config["dlm"]` (`get_model_info`)."""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

from dlm.errors import DlmError, OptionsError
from dlm.evaluation.elbo import forward_passes, loglikelihood
from dlm.evaluation.humaneval import stop_at
from dlm.evaluation.tasks import encode_text, encode_texts, generate_batched
from dlm.modeling.device import make_generator, placement
from dlm.sampling import (
    SamplingOptions,
    SamplingSettings,
    load_for_inference,
    parse_settings,
    resolve_options,
)
from dlm.sampling.options import ALIASES, OWNER, ignored, option_name

try:
    import lm_eval.models  # noqa: F401  (fills the registry first: lm-eval imports its own models only into an empty one)
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError:  # pragma: no cover - depends on the environment
    raise DlmError("lm-eval is not installed: pip install -e .[eval] (with a torch==2.13.0 constraint)") from None

TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"  # dlm's packaged lm-eval tasks (for --include_path)
MODEL_ARGS = ("pretrained", "dtype", "batch_size", "max_batch_size", "device", "seed", "mc_num", "common_masks",
              "max_gen_toks", "add_bos_token", "truncate_prompts", "trust_remote_code")
# how a prompt too long for the context is made to fit, in lm-eval's words (`dlm.evaluation.tasks.fit_hint`)
FIT_FLAGS = ("model_args truncate_prompts=true", "gen_kwargs max_gen_toks={0} (dlm eval: --max-new-tokens {0})")


@register_model("dlm")
class DlmLM(LM):
    """lm-eval's LM interface over a dlm model. Model args: pretrained (run/model/checkpoint directory), dtype
    (auto, float32, bfloat16, float16), batch_size, device, seed, mc_num (ELBO masks per request), common_masks
    (true: a context's choices of one length share their ELBO masks; `dlm.evaluation.elbo`), max_gen_toks
    (when a request does not say), add_bos_token, truncate_prompts (keep a too-long context's end; default true), and
    any sampling option by its field or short name (policy, u, tau, block_size, kv_cache, cache, steps, top_p, ...).
    device and dtype resolve as every dlm command's (`dlm.modeling.device`): auto, the default, is the GPU in
    bfloat16 where there is one, else the CPU in float32; lm-eval's --device reaches `device`."""

    def __init__(self, pretrained: str | Path, dtype: str | None = "auto", batch_size: int | str = 8,
                 max_batch_size: int | None = None, device: str | None = None, seed: int = 0, mc_num: int = 128,
                 common_masks: bool | str = True, max_gen_toks: int = 256, add_bos_token: bool = False,
                 truncate_prompts: bool = True,
                 trust_remote_code: bool | None = None, options=None, **sampling):
        super().__init__()
        self.batch_size = _positive("batch_size", batch_size)  # every arg is checked before the model loads
        self.mc_num, self.max_gen_toks = _positive("mc_num", mc_num), _positive("max_gen_toks", max_gen_toks)
        self.seed, self.add_bos, self.truncate = int(seed), bool(add_bos_token), bool(truncate_prompts)
        self.common_masks = _flag("common_masks", common_masks)
        values = _sampling_values(options, sampling)
        names = {option_name(k): k for k in sampling if k in OWNER or k in ALIASES}  # how the model args wrote them
        if isinstance(values, dict):  # each value in range, the policy rule (tau alone: threshold; an option the
            parse_settings(values, names=names)  # policy does not read: refused); the model's family: below
        self.model, self.tok = load_for_inference(pretrained, dtype=dtype or "auto", device=device or "auto")
        self.placement = placement(self.model)  # device, dtype, device name, threads: recorded in the results
        self.family = self.model.spec.family
        self.options = resolve_options(self.family, values)
        for note in ignored(self.family, values, self.model.spec, self.options):  # e.g. --tau for an AR model
            print(f"dlm: {Path(str(pretrained)).name} ({self.family}) ignores {note}", file=sys.stderr)
        self.pretrained = str(pretrained)
        self.stats: dict = defaultdict(lambda: {"requests": 0, "nfe": 0, "tokens": 0, "seconds": 0.0})
        self.request_nfe: dict = defaultdict(int)  # (task, doc_id) -> NFE summed over the doc's requests
        self.truncated = 0

    # ---- lm-eval's interface -------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out: list = [None] * len(requests)
        groups = defaultdict(list)
        for i, req in enumerate(requests):
            groups[self._generation(req.args[1])[1:]].append(i)
        for (max_new, temperature), idx in groups.items():
            ids, cut = encode_texts(self.tok, [requests[i].args[0] for i in idx], self.model, max_new,
                                    truncate=self.truncate, add_bos=self.add_bos, flags=FIT_FLAGS)
            self.truncated += cut
            order = sorted(range(len(idx)), key=lambda j: -len(ids[j]))  # similar lengths share a batch
            texts, nfes, tokens, seconds = generate_batched(
                self.model, self.tok, [ids[j] for j in order], self.options, batch_size=self.batch_size,
                max_new_tokens=max_new, temperature=temperature, generator=make_generator(self.seed, self.model),
                progress=not disable_tqdm)
            for j, text, nfe, n_tok, secs in zip(order, texts, nfes, tokens, seconds):
                req = requests[idx[j]]
                out[idx[j]] = stop_at(text, self._generation(req.args[1])[0])
                self._count(req, "generate_until", nfe, n_tok, secs)
        return out

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return self._score(requests, [self._pair(*req.args) for req in requests], "loglikelihood")

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        limit = getattr(self.model.config, "max_position_embeddings", None) or 2048
        windows, owner = [], []
        for i, req in enumerate(requests):
            ids = encode_text(self.tok, req.args[0])
            for w in get_rolling_token_windows(ids, self.tok.eos_token_id, limit - 1, 1):
                windows.append(make_disjoint_window(w))
                owner.append(i)
        scores = self._score([requests[i] for i in owner], windows, "loglikelihood_rolling")
        totals = [0.0] * len(requests)
        for i, (ll, _) in zip(owner, scores):
            totals[i] += ll
        return totals

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation rendered by the model's own chat template (dlm tokenizers: `user: ...\\nassistant: `)."""
        return self.tok.apply_chat_template(chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
                                            continue_final_message=not add_generation_prompt)

    @property
    def tokenizer_name(self) -> str:
        return self.pretrained.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tok.chat_template

    def get_model_info(self) -> dict:
        """What lm-eval adds to results["config"]: the model, its sampler settings and the cost of each task."""
        tasks: dict[str, dict] = {}
        for (task, kind), s in sorted(self.stats.items()):
            tasks.setdefault(task, {})[kind] = {
                **s, "mean_nfe": s["nfe"] / max(s["requests"], 1),
                **({"tokens_per_s": s["tokens"] / max(s["seconds"], 1e-9), "tokens_per_nfe": s["tokens"] /
                    max(s["nfe"], 1)} if kind == "generate_until" else {})}
        return {"dlm": {"pretrained": self.pretrained, "family": self.family, **self.placement,
                        "sampling": {"family": self.family, **self.options.in_effect(self.model.spec)},
                        "seed": self.seed, "mc_num": self.mc_num, "common_masks": self.common_masks,
                        "batch_size": self.batch_size,
                        "truncated_prompts": self.truncated, "tasks": tasks}}

    # ---- helpers ---------------------------------------------------------------------------------------------------
    def _generation(self, kwargs) -> tuple[tuple[str, ...], int, float]:
        """(until strings, max new tokens, temperature) of a request. do_sample false = greedy; do_sample true
        without a temperature samples at 1.0; gen kwargs dlm has no use for (top_k, ...) are ignored."""
        kwargs = dict(kwargs or {})
        until = kwargs.get("until") or ()
        until = (until,) if isinstance(until, str) else tuple(until)
        do_sample = kwargs.get("do_sample")
        temperature = float(kwargs.get("temperature", 1.0 if do_sample else 0.0))
        if do_sample is False:
            temperature = 0.0
        return until, _positive("max_gen_toks", kwargs.get("max_gen_toks", self.max_gen_toks)), temperature

    def _pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of (context, continuation) as lm-eval splits them: trailing spaces of the context move to the
        continuation, the continuation's ids are those of the whole text after the context's; an empty context is
        the EOS token."""
        if not context:
            return [self.tok.eos_token_id], encode_text(self.tok, continuation)
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = encode_text(self.tok, context + continuation, self.add_bos)
        ctx = encode_text(self.tok, context, self.add_bos)
        return ctx, whole[len(ctx):]

    def _score(self, requests, pairs, kind: str) -> list[tuple[float, bool]]:
        t0 = time.perf_counter()
        scores = loglikelihood(self.model, pairs, mc_num=self.mc_num, batch_size=self.batch_size, seed=self.seed,
                               pad_id=self.tok.pad_token_id, common_masks=self.common_masks)
        seconds = (time.perf_counter() - t0) / max(len(pairs), 1)
        seen = set()  # a rolling request is scored in several windows: each window costs, the request counts once
        for req in requests:
            self._count(req, kind, forward_passes(self.model, 1, self.mc_num), 0, seconds, new=id(req) not in seen)
            seen.add(id(req))
        return scores

    def _count(self, req, kind: str, nfe: int, tokens: int, seconds: float, new: bool = True) -> None:
        s = self.stats[(req.task_name or "-", kind)]
        s["requests"], s["nfe"], s["tokens"], s["seconds"] = (s["requests"] + new, s["nfe"] + nfe,
                                                              s["tokens"] + tokens, s["seconds"] + seconds)
        self.request_nfe[(req.task_name, req.doc_id)] += nfe


def _flag(name: str, value) -> bool:
    """A boolean model arg, given as a bool or as lm-eval's text (true/false, any case)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text not in ("true", "false", "1", "0"):
        raise DlmError(f"dlm model arg {name}={value!r}: must be true or false")
    return text in ("true", "1")


def _positive(name: str, value) -> int:
    try:
        number = int(value)
        ok = number >= 1 and float(value) == number
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise DlmError(f"dlm model arg {name}={value!r}: must be an integer >= 1 (dlm has no automatic batch size)")
    return number


def _sampling_values(options, values: Mapping) -> SamplingSettings | SamplingOptions | dict | None:
    """Sampling options from model args (fields or short names: tau=0.9, u=2) or a Python options object."""
    if values and options is not None:
        raise OptionsError("give sampling options either as model args or as options=, not both")
    if options is not None:
        return options
    out = {}
    for key, value in values.items():
        if key not in OWNER and key not in ALIASES:
            raise DlmError(f"unknown dlm model arg {key!r}; model args: {', '.join(MODEL_ARGS)}, and the sampling "
                           f"options {', '.join(OWNER)} (short names: {', '.join(ALIASES)})")
        out[option_name(key)] = value
    return out or None


def task_manager(names: Sequence[str], include_path: Sequence[str | Path] = (), metadata: dict | None = None):
    """lm-eval's TaskManager over dlm's packaged tasks (+ `include_path`), with lm-eval's own ~15k tasks only when a
    name is not found there (indexing them takes seconds; they read from the hub, not reachable offline)."""
    from lm_eval.tasks import TaskManager

    paths = [str(TASKS_DIR), *map(str, include_path)]
    manager = TaskManager(include_path=paths, include_defaults=False, metadata=metadata)
    if not all(name in manager.all_tasks for name in names):
        manager = TaskManager(include_path=paths, metadata=metadata)
    missing = [name for name in names if name not in manager.all_tasks]
    if missing:
        raise DlmError(f"unknown lm-eval task {', '.join(missing)}; dlm ships "
                       f"{', '.join(sorted(p.stem for p in TASKS_DIR.glob('*.yaml')))} (a folder of your own task "
                       "YAMLs: --lm-eval-include DIR)")
    return manager


def run_lm_eval(model_path: str | Path, task: str, options=None, *, n: int | None = None, batch_size: int = 8,
                max_new_tokens: int | None = None, temperature: float | None = None, seed: int = 0, dtype="auto",
                mc_num: int = 128, num_fewshot: int | None = None, apply_chat_template: bool = False, device="auto",
                truncate_prompts: bool = True, include_path: Sequence[str | Path] = (), data: str | Path | None = None,
                samples: str | Path | None = None, out: str | Path | None = None) -> dict:
    """`dlm eval --task lm-eval:TASK`: one lm-eval task (or group) on a dlm model through `simple_evaluate`; returns
    {model, task, results, n-samples, config (dlm's: sampling options, NFE, tokens/s)}, written to `out` (JSON) and
    every problem's prompt, response, NFE and metrics to `samples` (jsonl). `max_new_tokens` / `temperature` override
    the task's generation kwargs; `n` limits the documents per task; `mc_num` is the ELBO's masks per request;
    `data` reaches the task as metadata (dlm's packaged tasks read their records from it); `device` and `dtype`
    place the model (`load_for_inference`) and are recorded."""
    import json

    from lm_eval import simple_evaluate

    from dlm.evaluation.run import write_samples

    metadata = {"pretrained": str(model_path), **({"data": str(data)} if data else {})}
    manager = task_manager([task], include_path, metadata)  # an unknown task is said before the model loads
    lm = DlmLM(model_path, dtype=dtype, batch_size=batch_size, seed=seed, mc_num=mc_num, device=device,
               truncate_prompts=truncate_prompts, options=options)
    gen_kwargs: dict[str, float | bool] = {"max_gen_toks": max_new_tokens} if max_new_tokens else {}
    if temperature is not None:
        gen_kwargs.update(temperature=temperature, do_sample=temperature > 0)
    results = simple_evaluate(
        model=lm, tasks=[task], task_manager=manager,
        limit=n, num_fewshot=num_fewshot, gen_kwargs=gen_kwargs or None, apply_chat_template=apply_chat_template,
        log_samples=True, confirm_run_unsafe_code=True, random_seed=seed, numpy_random_seed=seed,
        torch_random_seed=seed, fewshot_random_seed=seed, bootstrap_iters=1000)
    summary = {"model": str(model_path), "task": f"lm-eval:{task}", **lm.placement,
               "results": results["results"], "n-samples": results.get("n-samples"), "config": results["config"]}
    if samples:
        write_samples(samples, (_sample_line(model_path, name, s, lm.request_nfe)
                                for name, rows in results["samples"].items() for s in rows))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(summary, indent=2, default=str) + "\n")
    summary["table"] = _table(results)
    return summary


def _sample_line(model_path, task: str, s: dict, nfe: Mapping) -> dict:
    """One logged lm-eval sample as a --samples line: the prompt, the model's responses, NFE and the metrics."""
    arguments = [list(a.values()) if isinstance(a, dict) else list(a) for a in s["arguments"]]
    return {"model": str(model_path), "task": f"lm-eval:{task}", "doc_id": s["doc_id"],
            "prompt": next((str(a[0]) for a in arguments if a), ""), "target": s.get("target"),
            "generation": s["filtered_resps"], "nfe": nfe.get((task, s["doc_id"]), 0),
            "grade": {m: s[m] for m in s.get("metrics", []) if m in s}}


def _table(results: dict) -> str:
    from lm_eval.utils import make_table

    return make_table(results)


def main(argv: Sequence[str]) -> None:
    """`dlm lm-eval ARGS`: lm-eval's own CLI with model `dlm` registered and dlm's packaged tasks on --include_path
    (unless ARGS give one)."""
    from lm_eval.__main__ import cli_evaluate

    args = list(argv)
    if args in (["-h"], ["--help"]):  # the flags of an evaluation run (lm-eval's `run`), which ARGS are
        print("dlm lm-eval: lm-eval's CLI with model `dlm` registered and dlm's packaged tasks (dlm_tinymath, "
              "dlm_humaneval, dlm_humaneval_sampled) on --include_path; its flags:\n")
        args = ["run", "--help"]
    elif args and not any(a.split("=")[0] == "--include_path" for a in args):
        args += ["--include_path", str(TASKS_DIR)]
    if args and args[0] not in ("-h", "--help") and not any(a.split("=")[0] == "--device" for a in args):
        args += ["--device", "auto"]  # lm-eval's own default is cuda:0, absent on a laptop: dlm's auto instead
    from dlm.config import SMOKE_ENV, SMOKE_N, smoke

    if smoke() and args and args[0] not in ("-h", "--help") and not any(a.split("=")[0] == "--limit" for a in args):
        args += ["--limit", str(SMOKE_N)]  # the documented commands at toy scale (scripts/run_doc_commands.py)
        print(f"{SMOKE_ENV}=1: --limit {SMOKE_N}; not a result", file=sys.stderr)
    sys.argv = ["lm-eval", *args]
    cli_evaluate()
