"""Program-answer tasks (tinymath, TinyGSM/GSM8K-style): generate a `def solution(): ...` program per problem, run it
in the sandbox and compare its return value with the known answer."""

from __future__ import annotations

import time
from collections.abc import Sequence

from tqdm.auto import tqdm

from dlm.data.prompts import encode_prompts, generation_span
from dlm.data.sources import DataError
from dlm.errors import OptionsError
from dlm.evaluation.sandbox import answers_match, run_programs
from dlm.modeling.device import make_generator
from dlm.sampling import generate, resolve_options


def grade_programs(programs: Sequence[str], answers: Sequence, timeout: float = 1.0) -> list[bool]:
    """True where the program runs in the sandbox and returns the expected answer (floats to 1e-3, PUMBA §B.3)."""
    results = run_programs(list(programs), timeout=timeout)
    return [r.ok and answers_match(r.value, a) for r, a in zip(results, answers)]


def evaluate(model, tok, records: Sequence[dict], options=None, *, batch_size: int = 50, max_new_tokens: int = 128,
             temperature: float = 0.0, seed: int = 0, progress: bool = False, truncate_prompts: bool = False) -> dict:
    """Accuracy, mean NFE, tokens per NFE and wall time of `model` on `records` (which carry an `answer`), sampled
    with `options` (as for `dlm.sampling.generate`: the model family's options, SamplingSettings or None). A prompt
    longer than the model's context is refused naming its file:line, or with `truncate_prompts` keeps its end."""
    if model.spec.family == "reward":  # a reward model generates nothing: pairwise accuracy on chosen vs rejected
        from dlm.evaluation.reward import evaluate_reward

        return evaluate_reward(model, tok, records, batch_size=batch_size, seed=seed)
    options = resolve_options(model.spec.family, options)
    model.eval()
    prompts = encode_prompts(tok, records, model, max_new_tokens, truncate=truncate_prompts)
    texts, nfes, tokens, seconds = generate_batched(
        model, tok, prompts, options, batch_size=batch_size, max_new_tokens=max_new_tokens, temperature=temperature,
        generator=make_generator(seed, model), progress=progress)
    n_tokens, gen_seconds = sum(tokens), sum(seconds)
    correct = grade_programs(texts, [r["answer"] for r in records])
    n = max(len(records), 1)
    return {
        "accuracy": sum(correct) / n,
        "n": len(records),
        "mean_nfe": sum(nfes) / n,
        "tokens_per_nfe": n_tokens / max(sum(nfes), 1),
        "wall_s": gen_seconds,
        "ms_per_problem": 1000 * gen_seconds / n,
        "samples": [
            {"prompt": r["prompt"], "generation": t, "answer": r["answer"], "correct": c, "nfe": f}
            for r, t, c, f in zip(records, texts, correct, nfes)
        ],
    }


def generate_batched(model, tok, prompts: Sequence[Sequence[int]], options, *, batch_size: int, max_new_tokens: int,
                     temperature: float = 0.0, generator=None, progress: bool = False
                     ) -> tuple[list[str], list[int], list[int], list[float]]:
    """Per prompt: text, NFE, tokens generated (with the stopping EOS) and seconds (its batch's time shared evenly),
    of `prompts` decoded in batches."""
    texts, nfes, tokens, seconds = [], [], [], []
    batches = range(0, len(prompts), batch_size)
    for start in tqdm(batches, desc="generating", unit="batch", disable=not progress, leave=False):
        t0 = time.perf_counter()
        out = generate(model, prompts[start : start + batch_size], options, max_new_tokens=max_new_tokens,
                       eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, temperature=temperature,
                       generator=generator)
        texts += [tok.decode(t, skip_special_tokens=True) for t in out.tokens]
        nfes += out.nfe
        tokens += [len(t) + 1 for t in out.tokens]
        seconds += [(time.perf_counter() - t0) / len(out.tokens)] * len(out.tokens)
    return texts, nfes, tokens, seconds


def encode_text(tok, text: str, add_bos: bool = False) -> list[int]:
    """Token ids of a text used as it is (no chat template, no specials), with the tokenizer's BOS first when
    `add_bos` and the text does not already start with it."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    bos = tok.bos_token_id
    return [bos, *ids] if add_bos and bos is not None and ids[:1] != [bos] else ids


def encode_texts(tok, texts: Sequence[str], model, max_new_tokens: int, truncate: bool = False,
                 names: Sequence[str] | None = None, add_bos: bool = False,
                 flags: tuple[str, str] = ("--truncate-prompts", "--max-new-tokens {}")) -> tuple[list[list[int]], int]:
    """(ids, how many were cut) of prompts used as they are (`encode_text`: code to continue, or a context lm-eval
    already rendered). As for chat prompts (`dlm.data.prompts`), a prompt longer than the model's context is refused
    naming it and the settings that fit (`fit_hint`, in the words of `flags`: truncation, generation length), or with
    `truncate` keeps its last `context - generation` tokens."""
    context = getattr(model.config, "max_position_embeddings", None)
    span = generation_span(model.spec, max_new_tokens)
    out = [encode_text(tok, text, add_bos) for text in texts]
    over = [i for i, ids in enumerate(out) if context and len(ids) > context]
    if not context or not over:
        return out, 0
    longest = max(len(ids) for ids in out)
    hint = fit_hint(model.spec, context, max_new_tokens, longest, truncate, flags)
    if not truncate:
        first = over[0]
        where = names[first] if names else f"prompt {first + 1}"
        raise DataError(f"{where}: prompt is {len(out[first])} tokens, more than the model's context of {context} "
                        f"(max_position_embeddings; {len(over)} of {len(out)} prompts are, the longest {longest}); "
                        f"{hint}")
    if context - span < 1:
        raise OptionsError(f"max_new_tokens {max_new_tokens} fills the model's whole context ({context} positions): "
                           f"no room is left for a prompt; {hint}")
    for i in over:
        out[i] = out[i][-(context - span):]
    return out, len(over)


def fit_hint(spec, context: int, max_new_tokens: int, longest: int, truncate: bool,
             flags: tuple[str, str] = ("--truncate-prompts", "--max-new-tokens {}")) -> str:
    """What makes prompts of up to `longest` tokens fit a `context`-position model, with the values that do:
    truncation (with a generation length that leaves room for a prompt) or a model whose context holds the longest
    prompt and its generation. `flags`: the words for truncation and for the generation length ("{}": its value)."""
    truncate_flag, length_flag = flags
    span = generation_span(spec, max_new_tokens)
    block = getattr(spec, "block_size", None) if getattr(spec, "attention", None) == "block_causal" else None
    if span < context:  # the generation leaves room for a prompt: truncating is enough
        length, words = max_new_tokens, [truncate_flag]
    else:  # about half the context each for the prompt and the generation (whole blocks for block-causal models)
        length = context // 2 // block * block if block else context // 2
        words = ([] if truncate else [truncate_flag]) + [length_flag.format(length)]
    kept = context - generation_span(spec, length) if length > 0 else 0
    ways = [f"use {' '.join(words)}, which keeps the last {kept} tokens of each too-long prompt"] if kept > 0 else []
    needed = longest + span
    ways.append(f"a model whose context holds the longest prompt and its generation, {longest} + {span} = {needed} "
                f"positions (dlm train --set model.max_length={-(-needed // 64) * 64} on the run that creates the "
                "model: init_from keeps its source's context)")
    return "to fit, " + ", or ".join(ways)


def trivial_baseline(records: Sequence[dict]) -> float:
    """Accuracy of always answering the most common answer: the floor a trained model must clear."""
    from collections import Counter

    answers = Counter(str(r["answer"]) for r in records)
    return answers.most_common(1)[0][1] / max(len(records), 1)
