"""TESS 2 on Shakespeare (§4.1 in spirit): the measurements behind docs/results/tess2-shakespeare.md.

    # generations for the prefix / unconditional eval prompts, scored as `dlm eval --metric intrinsic` scores them
    # (dlm.evaluation.intrinsic.intrinsic_metrics: perplexity under the held-out AR, dist-1..4, unigram entropy, MAUVE
    # on MiniLM features), plus a bootstrap CI of the perplexity over generations, and the generations themselves
    python benchmarks/tess2_shakespeare.py generate runs/shakespeare/ar runs/shakespeare/tess2-adapt \
        runs/shakespeare/tess2-scratch --reference-model runs/shakespeare/reference-ar \
        --data runs/shakespeare/data/eval-prefix.jsonl --n 200 --out runs/shakespeare/intrinsic-prefix.json
    # one table from several `generate` outputs on the same data (rows of models already present are dropped)
    python benchmarks/tess2_shakespeare.py merge --tables a.json b.json --out both.json
    # the doc's figure: training loss of the two simplex runs, and the intrinsic metrics per model
    python benchmarks/tess2_shakespeare.py plot --runs runs/shakespeare/tess2-adapt runs/shakespeare/tess2-scratch \
        --tables runs/shakespeare/intrinsic-prefix.json runs/shakespeare/intrinsic-unconditional.json \
        --out docs/results/tess2-shakespeare.png

AR models sample at --ar-temperature (1.0: unconditional prompts would all decode alike greedily); simplex models
decode with argmax projection (their randomness is the initial noise) over a --max-new-tokens canvas.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from dlm.data.prompts import encode_prompts
from dlm.data.sources import read_jsonl
from dlm.data.tokenizer import load_tokenizer
from dlm.evaluation.intrinsic import _score, intrinsic_metrics
from dlm.evaluation.tasks import generate_batched
from dlm.modeling.backbone import resolve_model_dir
from dlm.sampling import SimplexOptions, load_for_inference


def perplexity_ci(nll, count, n_boot: int = 1000, seed: int = 0) -> tuple[float, float]:
    """95 % bootstrap interval of exp(sum NLL / sum tokens), resampling generations."""
    nll, count = np.asarray(nll), np.asarray(count)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(nll), size=(n_boot, len(nll)))
    ppl = np.exp(nll[idx].sum(1) / np.maximum(count[idx].sum(1), 1))
    return float(np.percentile(ppl, 2.5)), float(np.percentile(ppl, 97.5))


def generate_section(args) -> dict:
    records = read_jsonl(args.data, required=("prompt", "response"))[: args.n]
    prompts, references = [r["prompt"] for r in records], [r["response"] for r in records]
    ref_model, ref_tok = load_for_inference(args.reference_model)
    # dist-n and entropy of the references count tokens of the first model's tokenizer, as the models' rows do
    first_tok = load_tokenizer(resolve_model_dir(args.models[0])) if args.models else ref_tok
    rows, samples = [], []
    for path in ["references", *args.models]:
        t0 = time.perf_counter()
        if path == "references":
            model, tok, generations, row = None, first_tok, references, {"model": "references"}
        else:
            model, tok = load_for_inference(path)
            family = model.spec.family
            simplex = family == "simplex"
            options = SimplexOptions(inference_steps=args.steps) if simplex else None
            temperature = 0.0 if simplex else args.ar_temperature
            ids = encode_prompts(tok, records, model, args.max_new_tokens, truncate=True)
            generations, nfes, _, _ = generate_batched(
                model, tok, ids, options, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                temperature=temperature, generator=torch.Generator().manual_seed(args.seed))
            row = {"model": str(path), "family": family, "temperature": temperature,
                   "inference_steps": args.steps if simplex else None, "mean_nfe": sum(nfes) / len(nfes)}
        gen_s = time.perf_counter() - t0
        row.update(intrinsic_metrics(prompts, generations, references, tok, ref_model, ref_tok, args.batch_size,
                                     with_mauve=True, mauve_features="minilm"))
        nll, count, _ = _score(ref_model, ref_tok, prompts, generations, args.batch_size)
        row["perplexity_ci95"] = perplexity_ci(nll, count)
        row["generation_s"] = gen_s
        rows.append(row)
        print(json.dumps(row), flush=True)
        samples += [{"model": row["model"], "prompt": p, "generation": g, "nll": a, "tokens": c}
                    for p, g, a, c in zip(prompts, generations, nll, count)]
    if args.samples:
        Path(args.samples).write_text("".join(json.dumps(s) + "\n" for s in samples))
    return {"data": args.data, "n": len(records), "reference_model": args.reference_model, "seed": args.seed,
            "max_new_tokens": args.max_new_tokens, "mauve_features": "minilm", "threads": torch.get_num_threads(),
            "rows": rows}


def plot_section(args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = [json.loads(Path(t).read_text()) for t in args.tables or []]
    fig, axes = plt.subplots(1, 1 + 2 * bool(tables), figsize=(5 + 9 * bool(tables), 3.8))
    axes = np.atleast_1d(axes)
    for run in args.runs or []:
        rows = [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "loss" in r]
        axes[0].plot([r["step"] for r in rows], [r["loss"] for r in rows], label=Path(run).name)
    axes[0].set(xlabel="update", ylabel="training loss (simplex CE / token)", title="adapted from AR vs from scratch")
    axes[0].legend()
    for ax, metric in zip(axes[1:], ("perplexity", "mauve")):
        width = 0.8 / max(len(tables), 1)
        names = list(dict.fromkeys(Path(r["model"]).name for t in tables for r in t["rows"]))  # one order for all
        for i, table in enumerate(tables):
            by_name = {Path(r["model"]).name: r for r in table["rows"]}
            rows = [by_name[n] for n in names if n in by_name]
            values = [r[metric] for r in rows]
            x = np.array([names.index(Path(r["model"]).name) for r in rows]) + i * width
            if metric == "perplexity":
                lo = [v - r["perplexity_ci95"][0] for v, r in zip(values, rows)]
                hi = [r["perplexity_ci95"][1] - v for v, r in zip(values, rows)]
                ax.bar(x, values, width, yerr=[lo, hi], label=Path(table["data"]).stem)
            else:
                ax.bar(x, values, width, label=Path(table["data"]).stem)
            ax.set_xticks(np.arange(len(names)) + width * (len(tables) - 1) / 2, names, rotation=15)
        ax.set(title=f"{metric} (n = {tables[0]['n']} per condition)" if tables else metric)
        if metric == "perplexity":
            ax.set_yscale("log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


def merge_section(args) -> None:
    tables = [json.loads(Path(t).read_text()) for t in args.tables]
    if len({(t["data"], t["n"], t["reference_model"], t["max_new_tokens"]) for t in tables}) != 1:
        raise SystemExit("merge: the tables differ in data, n, reference model or max_new_tokens")
    merged, seen = {**tables[0], "rows": [], "parts": args.tables}, set()
    for row in (r for t in tables for r in t["rows"]):
        if row["model"] not in seen:
            seen.add(row["model"])
            merged["rows"].append(row)
    merged["wall_s"] = sum(t.get("wall_s") or 0 for t in tables)
    Path(args.out).write_text(json.dumps(merged, indent=2) + "\n")


# ---- the doc's tables, generated from its JSON ---------------------------------------------------------------------
def _name(model: str, references: str) -> str:
    base = Path(model).name
    seed = ", seed 1" if base.endswith("-s1") else ""
    base = base.removesuffix("-s1")
    return {"references": references, "tess2-adapt": "TESS 2 adapted from AR",
            "tess2-scratch": "TESS 2 from scratch"}.get(base, base) + seed


INTRINSIC_HEAD = ["| generations of | perplexity (95 % CI) | dist-1 | dist-2 | dist-3 | dist-4 | unigram entropy | "
                  "MAUVE | mean tokens |", "|---|---|---|---|---|---|---|---|---|"]


def _intrinsic_row(r: dict, references: str) -> str:
    label = f"AR baseline, T = {r['temperature']:g}" if r.get("family") == "autoregressive" else \
        _name(r["model"], references)
    lo, hi = r["perplexity_ci95"]
    return (f"| {label} | {r['perplexity']:.1f} ({lo:.1f}–{hi:.1f}) | " + " | ".join(
        f"{r[k]:.3f}" for k in ("dist_1", "dist_2", "dist_3", "dist_4")) + f" | {r['unigram_entropy']:.2f} | "
        f"{r['mauve']:.3f} | {r['mean_length']:.1f} |")


def _loss_rows(result: list[dict]) -> list[str]:
    return [f"| {_name(r['model'], '')} | " + " | ".join(
        f"{r[k]:.2f}" for k in ("response", "ul2_t5", "ul2_aggressive_t5", "ul2_prefix_lm")) + " |" for r in result]


def report_blocks(data: dict) -> dict[str, list[str]]:
    """The markdown of each generated block of docs/results/tess2-shakespeare.md, from its JSON."""
    out = {}
    loss = data.get("heldout_simplex_loss_validation")
    if loss:
        out["loss"] = ["| model (500 updates) | response (prefix-LM on the prompt) | UL2 T5 spans (~15 %) | "
                       "UL2 aggressive T5 (~50 %) | UL2 prefix-LM |", "|---|---|---|---|---|",
                       *_loss_rows(loss["result"])]
    for key, block, refs in (("intrinsic_prefix", "prefix", "references (the passages' rest)"),
                             ("intrinsic_unconditional", "unconditional", "references (whole passages)")):
        if key in data:
            sec = data[key]
            out[block] = [f"{sec['n']} prompts, at most {sec['max_new_tokens']} new tokens, held-out model "
                          f"`{sec['reference_model']}`, MAUVE features: {sec['mauve_features']}:", "",
                          *INTRINSIC_HEAD, *(_intrinsic_row(r, refs) for r in sec["rows"])]
    if "ar_temperature_control_prefix" in data:
        out["temperature"] = [*INTRINSIC_HEAD, *(_intrinsic_row(r, "")
                                                for r in data["ar_temperature_control_prefix"].values())]
    s1 = data.get("seed1")
    if s1 and loss:
        def train_loss(curve):
            tail = [x["loss"] for x in curve[-5:]]
            return f"{sum(tail) / len(tail):.2f}"

        runs = {**data.get("training", {}), **s1.get("training", {})}
        rows = []
        for seed, result in ((0, loss["result"]), (1, s1["heldout_simplex_loss_validation"]["result"])):
            for r in result:
                name = Path(r["model"]).name
                kind = "adapted from the AR" if name.startswith("tess2-adapt") else "from scratch"
                rows.append((kind != "adapted from the AR", seed, f"| {kind} | {seed} | "
                             f"{train_loss(runs[name]) if name in runs else '–'} | " + " | ".join(
                                 f"{r[k]:.2f}" for k in ("response", "ul2_t5", "ul2_aggressive_t5", "ul2_prefix_lm"))
                             + " |"))
        out["seed1-loss"] = ["| simplex model, 500 updates | seed | training loss (last 5 logs) | held-out loss: "
                             "response | UL2 T5 | UL2 aggressive T5 | UL2 prefix-LM |", "|---|---|---|---|---|---|---|",
                             *(row for *_, row in sorted(rows))]
        out["seed1-prefix"] = [*INTRINSIC_HEAD, *(_intrinsic_row(r, "references (the passages' rest)")
                                                 for r in s1["intrinsic_prefix"]["rows"])]
    return out


def report(json_path, doc) -> list[str]:
    """Rewrite every generated block of the doc from its JSON; returns the blocks written."""
    from studies.sections import write_study_section

    blocks = report_blocks(json.loads(Path(json_path).read_text()))
    for name, lines in blocks.items():
        write_study_section(doc, [f"<!-- written by benchmarks/tess2_shakespeare.py report from {json_path} -->",
                                  *lines], name=name)
    return list(blocks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("section", choices=["generate", "merge", "plot", "report"])
    ap.add_argument("models", nargs="*", help="generate: run or model directories")
    ap.add_argument("--reference-model", help="generate: held-out AR model (other plays)")
    ap.add_argument("--data", help="generate: eval jsonl (prompt, response)")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=25, help="simplex inference steps")
    ap.add_argument("--ar-temperature", type=float, default=1.0)
    ap.add_argument("--batch-size", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--samples", help="generate: write every generation here (jsonl)")
    ap.add_argument("--runs", nargs="*", help="plot: run directories whose training loss to draw")
    ap.add_argument("--tables", nargs="*", help="plot, merge: outputs of `generate`")
    ap.add_argument("--out")
    ap.add_argument("--json", help="report: the doc's JSON (docs/results/tess2-shakespeare.json)")
    ap.add_argument("--doc", help="report: the doc whose study blocks are rewritten")
    args = ap.parse_args()
    if args.section == "report":
        if not (args.json and args.doc):
            raise SystemExit("tess2_shakespeare.py report: pass --json JSON --doc DOC.md")
        print(f"wrote {', '.join(report(args.json, args.doc))} into {args.doc}")
        return
    if args.section in ("plot", "merge"):
        (plot_section if args.section == "plot" else merge_section)(args)
        return
    t0 = time.perf_counter()
    result = generate_section(args)
    result["wall_s"] = time.perf_counter() - t0
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
