"""Intrinsic metrics of generations (TESS 2 §4.1, after SSD-LM / TESS): perplexity under a held-out AR model, distinct
n-grams (dist-1..4), unigram entropy and MAUVE against the references, with MAUVE features taken from the held-out
model's final hidden state (mauve-text, `pip install -e .[eval]`)."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

from dlm.data.canvas import collate, make_example
from dlm.data.tokenizer import encode_pair
from dlm.errors import DlmError
from dlm.modeling.reward import last_token_index


def distinct_n(token_lists: Sequence[Sequence[int]], n: int) -> float:
    """Mean over samples of (distinct n-grams / n-grams) in each sample; samples shorter than n are skipped."""
    ratios = []
    for toks in token_lists:
        grams = [tuple(toks[i : i + n]) for i in range(len(toks) - n + 1)]
        if grams:
            ratios.append(len(set(grams)) / len(grams))
    return sum(ratios) / len(ratios) if ratios else 0.0


def unigram_entropy(token_lists: Sequence[Sequence[int]]) -> float:
    """Mean over samples of the entropy (nats) of each sample's unigram distribution."""
    values = []
    for toks in token_lists:
        if toks:
            counts = Counter(toks)
            total = len(toks)
            values.append(-sum(c / total * math.log(c / total) for c in counts.values()))
    return sum(values) / len(values) if values else 0.0


@torch.no_grad()
def _score(model, tok, prompts: Sequence[str], responses: Sequence[str], batch_size: int):
    """(summed NLL of response + EOS, token count, final hidden state at the EOS) under a causal LM, per sample."""
    max_length = model.config.max_position_embeddings
    nll, count, feats = [], [], []
    for start in range(0, len(prompts), batch_size):
        exs = [make_example(*encode_pair(tok, p, r), max_length)
               for p, r in zip(prompts[start : start + batch_size], responses[start : start + batch_size])]
        b = collate(exs, tok.eos_token_id, tok.pad_token_id)
        out = model.backbone(input_ids=b["input_ids"], attention_mask=b["attention_mask"], output_hidden_states=True)
        logp = torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, b["input_ids"][:, 1:, None]).squeeze(-1)
        mask = b["loss_mask"][:, 1:]
        nll += (-(logp * mask).sum(-1)).tolist()
        count += mask.sum(-1).tolist()
        last = last_token_index(b["loss_mask"])  # the EOS after the response
        feats.append(out.hidden_states[-1][torch.arange(len(exs)), last].float())
    return nll, count, torch.cat(feats).numpy()


def mauve_score(reference_features, generated_features, seed: int = 25) -> float:
    """MAUVE (Pillutla et al. 2021) between reference and generated feature sets."""
    try:
        import mauve
    except ImportError:
        raise ImportError("MAUVE needs mauve-text: pip install -e .[eval] (with a torch==2.13.0 constraint)") from None
    return float(mauve.compute_mauve(p_features=reference_features, q_features=generated_features, seed=seed,
                                     verbose=False).mauve)


def intrinsic_metrics(prompts: Sequence[str], generations: Sequence[str], references: Sequence[str], tok,
                      reference_model, reference_tok, batch_size: int = 50, with_mauve: bool = True) -> dict:
    """Perplexity, dist-1..4, unigram entropy (generation tokens of `tok`) and MAUVE of `generations`."""
    token_lists = [tok(g, add_special_tokens=False)["input_ids"] for g in generations]
    nll, count, gen_feats = _score(reference_model, reference_tok, prompts, generations, batch_size)
    result = {"perplexity": math.exp(sum(nll) / max(sum(count), 1)),
              **{f"dist_{n}": distinct_n(token_lists, n) for n in (1, 2, 3, 4)},
              "unigram_entropy": unigram_entropy(token_lists),
              "mean_length": sum(map(len, token_lists)) / max(len(token_lists), 1)}
    if with_mauve:
        _, _, ref_feats = _score(reference_model, reference_tok, prompts, references, batch_size)
        result["mauve"] = mauve_score(ref_feats, gen_feats)
    return result


def run_intrinsic(models: Sequence[str | Path], data: str | Path, reference_model: str | Path, options=None, *,
                  n: int | None = None, batch_size: int = 50, max_new_tokens: int = 128, seed: int = 0,
                  with_mauve: bool = True, out: str | Path | None = None, progress: bool = True,
                  dtype=None, truncate_prompts: bool = False) -> dict:
    """One row per model: its generations for the prompts of `data`, scored by the held-out `reference_model`;
    the references (the data's responses) get a row too, as the ceiling. Each model samples with its family's share
    of `options` (SamplingSettings, one family's SamplingOptions or None). The evaluated models generate at `dtype`
    (e.g. "bfloat16"); the reference model always scores in float32, so rows stay comparable across dtypes."""
    from dlm.data.sources import read_jsonl
    from dlm.evaluation.tasks import evaluate
    from dlm.sampling import dtype_name, load_for_inference, resolve_options

    records = read_jsonl(data, required=("prompt", "response"))
    records = records[:n] if n else records
    ref_model, ref_tok = load_for_inference(reference_model)
    if ref_model.spec.family != "autoregressive":
        raise DlmError(f"{reference_model}: the held-out model must be an autoregressive model")
    prompts, references = [r["prompt"] for r in records], [r["response"] for r in records]
    rows = [{"model": "references", **intrinsic_metrics(prompts, references, references, ref_tok, ref_model, ref_tok,
                                                        batch_size, with_mauve)}]
    for path in models:
        model, tok = load_for_inference(path, dtype=dtype)
        graded = "answer" in records[0]
        own = resolve_options(model.spec.family, options, strict=False)
        r = evaluate(model, tok, records if graded else [{**x, "answer": None} for x in records], own,
                     batch_size=batch_size, max_new_tokens=max_new_tokens, seed=seed,
                     truncate_prompts=truncate_prompts)
        generations = [s["generation"] for s in r["samples"]]
        row = {"model": str(path), "family": model.spec.family, **own.model_dump(mode="json"),
               **intrinsic_metrics(prompts, generations, references, tok, ref_model, ref_tok, batch_size, with_mauve)}
        if graded:
            row["accuracy"] = r["accuracy"]
        rows.append(row)
        if progress:
            print(json.dumps(row))
    result = {"data": str(data), "n": len(records), "reference_model": str(reference_model), "dtype": dtype_name(dtype),
              "rows": rows}
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return result
