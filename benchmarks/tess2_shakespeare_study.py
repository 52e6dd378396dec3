"""TESS 2 on Shakespeare as a pre-registered study over seeds (issue 17): the 3-seed form of
docs/results/tess2-shakespeare.md's adapted-vs-scratch loss and its intrinsic metrics (TESS 2 §4.2, Table 1).

Models are trained as benchmarks/tess2_tinymath.py's `study` trains them (settings.train: recipe, overrides, seed
rule, init_from; a model with `seed: study` is trained once per seed; --max-minutes stops a training with a checkpoint
that the next call resumes). Two kinds of cell, each a per-item measure so arms pair item by item
(`StudyTable.add_measure`):

  loss     each of settings.eval_n.loss validation passages' held-out simplex loss (mean cross-entropy per generated
           token, the response generated given its prompt), under the same timestep, noise and self-conditioning
           draws for every model: the objective is seeded (123) and keyed by the passage, as
           `tess2_tinymath.py loss` does. Simplex arms only (settings.eval_arms).
  prefix   generations for the first settings.eval_n.prefix prompts (the first 16 words of a passage), with the
           arm's sampler options (settings.arm_settings; `temperature` there is the sampling temperature, default 0):
           simplex arms decode with argmax projection (seed s draws the initial noise), an AR arm samples (seed
           s). The values are each generation's negative log-likelihood per token under the held-out reference AR
           (settings.reference, trained on plays no other model saw); the cell also holds `intrinsic_metrics`
           (perplexity, dist-1..4, unigram entropy, MAUVE on MiniLM features when settings.mauve is true) and four
           example generations.

The report gives each arm's mean ± sd over seeds and the plan's pre-registered paired comparisons (the D_mask
driver's `compare`: the difference a − b averaged over seeds per item, a bootstrap CI over items, a sign-flip p).

    python -m dlm.cli data shakespeare --out runs/shakespeare/data
    OMP_NUM_THREADS=1 python benchmarks/tess2_shakespeare_study.py run \\
        --plan benchmarks/plans/tess2-shakespeare-3seed.yaml --max-minutes 150
    python benchmarks/tess2_shakespeare_study.py report --plan benchmarks/plans/tess2-shakespeare-3seed.yaml \\
        --doc docs/results/tess2-shakespeare-3seed.md
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import torch

import tess2_tinymath as tt
from studies import measures
from studies.measures import comparison_lines, header_lines, mean_sd
from studies.plans import Plan, StudyError, problems_digest
from studies.tables import StudyTable

ROOT = Path(__file__).resolve().parents[1]

KINDS = ("loss", "prefix")
METRICS = ("perplexity", "mauve", "dist_2", "unigram_entropy", "mean_length")


def check_plan(plan: Plan) -> None:
    """tess2_tinymath's checks, plus: every evaluation is loss or prefix, settings.reference names a trained model,
    comparisons are {a, b, eval, expect: lower | higher}."""
    s, where = plan.settings, plan.source
    tt.check_plan(dataclasses.replace(plan, settings={k: v for k, v in s.items() if k != "comparisons"}))
    for key in plan.evals:
        if key not in KINDS:
            raise StudyError(f"{where}: evaluation {key!r}: this driver measures {' and '.join(KINDS)}")
    if s.get("reference") not in s["train"]:
        raise StudyError(f"{where}: settings.reference must name the held-out AR among settings.train")
    for c in s.get("comparisons") or []:
        if not isinstance(c, dict) or c.get("a") not in plan.arms or c.get("b") not in plan.arms \
                or c.get("eval") not in plan.evals or c.get("expect") not in ("lower", "higher"):
            raise StudyError(f"{where}: comparison {c} must be {{a, b, eval, expect: lower | higher}} with planned "
                             "arms and evaluation")


@torch.no_grad()
def passage_losses(model, tok, records: list[dict]) -> list[float]:
    """Held-out simplex loss of each record's response given its prompt (prefix-LM masking), the objective seeded so
    that every model meets the same timesteps, noise and self-conditioning draws per passage."""
    from dlm.data.pipeline import encode_examples
    from dlm.training.objectives.simplex import SimplexObjective

    spec = model.spec
    obj = SimplexObjective(spec.simplex_k, spec.simplex_timesteps, 0.5, "prefix_lm", spec.label_shift, seed=123)
    examples, coll = encode_examples(tok, records, model.config.max_position_embeddings)
    out = []
    for ex in examples:  # one passage per call: its own sum over its own generated tokens
        s, n, _ = obj.loss(model, coll([ex]))
        out.append(float(s) / max(int(n), 1))
    return out


class ShakespeareStudy(tt.Study):
    """tess2_tinymath's Study (training, pins, donors, --max-minutes) with loss and prefix measure cells."""

    def run(self) -> int:
        from dlm.evaluation.intrinsic import intrinsic_metrics
        from dlm.evaluation.tasks import evaluate
        from dlm.sampling import load_for_inference
        from dlm.sampling.options import parse_options

        added = 0
        for arm, seed, key in self.pending():
            spec = dict(self.s["arm_settings"][arm])
            try:
                model_dir = self.model(spec.pop("model"), seed)
                reference = self.model(self.s["reference"], seed) if key == "prefix" else None
            except tt.OutOfTime:
                print("--max-minutes reached while training; the next call resumes it", flush=True)
                break
            records = self.problems(key)
            if records is None:
                continue
            model, tok = load_for_inference(model_dir)
            t0 = time.perf_counter()
            extra: dict = {"model": str(model_dir)}  # its weights are pinned in the table (Study.model)
            if key == "loss":
                if model.spec.family != "simplex":
                    raise StudyError(f"{self.plan.source}: arm {arm} is not a simplex model; list only simplex arms "
                                     "under settings.eval_arms.loss")
                values = passage_losses(model, tok, records)
            else:
                temperature = float(spec.pop("temperature", 0.0))  # an argument of generate, not an option
                options = parse_options(model.spec.family, spec)
                r = evaluate(model, tok, [{**x, "answer": None} for x in records], options,
                             batch_size=self.s.get("batch_size", 16), max_new_tokens=self.s["max_new_tokens"],
                             temperature=temperature, seed=seed, truncate_prompts=True)
                generations = [x["generation"] for x in r["samples"]]
                prompts = [x["prompt"] for x in records]
                ref_model, ref_tok = load_for_inference(reference)
                metrics = intrinsic_metrics(prompts, generations, [x["response"] for x in records], tok, ref_model,
                                            ref_tok, self.s.get("batch_size", 16),
                                            with_mauve=bool(self.s.get("mauve", True)), mauve_features="minilm",
                                            per_sample=True)
                values = metrics.pop("nll_per_token")  # the cell's per-prompt values, paired across arms
                extra.update(metrics={k: v for k, v in metrics.items() if isinstance(v, (int, float))},
                             options=options.model_dump(mode="json", exclude_unset=True), temperature=temperature,
                             mean_nfe=r["mean_nfe"],
                             examples=[{"prompt": p, "generation": g} for p, g in zip(prompts[:4], generations[:4])])
            extra["seconds"] = round(time.perf_counter() - t0, 1)
            cell = self.table.add_measure(arm, seed, key, [round(v, 5) for v in values],
                                          problems=problems_digest(records), **extra)
            added += 1
            shown = f"perplexity {cell['metrics']['perplexity']:.1f}" if key == "prefix" else \
                f"loss {np.mean(values):.3f}"
            print(f"{arm:>10s} seed {seed} {key:>6s}: {shown} (n={cell['n']}, {extra['seconds']:.0f} s)", flush=True)
        return added


def run(plan_path, json_path=None, seeds=None, arms=None, max_minutes=None, train_fn=None) -> int:
    plan = Plan.load(plan_path)
    check_plan(plan)
    data = Path(plan.settings["data_dir"])
    if not (data / "train.jsonl").is_file():  # a fresh runs/: write it as the plan's header does
        from dlm.data.shakespeare import write_shakespeare

        print(f"{data}: no data yet; writing it (`dlm data shakespeare --out {data}`, the default splits)", flush=True)
        write_shakespeare(data)
    table = StudyTable(json_path or ROOT / "docs" / "results" / f"{plan.name}.json", plan)
    deadline = None if max_minutes is None else time.time() + 60 * max_minutes
    # the training side (tess2_tinymath's Study) checks the plan its own way, where comparisons are [a, b] pairs
    trainer_view = dataclasses.replace(plan, settings={k: v for k, v in plan.settings.items() if k != "comparisons"})
    study = ShakespeareStudy(trainer_view, table, deadline, train_fn=train_fn, seeds=seeds, arms=arms)
    added = study.run()
    print(f"{added} cells added; {sum(1 for _ in table.missing())} cells of the plan still missing", flush=True)
    return added


# ---- the report ---------------------------------------------------------------------------------------------------
def report_lines(plan: Plan, table: StudyTable, plan_path: str, json_path: str, doc: Path) -> list[str]:
    lines = header_lines("tess2_shakespeare_study.py", plan, table, plan_path, json_path, doc)
    if "loss" in plan.evals:
        lines += ["Held-out simplex loss per generated token (mean over passages, then mean ± sd over seeds):", "",
                  "| arm | seeds | loss |", "|---|---|---|"]
        for arm in plan.planned_arms("loss"):
            cells = [table.cell(arm, x, "loss") for x in plan.seeds if table.has(arm, x, "loss")]
            lines.append(f"| {arm} | {len(cells)} | {mean_sd([np.mean(c['values']) for c in cells], '.3f')} |")
        lines.append("")
    if "prefix" in plan.evals:
        lines += ["Generations for the prefix prompts, scored by the held-out reference AR (mean ± sd over seeds):",
                  "", "| arm | seeds | " + " | ".join(METRICS) + " |", "|---|---|" + "---|" * len(METRICS)]
        for arm in plan.planned_arms("prefix"):
            cells = [table.cell(arm, x, "prefix") for x in plan.seeds if table.has(arm, x, "prefix")]
            lines.append(f"| {arm} | {len(cells)} | " + " | ".join(
                mean_sd([c["metrics"].get(m) for c in cells], ".3f" if m in ("mauve", "dist_2") else ".2f")
                for m in METRICS) + " |")
        lines.append("")
    lines += comparison_lines(plan, table, "per item")
    return lines


def main(argv=None) -> None:
    measures.main(argv, description=__doc__, driver="tess2_shakespeare_study.py",
                       title="TESS 2 on Shakespeare", check_plan=check_plan, run=run, report_lines=report_lines,
                       runs=False, plot=False)


if __name__ == "__main__":
    main()
