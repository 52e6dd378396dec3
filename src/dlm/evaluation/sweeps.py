"""Score-vs-NFE sweeps: run a sampler over a grid (τ, u) for one or several models; write a JSON table and a PNG of
accuracy against mean NFE with one curve per model (PUMBA Figs. 1, 7)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from dlm.errors import OptionsError
from dlm.evaluation.run import default_max_new_tokens, evaluate_task, load_task, task_baseline, write_samples
from dlm.evaluation.stats import compare, format_comparison
from dlm.modeling.device import placement
from dlm.sampling import ignored, load_for_inference, resolve_options
from dlm.sampling.options import OWNER, option_name, refuse_unused


def parse_sweep(spec: str | None, options=None) -> tuple[str | None, list]:
    """'tau=0.7,0.8' → ('confidence_threshold', [0.7, 0.8]): a grid over one sampling option, named by its field or a
    short name (tau, u; simplex models: steps, eta), each value checked by the option's model together with the
    other `options` (e.g. eta needs a reward_model) before any model is loaded. The swept option counts as given:
    swept without a policy it selects the one that reads it (tau: threshold); with a policy that does not read it, or
    a policy sweep where no swept policy reads a given option, it is refused (`dlm.sampling.options.refuse_unused`)."""
    if not spec:
        return None, [None]
    key, sep, values = spec.partition("=")
    if not sep or not values:
        raise OptionsError(f"--sweep {spec!r}: expected an option and its values, e.g. tau=0.7,0.9, u=1,2,4, "
                           "steps=10,100 or eta=0,0.25")
    try:
        name = option_name(key)
        base = resolve_options(OWNER[name], options, strict=False)
        grid = [getattr(base.replace(**{name: v}), name) for v in values.split(",")]
        given = {k: getattr(base, k) for k in base.model_fields_set}
        refuse_unused({**given, name: grid[0]}, policies=grid if name == "policy" else None)
        return name, grid
    except OptionsError as err:
        raise OptionsError(f"--sweep {spec!r}: {err}") from None


def run_sweep(models: Sequence[str | Path], data: str | Path | None = None, options=None, *, task: str = "tinymath",
              sweep: str | None = None, n: int | None = None, batch_size: int = 50, max_new_tokens: int | None = None,
              seed: int = 0, progress: bool = True, dtype="auto", device="auto", truncate_prompts: bool = False,
              temperature: float = 0.0, samples_per_problem: int = 1, ks: Sequence[int] = (1,),
              samples: str | Path | None = None) -> dict:
    """One row per (model, grid value), each row recording the options it ran with. Every model samples with its
    family's share of `options` (SamplingSettings, one family's SamplingOptions or None: the defaults); a model of
    another family than the swept option's gives a single row. Every model is placed on `device` at `dtype`
    (`load_for_inference`; auto: the GPU in bfloat16 where there is one, else the CPU in float32), recorded in the
    result. `task`: tinymath (default data: the first model's test
    split) or humaneval (pass@k for each k in `ks`). `samples`: every problem's prompt, generation, NFE and grade of
    every row, as jsonl (the returned table is the same with or without it). With one sample per problem each row
    keeps its per-problem outcomes (`correct`, 0/1 in the data's order), and `paired` compares each model with the
    first, problem by problem (`paired_rows`)."""
    name, values = parse_sweep(sweep, options)
    records, source = load_task(task, data, models[0] if models else None, n)
    max_new_tokens = max_new_tokens or default_max_new_tokens(task, models[0])
    rows: list[dict] = []
    lines: list[dict] = []
    outcomes: list[list[bool] | None] = []
    where: dict = {}
    for path in models:
        model, tok = load_for_inference(path, dtype=dtype, device=device)
        where = where or placement(model)
        family = model.spec.family
        base = resolve_options(family, options, strict=False)
        notes = ignored(family, options, model.spec)
        if progress and notes:
            print(f"{Path(path).name} ({family}) ignores {', '.join(notes)}")
        for value in values if name is not None and OWNER.get(name) == family else [None]:
            opts = base if value is None or name is None else base.replace(**{name: value})
            r = evaluate_task(task, model, tok, records, opts, batch_size=batch_size, max_new_tokens=max_new_tokens,
                              seed=seed, progress=progress, truncate_prompts=truncate_prompts, temperature=temperature,
                              samples_per_problem=samples_per_problem, ks=ks)
            setting = opts.in_effect(model.spec)  # only what the sampler read: no tau under top_u
            keys = ("accuracy", *(k for k in r if k.startswith("pass@")), "n", "mean_nfe", "tokens_per_nfe", "wall_s",
                    "ms_per_problem")
            rows.append({"model": str(path), "family": family, **setting, **{k: r[k] for k in keys}})
            graded = all("correct" in x for x in r["samples"])
            correct = [bool(x["correct"]) for x in r["samples"]] if graded else None
            outcomes.append(correct)
            if correct is not None and samples_per_problem == 1:  # per-problem outcomes, for paired comparisons
                rows[-1]["correct"] = [int(c) for c in correct]
            lines += [{"model": str(path), "family": family, "task": task, **setting, **s} for s in r["samples"]]
            if progress:
                shown = ", ".join(f"{k}={v}" for k, v in setting.items() if v is not None)
                passes = "".join(f" | {k} {100 * r[k]:.1f}%" for k in r if k.startswith("pass@"))
                print(f"{Path(path).name} [{shown or 'greedy, KV cache'}]: accuracy {100 * r['accuracy']:.1f}%"
                      f"{passes} | mean NFE {r['mean_nfe']:.1f} | {r['ms_per_problem']:.1f} ms/problem")
    if samples:
        write_samples(samples, lines)
    paired = paired_rows(rows, outcomes, name) if samples_per_problem == 1 else []
    if progress:
        for c in paired:
            print(f"{Path(c['model']).name} {_label(name, c['value'])} vs {Path(c['baseline']).name} "
                  f"{_label(name, c['baseline_value'])}: {format_comparison(c)}")
    return {"task": task, "data": source, "n": len(records), "trivial_baseline": task_baseline(task, records),
            "sweep": sweep, **where, "temperature": temperature, "rows": rows, "paired": paired}


def paired_rows(rows: list[dict], outcomes: list[list[bool] | None], name: str | None) -> list[dict]:
    """Every other model against the first (the baseline), problem by problem: at the same grid value, or against
    each of the baseline's rows where one side has a single row (an AR model, or no sweep). Exact McNemar p and a
    bootstrap CI of the accuracy difference (`dlm.evaluation.stats.compare`), with the discordant counts."""
    if not rows:
        return []
    base = rows[0]["model"]
    mine = [(r, o) for r, o in zip(rows, outcomes) if r["model"] == base]
    out = []
    for r, o in zip(rows, outcomes):
        if r["model"] == base:
            continue
        value = r.get(name) if name else None
        same = [(b, bo) for b, bo in mine if name and value is not None and b.get(name) == value]
        for b, bo in same or mine:
            if o is None or bo is None or len(o) != len(bo):
                continue  # ungraded samples, or several samples per problem (pass@k): not paired here
            c = compare(o, bo)
            out.append({"model": r["model"], "value": value, "baseline": base,
                        "baseline_value": b.get(name) if name else None,
                        **{k: c[k] for k in ("n", "accuracy_a", "accuracy_b", "only_a", "only_b", "p_value",
                                             "difference", "low", "high", "confidence")}})
    return out


def _label(name: str | None, value) -> str:
    return f"[{name}={value}]" if name and value is not None else ""


def plot_sweep(result: dict, out: str | Path, title: str | None = None) -> Path:
    """Accuracy against mean NFE, one curve per model; AR models are single points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for model in dict.fromkeys(r["model"] for r in result["rows"]):
        rows = sorted((r for r in result["rows"] if r["model"] == model), key=lambda r: r["mean_nfe"])
        style = "s" if rows[0]["family"] == "autoregressive" else "o-"
        ax.plot([r["mean_nfe"] for r in rows], [100 * r["accuracy"] for r in rows], style, label=Path(model).name)
        key = (result["sweep"] or "").partition("=")[0]
        name = option_name(key) if key else None
        for r in rows:
            if name and r.get(name) is not None:
                ax.annotate(f"{key}={r[name]}", (r["mean_nfe"], 100 * r["accuracy"]), fontsize=7,
                            xytext=(3, 3), textcoords="offset points")
    if result.get("trivial_baseline") is not None:
        ax.axhline(100 * result["trivial_baseline"], color="grey", ls=":", lw=1, label="trivial baseline")
    ylabel = "pass@1 (%)" if result.get("task") == "humaneval" else "accuracy (%)"
    ax.set(xlabel="mean NFE per problem", ylabel=ylabel, ylim=(0, 100),
           title=title or f"{result['n']} problems")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return Path(out)


def write_sweep(result: dict, out: str | Path) -> tuple[Path, Path]:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return out, plot_sweep(result, out.with_suffix(".png"))
