"""TESS 2 on tinymath: the measurements behind docs/results/tess2-tinymath.md (easy, one seed) and
docs/results/tess2-medium.md (medium, a pre-registered 3-seed study; issue 17).

Sections of the easy study: each merges its result into --json under --key, so the doc's JSON is written by this
script alone (the doc lists the exact commands):

    init       the adaptation's starting point saved before any update (AR weights as a simplex model, or fresh)
    loss       held-out diffusion loss under identical noise, per masking (response, each UL2 strategy)
    steps      accuracy vs inference steps (TESS 2 §5.1), with every problem's outcome
    guidance   reward and accuracy vs η (§4.4), with every problem's outcome
    speed      sampling time, simplex vs AR with a KV cache, same size and output length (App. E)
    intrinsic  perplexity under a held-out model, dist-n, entropy, MAUVE (§4.1; as `dlm eval --metric intrinsic`)
    test-eval  each training run's own end-of-training test evaluation (its eval.json)

The medium study: `study` trains what its plan names (the AR parent, UL2 adaptation, reward model once; SFT once per
seed) and evaluates every missing (arm, seed, eval) cell through a StudyTable, seed-major, until done or --max-minutes;
`report` regenerates the numbers between the doc's `<!-- study:begin -->` / `<!-- study:end -->` markers and the plot.
`--reuse OTHER.json` takes over cells another plan's table already holds for the same training chain, sampler
options, problems and seed (see Donors) instead of training and evaluating them again.

    python benchmarks/tess2_tinymath.py study --plan benchmarks/plans/tess2-medium.yaml \\
        --json docs/results/tess2-medium.json --max-minutes 150
    python benchmarks/tess2_tinymath.py report --plan benchmarks/plans/tess2-medium.yaml \\
        --json docs/results/tess2-medium.json --doc docs/results/tess2-medium.md
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from dlm.data.sources import read_jsonl
from dlm.data.tokenizer import encode_pair
from dlm.errors import DlmError
from dlm.evaluation.reward import score_texts
from dlm.evaluation.tasks import evaluate
from dlm.sampling import SimplexOptions, generate, load_for_inference
from dlm.sampling.guidance import resolve_reward_model
from dlm.sampling.options import parse_options
from studies.plans import Plan, StudyError, fingerprint, problems_digest, subset
from studies.sections import write_study_section
from studies.stats import format_seed_comparison
from studies.tables import StudyTable, donor_tables


# ---- the easy study's sections -------------------------------------------------------------------------------------
def steps_section(model, tok, records, values, args) -> list[dict]:
    rows = []
    for steps in values:
        options = SimplexOptions(inference_steps=int(steps), early_stop_patience=args.early_stop)
        r = evaluate(model, tok, records, options, batch_size=args.batch_size, max_new_tokens=args.gen_length)
        rows.append({"inference_steps": int(steps), "early_stop_patience": args.early_stop,
                     **{k: r[k] for k in ("accuracy", "mean_nfe", "ms_per_problem")},
                     "correct": [int(s["correct"]) for s in r["samples"]]})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "correct"}), flush=True)
    return rows


def guidance_section(model, tok, records, values, args) -> list[dict]:
    rm = resolve_reward_model(args.reward_model)  # the one the sampler guides with (loaded once per process)
    prompts = [r["prompt"] for r in records]
    refs = score_texts(rm, tok, prompts, [x["response"] for x in records], args.batch_size)
    rows = []
    for eta in values:
        options = SimplexOptions(inference_steps=args.steps, reward_model=args.reward_model, guidance_scale=float(eta),
                                 guidance_steps=args.guidance_steps)
        r = evaluate(model, tok, records, options, batch_size=args.batch_size, max_new_tokens=args.gen_length)
        texts = [s["generation"] for s in r["samples"]]
        rewards = score_texts(rm, tok, prompts, texts, args.batch_size)
        rows.append({"eta": float(eta), "inference_steps": args.steps, "accuracy": r["accuracy"],
                     "mean_reward": sum(rewards) / len(rewards), "reference_reward": sum(refs) / len(refs),
                     "ms_per_problem": r["ms_per_problem"], "correct": [int(s["correct"]) for s in r["samples"]],
                     "examples": texts[:3]})
        print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("examples", "correct")}), flush=True)
    return rows


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def speed_section(model, tok, records, values, args) -> dict:
    """Seconds per batch for the AR baseline (KV cache) forced to emit exactly `gen_length` tokens and for the simplex
    sampler over a `gen_length` canvas at each step count; best of `repeats`, same prompts, same process."""
    ar, ar_tok = load_for_inference(args.ar)
    prompts = [encode_pair(tok, r["prompt"], "")[0] for r in records]
    n_params = sum(p.numel() for p in model.parameters())
    n_params_ar = sum(p.numel() for p in ar.parameters())
    G, B = args.gen_length, len(prompts)
    ar_s = _timed(lambda: generate(ar, prompts, max_new_tokens=G, eos_id=-1, pad_id=ar_tok.pad_token_id), args.repeats)
    rows = []
    for steps in values:
        s = _timed(lambda steps=steps: generate(model, prompts, SimplexOptions(inference_steps=int(steps)),
                                                max_new_tokens=G, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id),
                   args.repeats)
        rows.append({"inference_steps": int(steps), "simplex_s": s, "ar_s": ar_s, "ratio": s / ar_s})
        print(json.dumps(rows[-1]), flush=True)
    return {"batch": B, "gen_length": G, "prompt_tokens_mean": sum(map(len, prompts)) / B, "params_simplex": n_params,
            "params_ar": n_params_ar, "threads": torch.get_num_threads(), "rows": rows}


@torch.no_grad()
def loss_section(models, records, args) -> list[dict]:
    """Mean simplex cross-entropy per generated token on `records`, with the same timesteps, noise, spans and
    self-conditioning for every model (fixed-seed objectives), for the response (prefix-LM) and each UL2 strategy."""
    from dlm.data.pipeline import encode_examples
    from dlm.training.objectives.simplex import SimplexObjective

    rows = []
    for path in models:
        model, tok = load_for_inference(path)
        spec = model.spec
        examples, coll = encode_examples(tok, records, model.config.max_position_embeddings)
        batches = [coll(examples[i : i + args.batch_size]) for i in range(0, len(examples), args.batch_size)]
        row = {"model": path}
        for masking, strategy in (("prefix_lm", None), ("ul2", "t5"), ("ul2", "aggressive_t5"), ("ul2", "prefix_lm")):
            obj = SimplexObjective(spec.simplex_k, spec.simplex_timesteps, 0.5, masking, spec.label_shift, seed=123,
                                   ul2_strategy=strategy)
            total = count = 0.0
            for batch in batches:
                s, n, _ = obj.loss(model, batch)
                total, count = total + float(s), count + int(n)
            row["response" if strategy is None else f"ul2_{strategy}"] = total / count
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def intrinsic_section(models, args) -> dict:
    """`dlm eval MODELS --metric intrinsic --reference-model R --steps S --max-new-tokens G`, as a section."""
    from dlm.evaluation.intrinsic import run_intrinsic
    from dlm.sampling.options import parse_settings

    if not args.reference_model:
        raise DlmError("intrinsic: pass --reference-model (a held-out AR model directory)")
    return run_intrinsic(models, args.data, args.reference_model, parse_settings({"inference_steps": args.steps}),
                         n=args.n, batch_size=args.batch_size, max_new_tokens=args.gen_length,
                         with_mauve=not args.no_mauve)


def test_eval_section(runs) -> dict:
    """Each training run's end-of-training test evaluation (run_dir/eval.json), keyed by the run's directory name."""
    out = {}
    for run in map(Path, runs):
        if not (run / "eval.json").is_file():
            raise DlmError(f"{run}: no eval.json (a finished `dlm train` run writes one); pass training run dirs")
        out[run.name] = json.loads((run / "eval.json").read_text())
    return out


def init_section(out: str, overrides: list[str]) -> dict:
    """Save the adaptation recipe's starting point (before any update): the AR weights as a simplex model
    (`model.init_from=AR`) or a fresh one (`model.init_from=null`, `model.tokenizer=AR`), for the loss section."""
    from dlm.config import load_recipe
    from dlm.data.tokenizer import load_tokenizer
    from dlm.modeling.build import save_model
    from dlm.training.loop import build_model

    recipe = load_recipe("recipes/tinymath/tess2-adapt.yaml", overrides)
    tok = load_tokenizer(recipe.model.init_from or recipe.model.tokenizer)
    torch.manual_seed(recipe.train.seed)
    save_model(build_model(recipe, tok), out)
    tok.save_pretrained(out)
    return {"model": out, "recipe": "recipes/tinymath/tess2-adapt.yaml", "set": overrides}


def merge_json(path: str | Path, key: str, value) -> None:
    """Put `value` under `key` in the JSON object at `path` (created if missing), rewritten atomically."""
    path = Path(path)
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


# ---- the easy study's doc: its tables, generated from the JSON the sections wrote --------------------------------
EASY_LABELS = {"untrained-simplex": "untrained (random init)",
               "ar-as-simplex": "AR weights as a simplex model, before adaptation",
               "adapt-ar": "adapted from AR (300 updates)", "adapt-scratch": "trained from scratch (300 updates)",
               "sft-ar": "adapted from AR + SFT", "sft-scratch": "from scratch + SFT",
               "references": "references (data)", "ar-model": "AR baseline"}
EASY_BLOCKS = ("adapt", "steps", "guidance", "speed", "intrinsic")


def _label(model: str) -> str:
    return EASY_LABELS.get(Path(model).name, Path(model).name)


def _paired_lines(rows: list[dict], key: str, base_value) -> list[str]:
    """McNemar + bootstrap CI of every row against the row whose `key` is `base_value` (rows keeping `correct`)."""
    from dlm.evaluation.stats import compare, format_comparison

    base = next((r for r in rows if r[key] == base_value), None)
    if base is None or "correct" not in base:
        return ["(No per-problem outcomes in this JSON, so no paired comparison: it predates the sections that keep "
                "them. Regenerating it with the commands above adds them.)"]
    return [f"- {key} {r[key]:g} vs {base_value:g}: {format_comparison(compare(r['correct'], base['correct']))}"
            for r in rows if r is not base and "correct" in r]


def easy_blocks(data: dict) -> dict[str, list[str]]:
    """The markdown of each generated block of docs/results/tess2-tinymath.md, from its JSON."""
    out: dict[str, list[str]] = {}
    if "test_eval" in data:
        te = data["test_eval"]

        def acc(name):
            r = te.get(name)
            return f"{100 * r['eval/accuracy']:.1f} %" if r else "–"
        n = next((r["eval/n"] for r in te.values() if "eval/n" in r), "–")
        lines = [f"Accuracy on the {n} test problems at the end of each stage (each run's own test evaluation, "
                 "`test_eval`):", "", "| start | after adaptation (UL2) | after + SFT (prefix-LM) |", "|---|---|---|",
                 f"| AR checkpoint | {acc('adapt-ar')} | {acc('sft-ar')} |",
                 f"| random initialisation | {acc('adapt-scratch')} | {acc('sft-scratch')} |"]
        rows = [r for k in ("loss-adapt", "loss-sft") if k in data for r in data[k]["result"]]
        if rows:
            n = data.get("loss-adapt", data.get("loss-sft"))["n"]
            lines += ["", f"Held-out diffusion loss ({n} validation problems; the same timesteps, noise, spans and "
                      "self-conditioning draws for every model), by which positions are generated:", "",
                      "| model | response (prefix-LM on the prompt) | UL2 T5 (~15 %) | UL2 aggressive T5 (~50 %) | "
                      "UL2 prefix-LM (2nd half) |", "|---|---|---|---|---|"]
            lines += [f"| {_label(r['model'])} | " + " | ".join(
                f"{r[k]:.3f}" if r[k] < 1 else f"{r[k]:.2f}" if r[k] >= 5 else f"{r[k]:.3f}"
                for k in ("response", "ul2_t5", "ul2_aggressive_t5", "ul2_prefix_lm")) + " |" for r in rows]
        out["adapt"] = lines
    if "steps-sft-ar" in data:
        sec = data["steps-sft-ar"]
        rows = sec["result"]
        lines = [f"`{sec['model'][0]}`, the first {sec['n']} test problems, argmax projection, no early stop:", "",
                 "| inference steps | " + " | ".join(str(r["inference_steps"]) for r in rows) + " |",
                 "|---|" + "---|" * len(rows),
                 "| accuracy | " + " | ".join(f"{100 * r['accuracy']:.0f} %" for r in rows) + " |",
                 "| ms / problem (batch 50) | " + " | ".join(f"{r['ms_per_problem']:,.0f}" for r in rows) + " |"]
        if "steps-sft-scratch" in data:
            sc = data["steps-sft-scratch"]["result"]
            lines += ["", "From scratch + SFT: " + ", ".join(f"{100 * r['accuracy']:.0f} % at {r['inference_steps']} "
                                                             "steps" for r in sc) + "."]
        lines += ["", "Paired by problem against 10 steps (exact McNemar, bootstrap CI over problems):", ""]
        lines += _paired_lines(rows, "inference_steps", rows[0]["inference_steps"])
        out["steps"] = lines
    if "guidance" in data:
        rows = sorted([r for k in ("guidance", "guidance-large") if k in data for r in data[k]["result"]],
                      key=lambda r: r["eta"])
        sec = data["guidance"]
        lines = [f"`{sec['model'][0]}`, {rows[0]['inference_steps']} steps, the first {sec['n']} test problems; the "
                 f"references' mean reward is {rows[0]['reference_reward']:.2f}:", "",
                 "| η | " + " | ".join(f"{r['eta']:g}" for r in rows) + " |", "|---|" + "---|" * len(rows),
                 "| accuracy | " + " | ".join(f"{100 * r['accuracy']:.0f} %" for r in rows) + " |",
                 "| mean reward of the outputs | " + " | ".join(f"{r['mean_reward']:.3f}" for r in rows) + " |"]
        if "reward" in data.get("test_eval", {}):
            r = data["test_eval"]["reward"]
            ranked = r.get("eval/pairwise_accuracy", r["eval/accuracy"])  # eval/accuracy: runs before the rename
            lines += ["", f"The reward model ranks {100 * ranked:.1f} % of the {r['eval/n']} held-out "
                      "test pairs correctly."]
        lines += ["", "Paired by problem against η = 0:", ""] + _paired_lines(rows, "eta", 0.0)
        out["guidance"] = lines
    if "speed" in data:
        res = data["speed"]["result"]
        rows = res["rows"]
        lines = [f"`{data['speed']['model'][0]}` ({res['params_simplex'] / 1e6:.2f} M parameters) against the AR "
                 f"baseline with a KV cache ({res['params_ar'] / 1e6:.2f} M), {res['batch']} test prompts in one batch "
                 f"(mean {res['prompt_tokens_mean']:.1f} prompt tokens), exactly {res['gen_length']} output positions "
                 f"for both, best of the repeats after a warm-up, {res['threads']} thread, one process:", "",
                 "| simplex inference steps B | " + " | ".join(str(r["inference_steps"]) for r in rows) + " |",
                 "|---|" + "---|" * len(rows),
                 "| simplex s / batch | " + " | ".join(f"{r['simplex_s']:.2f}" for r in rows) + " |",
                 "| AR (KV cache) s / batch | " + " | ".join(f"{r['ar_s']:.2f}" for r in rows) + " |",
                 "| **time ratio simplex / AR** | " + " | ".join(f"**{r['ratio']:.1f}×**" for r in rows) + " |"]
        out["speed"] = lines
    if "intrinsic" in data:
        sec = data["intrinsic"]
        lines = [f"The first {sec['n']} test problems; held-out model `{sec['reference_model']}`:", "",
                 "| generations of | perplexity | dist-1 | dist-2 | dist-3 | dist-4 | unigram entropy | MAUVE | "
                 "accuracy |", "|---|---|---|---|---|---|---|---|---|"]
        for r in sec["rows"]:
            accuracy = f"{100 * r['accuracy']:.0f} %" if "accuracy" in r else "—"
            lines.append(f"| {_label(r['model'])} | " + " | ".join(
                f"{r[k]:.3f}" for k in ("perplexity", "dist_1", "dist_2", "dist_3", "dist_4", "unigram_entropy",
                                        "mauve")) + f" | {accuracy} |")
        out["intrinsic"] = lines
    return out


def report_easy(json_path: str | Path, doc: str | Path) -> list[str]:
    """Rewrite every generated block of the easy doc from its JSON; returns the blocks written."""
    data = json.loads(Path(json_path).read_text())
    blocks = easy_blocks(data)
    for name, lines in blocks.items():
        write_study_section(doc, [f"<!-- written by benchmarks/tess2_tinymath.py report-easy from {json_path} -->",
                                  *lines], name=name)
    return list(blocks)


# ---- the pre-registered study --------------------------------------------------------------------------------------
class Study:
    """A plan's models (trained on first use, fingerprints pinned in the table) and its cells.

    settings: data_dir, runs_dir, n (eval_n {eval: n} for another n in one evaluation), max_new_tokens, batch_size,
    eval_files {eval: jsonl in data_dir},
    train {model: {recipe, set, seed (an integer, or `study` = one model per study seed), init_from, out_dir}},
    eval_arms {eval: [arms]} (an evaluation run on some arms only), arm_settings {arm: {model, sampler options;
    reward_model names a trained model}}, reward_scorer (a trained reward model scoring every simplex cell's outputs),
    guidance_baseline (the η = 0 arm), comparisons [[arm a, arm b], ...]."""

    def __init__(self, plan: Plan, table: StudyTable, deadline: float | None = None, train_fn=None, seeds=None,
                 arms=None, reuse=None):
        self.plan, self.table, self.s, self.deadline = plan, table, plan.settings, deadline
        self.seeds = subset("seeds", seeds, plan.seeds)  # --seeds / --arms: e.g. one driver per core
        self.arms = subset("arms", arms, plan.arms)
        self.train_fn = train_fn or _train
        self.models: dict[tuple[str, int], Path] = {}
        self.weights: dict[Path, str] = {}  # a trained model's fingerprint
        self.records: dict[str, list[dict] | None] = {}
        check_plan(plan)
        self.donors = Donors(plan, table, reuse)
        self.families: dict[str, str] = {}
        backfill_measurements(plan, table)

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.time() > self.deadline

    def model(self, name: str, seed: int) -> Path:
        """The trained model `name` for study seed `seed`, trained now if missing (OutOfTime at --max-minutes)."""
        from dlm.config import load_recipe

        entry = self.s["train"][name]
        per_seed = entry.get("seed") == "study"
        key = (name, seed if per_seed else -1)
        if key in self.models:
            return self.models[key]
        run = Path(entry.get("out_dir") or Path(self.s["runs_dir"]) / name)
        if per_seed:
            run = run.with_name(f"{run.name}-seed{seed}")
        overrides = [*entry.get("set", []), f"out_dir={run}", f"data.dir={self.s['data_dir']}",
                     f"train.seed={seed if per_seed else int(entry.get('seed', 0))}"]
        if entry.get("init_from"):
            overrides.append(f"model.init_from={self.model(entry['init_from'], seed)}")
        recipe = load_recipe(entry["recipe"], overrides)
        if not _complete(run, recipe.train.steps):
            if self.out_of_time():
                raise OutOfTime
            if self.deadline is not None:
                recipe = load_recipe(entry["recipe"], [*overrides, "train.max_minutes="
                                                       f"{max((self.deadline - time.time()) / 60, 0.01):.3f}"])
            print(f"== training {run} ==\n   dlm train {entry['recipe']} " + " ".join(f"--set {o}" for o in overrides),
                  flush=True)
            self.train_fn(recipe, resume=(run / "checkpoints" / "latest").exists())
            if not _complete(run, recipe.train.steps):
                raise OutOfTime  # stopped by --max-minutes: resumes from its checkpoint next time
        model_dir = run / "model"
        pin, weights = (name if not per_seed else f"{name}/seed{seed}"), fingerprint(model_dir)
        old = self.table.pins.get(pin)
        if old is not None and old != weights and not self.used(name, seed if per_seed else None):
            print(f"{pin}: trained again ({weights}; {old} was pinned, but no cell used it), pinned anew", flush=True)
            self.table.unpin(pin)
        self.table.pin(pin, weights)
        self.models[key], self.weights[model_dir] = model_dir, weights
        return model_dir

    def used(self, name: str, seed: int | None) -> bool:
        """Whether a cell (of `seed`, or of any seed) rests on the trained model `name`: its arm's model, reward model
        or the plan's reward scorer is `name` or was trained from it (init_from, transitively)."""
        train = self.s["train"]

        def chain(model: str) -> set[str]:
            out = set()
            while model and model not in out:
                out.add(model)
                model = train.get(model, {}).get("init_from")
            return out

        for c in self.table.cells:
            if seed is not None and c["seed"] != seed:
                continue
            spec = self.s["arm_settings"].get(c["arm"], {})
            roots = [spec.get("model"), spec.get("reward_model"), self.s.get("reward_scorer")]
            if any(name in chain(r) for r in roots if r):
                return True
        return False

    def problems(self, key: str) -> list[dict] | None:
        if key not in self.records:
            path = Path(self.s["data_dir"]) / self.s["eval_files"][key]
            n = (self.s.get("eval_n") or {}).get(key, self.s["n"])  # settings.eval_n: another n for one evaluation
            self.records[key] = read_jsonl(path, required=("prompt", "response"))[:n] if path.is_file() else None
            if self.records[key] is None:
                print(f"{path}: not found; cells of evaluation {key!r} stay missing until it exists", flush=True)
        return self.records[key]

    def pending(self):
        """The missing (arm, seed, evaluation) cells of this run's seeds and arms, seed-major in --seeds' and --arms'
        order, until --max-minutes runs out."""
        missing = set(self.table.missing())
        for arm, seed, key in [(a, s, k) for s in self.seeds for a in self.arms for k in self.plan.evals
                               if (a, s, k) in missing]:
            if self.out_of_time():
                print("--max-minutes reached; the next call resumes here", flush=True)
                return
            yield arm, seed, key

    def run(self) -> int:
        """Evaluate every missing cell of this run's seeds and arms; returns how many were added."""
        added, loaded = 0, {}
        for arm, seed, key in self.pending():
            spec = dict(self.s["arm_settings"][arm])
            records = self.problems(key) if Path(self.s["data_dir"]).is_dir() else None
            donated = self.donors.take(arm, seed, key, problems_digest(records)) if records is not None else None
            if donated is not None:  # another plan ran this very cell: take it over, train nothing
                added += 1
                print(f"{arm:>14s} seed {seed} {key:>7s}: {100 * donated['accuracy']:5.1f} % (n={donated['n']}, "
                      f"from {donated['copied_from']['table']}'s {donated['copied_from']['arm']})", flush=True)
                continue
            try:  # models first: the first training writes the data directory
                model_dir = self.model(spec.pop("model"), seed)
                if "reward_model" in spec:
                    spec["reward_model"] = self.model(spec["reward_model"], seed)
                scorer = self.model(self.s["reward_scorer"], seed) if self.s.get("reward_scorer") else None
            except OutOfTime:
                print("--max-minutes reached while training; the next call resumes it", flush=True)
                break
            records = self.problems(key)
            if records is None:
                continue
            name = self.s["arm_settings"][arm]["model"]
            family = self.families.setdefault(name, model_family(self.s, name))
            options = parse_options(family, {k: str(v) if isinstance(v, Path) else v for k, v in spec.items()})
            problems = problems_digest(records)
            dumped = options.model_dump(mode="json", exclude_unset=True)
            decode = decode_signature(family, dumped, problems, self.s["max_new_tokens"], seed,
                                      self.weights[scorer] if scorer is not None else None)
            extra = {"model": self.weights[model_dir], "decode": decode, "run": str(model_dir), "options": dumped}
            twin = self.table.measured(extra["model"], decode)
            if twin is not None:  # these weights decoded this way already (the greedy AR in another seed)
                cell = self.table.add_copy(arm, seed, key, twin, problems=problems, keep=("mean_reward",), **extra,
                                           copied_from=[twin["arm"], twin["seed"], twin["eval"]])
                added += 1
                print(f"{arm:>14s} seed {seed} {key:>7s}: {100 * cell['accuracy']:5.1f} % (n={cell['n']}, the same "
                      f"measurement as {twin['arm']} seed {twin['seed']})", flush=True)
                continue
            if model_dir not in loaded:
                loaded = {model_dir: load_for_inference(model_dir)}  # one model in memory at a time
            model, tok = loaded[model_dir]
            r = evaluate(model, tok, records, options, batch_size=self.s.get("batch_size", 50),
                         max_new_tokens=self.s["max_new_tokens"], seed=seed)
            if scorer is not None and model.spec.family == "simplex":
                rewards = score_texts(resolve_reward_model(scorer), tok, [x["prompt"] for x in records],
                                      [s["generation"] for s in r["samples"]], self.s.get("batch_size", 50))
                extra["mean_reward"] = sum(rewards) / len(rewards)
            cell = self.table.add(arm, seed, key, r, problems=problems, **extra)
            added += 1
            print(f"{arm:>14s} seed {seed} {key:>7s}: {100 * cell['accuracy']:5.1f} % (n={cell['n']}, "
                  f"NFE {cell['mean_nfe']:.1f})", flush=True)
        return added


class Donors:
    """Other plans' study tables (--reuse) whose cells stand for this plan's. A donor arm stands for one of ours when
    its model is the same training chain (stage by stage: recipe, overrides, seed rule, fixed run directory; the names
    may differ), its sampler options are ours, and both plans evaluate alike (data directory, n, token limit, batch
    size, the evaluation's file). The cell itself must have been scored on our problems in the same seed. A witness
    guards against drift of recipe files or code since the donor ran: for some seed both tables pinned the chain's
    last model, and to the same weights (the chain was trained twice here and came out bitwise equal). A cell taken
    over pins the donor's weights for each stage, so a later local training must match them, and is marked
    copied_from."""

    EVAL_SETTINGS = ("data_dir", "n", "max_new_tokens", "batch_size")

    def __init__(self, plan: Plan, table: StudyTable, paths):
        self.plan, self.table, self.tables = plan, table, donor_tables(plan, paths)
        self._arms: dict[str, list] = {}

    @staticmethod
    def chain(settings: dict, name: str) -> list[tuple[str, dict]]:
        """The model `name` and its ancestors (init_from), last stage first, as (name, what trains it)."""
        out, train = [], settings["train"]
        while name:
            entry = train[name]
            out.append((name, {"recipe": entry["recipe"], "set": list(entry.get("set", [])),
                               "seed": entry.get("seed", 0), "out_dir": entry.get("out_dir")}))
            name = entry.get("init_from")
        return out

    @staticmethod
    def _pin(name: str, entry: dict, seed: int) -> str:
        return f"{name}/seed{seed}" if entry["seed"] == "study" else name

    def _donor_arms(self, arm: str) -> list:
        """(donor plan, donor table, donor arm, stage names paired with ours) that stand for `arm`."""
        if arm not in self._arms:
            found, s = [], self.plan.settings
            spec = dict(s["arm_settings"][arm])
            mine = self.chain(s, spec.pop("model"))
            for donor, dtable in self.tables:
                d_s = donor.settings
                if any(d_s.get(k) != s.get(k) for k in self.EVAL_SETTINGS) or "reward_model" in spec \
                        or s.get("reward_scorer") or d_s.get("reward_scorer"):
                    continue
                for d, dspec in d_s.get("arm_settings", {}).items():
                    dspec = dict(dspec)
                    theirs = self.chain(d_s, dspec.pop("model"))
                    if dspec != spec or [e for _, e in theirs] != [e for _, e in mine]:
                        continue
                    stages = [(n, dn, e) for (n, e), (dn, _) in zip(mine, theirs)]
                    n, dn, e = stages[0]
                    witness = [x for x in self.plan.seeds if x in donor.seeds
                               and self.table.pins.get(self._pin(n, e, x)) is not None
                               and self.table.pins.get(self._pin(n, e, x)) == dtable.pins.get(self._pin(dn, e, x))]
                    if witness:
                        found.append((donor, dtable, d, stages))
            self._arms[arm] = found
        return self._arms[arm]

    def take(self, arm: str, seed: int, key: str, problems: str) -> dict | None:
        """Take the donor cell for (arm, seed, key) over into our table, pinning its models; None if there is none."""
        for donor, dtable, d, stages in self._donor_arms(arm):
            if donor.settings["eval_files"].get(key) != self.plan.settings["eval_files"][key]:
                continue
            c = dtable.cell(d, seed, key)
            pins = [(self._pin(n, e, seed), dtable.pins.get(self._pin(dn, e, seed))) for n, dn, e in stages]
            if c is None or c["problems"] != problems or any(v is None for _, v in pins):
                continue
            for name, value in pins:
                self.table.pin(name, value)  # refuses if we trained that stage to other weights
            return self.table.add_copy(arm, seed, key, c, problems=problems,
                                       keep=("model", "decode", "run", "options"),
                                       copied_from={"table": donor.name, "arm": d, "seed": seed, "eval": key})
        return None


def decode_signature(family: str, options: dict, problems: str, max_new_tokens: int, seed: int,
                     scorer: str | None = None) -> str:
    """What decoding turned a cell's weights into its outcomes. The sampling seed belongs to it wherever decoding
    draws noise (simplex: its starting logits; masked: conservatively); the AR arm decodes greedily (evaluate's
    temperature 0), so its cells in every seed are one measurement. `scorer` is the reward scorer's fingerprint where
    a simplex cell's mean reward comes from it."""
    parts = [family, json.dumps(options, sort_keys=True), f"problems={problems}", f"max={max_new_tokens}"]
    if family != "autoregressive":
        parts.append(f"seed={seed}")
    if scorer and family == "simplex":
        parts.append(f"scorer={scorer}")
    return "/".join(parts)


def model_family(settings: dict, name: str) -> str:
    """The family the plan's model `name` trains (from its recipe's objective; nothing is loaded)."""
    from dlm.config import FAMILIES, load_recipe

    entry = settings["train"][name]
    return FAMILIES[load_recipe(entry["recipe"], list(entry.get("set", []))).train.objective]


def backfill_measurements(plan: Plan, table: StudyTable) -> int:
    """Give accuracy cells written before the driver recorded them their weights fingerprint (`model`, from the
    table's pins) and decode signature, the path moving to `run`; then check that cells with one (weights, decoding)
    agree problem by problem. Measure cells (the Shakespeare study's, which decodes its AR at temperature 1) are left
    as they are. Returns how many cells changed."""
    s, families = plan.settings, {}

    def pin(name: str, seed: int) -> str | None:
        return table.pins.get(f"{name}/seed{seed}" if s["train"][name].get("seed") == "study" else name)

    def fields(cell: dict) -> dict | None:
        if "decode" in cell or "options" not in cell or "correct" not in cell:
            return None  # decoded already; its decoding unknown (no options); or a measure cell (a subclass's)
        name = s["arm_settings"][cell["arm"]]["model"]
        weights = pin(name, cell["seed"])
        if weights is None:
            return None
        family = families.setdefault(name, model_family(s, name))
        scorer = pin(s["reward_scorer"], cell["seed"]) if s.get("reward_scorer") else None
        return {"model": weights, "run": cell.get("model"),
                "decode": decode_signature(family, cell["options"], cell["problems"], s["max_new_tokens"],
                                           cell["seed"], scorer)}

    changed = table.annotate(fields)
    groups: dict = {}
    for c in table.cells:
        if c.get("decode") and "correct" in c:
            groups.setdefault((c["model"], c["decode"]), []).append(c)
    for cells in groups.values():
        if any(c["correct"] != cells[0]["correct"] for c in cells):
            raise StudyError(f"{table.path}: cells {[(c['arm'], c['seed']) for c in cells]} decode the same weights "
                             "the same way but their outcomes differ: the decoding depends on something the "
                             "signature leaves out")
    return changed


class OutOfTime(Exception):
    """--max-minutes ran out before a model the next cell needs was trained."""


def _train(recipe, resume: bool) -> None:
    from dlm.training.loop import train

    train(recipe, resume=resume, progress=False)


def _complete(run: Path, steps: int) -> bool:
    """A run that saved its model after all `steps` updates (not one stopped early by its time limit)."""
    metrics = run / "metrics.jsonl"
    if not ((run / "model" / "config.json").is_file() and metrics.is_file()):
        return False
    lines = metrics.read_text().splitlines()
    return bool(lines) and json.loads(lines[-1])["step"] >= steps


def check_plan(plan: Plan) -> None:
    """Every setting the study reads is there and every name resolves; one line naming the field otherwise."""
    s, src = plan.settings, plan.source
    for name in ("data_dir", "runs_dir", "n", "max_new_tokens", "eval_files", "train", "arm_settings"):
        if name not in s:
            raise StudyError(f"{src}: settings.{name} is missing")
    models = s["train"]
    for name, entry in models.items():
        if not isinstance(entry, dict) or "recipe" not in entry:
            raise StudyError(f"{src}: settings.train.{name} needs a recipe (and optional set, seed, init_from)")
        if entry.get("init_from") and entry["init_from"] not in models:
            raise StudyError(f"{src}: settings.train.{name}.init_from {entry['init_from']!r} is not a model of "
                             f"settings.train ({', '.join(models)})")
    for key in plan.evals:
        if key not in s["eval_files"]:
            raise StudyError(f"{src}: settings.eval_files has no file for evaluation {key!r}")
    for arm in plan.arms:
        spec = s["arm_settings"].get(arm)
        if not isinstance(spec, dict) or spec.get("model") not in models:
            raise StudyError(f"{src}: settings.arm_settings.{arm} must name a model of settings.train "
                             f"({', '.join(models)}) and its sampler options")
        if spec.get("reward_model", next(iter(models))) not in models:
            raise StudyError(f"{src}: settings.arm_settings.{arm}.reward_model must name a model of settings.train")
    for key, arms in s.get("eval_arms", {}).items():
        if key not in plan.evals or not isinstance(arms, list) or not set(arms) <= set(plan.arms):
            raise StudyError(f"{src}: settings.eval_arms.{key} must map an evaluation of the plan to a list of its "
                             f"arms, got {arms!r}")
    for pair in s.get("comparisons", []):
        if not (isinstance(pair, list) and len(pair) == 2 and all(a in plan.arms for a in pair)):
            raise StudyError(f"{src}: settings.comparisons entry {pair!r} must be [arm, arm] of the plan's arms")
    if s.get("reward_scorer") and s["reward_scorer"] not in models:
        raise StudyError(f"{src}: settings.reward_scorer must name a model of settings.train")


# ---- the report -----------------------------------------------------------------------------------------------------
def _pct(summary: dict, seeds: list[int] | None = None) -> str:
    """mean ± sd (per seed); `seeds` (those with a cell) names the seeds whose cells repeat an earlier measurement."""
    if summary["mean"] is None:
        return "not run"
    sd = f" ± {100 * summary['sd']:.1f}" if summary["sd"] is not None else ""
    repeats = [s for s in seeds or [] if s not in summary["seeds"]]
    again = f"; seed{'s' * (len(repeats) > 1)} {', '.join(map(str, repeats))} repeat this measurement: the same " \
        "weights decoded greedily" if repeats else ""
    return f"{100 * summary['mean']:.1f}{sd} % ({' / '.join(f'{100 * a:.1f}' for a in summary['per_seed'])}{again})"


def _setting(spec: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in spec.items() if k != "model") or "defaults"


def report_lines(plan: Plan, table: StudyTable, command: str) -> list[str]:
    """The numbers part of the study's doc: per evaluation, accuracy mean ± sd over seeds of every arm, then the
    plan's paired comparisons (and the best η against η = 0, marked as chosen after the fact)."""
    s = plan.settings
    done = len(table.cells)
    total = sum(len(plan.planned_arms(key)) for key in plan.evals) * len(plan.seeds)
    lines = [f"Plan `{plan.source}` (`{plan.name}`, digest `{plan.digest}`): {done} of {total} planned cells "
             f"(arms × seeds {list(plan.seeds)} × evaluations {list(plan.evals)}); first {s['n']} problems of each "
             "evaluation file. Accuracy is mean ± sd over seeds (per seed in brackets). Regenerate with:", "",
             f"    {command}", ""]
    if table.pins:
        lines += ["Pinned weights (sha256 of the weight files, first 16 hex digits): "
                  + ", ".join(f"{k} `{v}`" for k, v in table.pins.items()), ""]
    for key in plan.evals:
        lines += [f"### {key}", "", "| arm | model | setting | accuracy | mean NFE | ms / problem | mean reward |",
                  "|---|---|---|---|---|---|---|"]
        for arm in plan.planned_arms(key):
            spec, summ = s["arm_settings"][arm], table.summary(arm, key)
            cells = [c for c in table.cells if c["arm"] == arm and c["eval"] == key]
            ms = f"{sum(c.get('ms_per_problem', 0) for c in cells) / len(cells):.0f}" if cells else "—"
            rewards = [c["mean_reward"] for c in cells if "mean_reward" in c]
            nfe = f"{summ['mean_nfe']:.1f}" if cells else "—"
            lines.append(f"| {arm} | {spec['model']} | {_setting(spec)} | {_pct(summ, [c['seed'] for c in cells])} "
                         f"| {nfe} | {ms} | "
                         f"{f'{sum(rewards) / len(rewards):.3f}' if rewards else '—'} |")
        lines += ["", "Paired comparisons (pre-registered; CI over problems of the seed-averaged difference):", ""]
        for a, b in s.get("comparisons", []):
            if {a, b} <= set(plan.planned_arms(key)):
                lines.append(f"- {a} vs {b}: {_compare(table, a, b, key)}")
        best = _best_guided(plan, table, key)
        if best:
            lines.append(f"- best η ({best[0]}) vs η = 0 ({best[1]}), **chosen after the fact** (the best of "
                         f"{best[2]} η values, so its p-value is optimistic): {_compare(table, best[0], best[1], key)}")
        lines.append("")
    return lines


def _compare(table: StudyTable, a: str, b: str, key: str) -> str:
    try:
        line = format_seed_comparison(table.compare(a, b, key))
    except StudyError:
        return "not run yet (no seed has both)"
    nfe_a, nfe_b = table.summary(a, key)["mean_nfe"], table.summary(b, key)["mean_nfe"]
    return f"{line}; mean NFE {nfe_a:.1f} vs {nfe_b:.1f}"


def _best_guided(plan: Plan, table: StudyTable, key: str):
    """(best guided arm by mean accuracy, its η = 0 arm, how many guided arms) or None."""
    s = plan.settings
    base = s.get("guidance_baseline")
    guided = [a for a in plan.planned_arms(key) if "guidance_scale" in s["arm_settings"][a]]
    scored = [(table.summary(a, key)["mean"], a) for a in guided if table.summary(a, key)["mean"] is not None]
    if not (base and scored and table.summary(base, key)["mean"] is not None):
        return None
    return max(scored)[1], base, len(guided)


def plot_study(plan: Plan, table: StudyTable, path: str | Path) -> None:
    """Accuracy vs inference steps (argmax arms) and accuracy and reward vs η, mean ± sd over seeds, per evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = plan.settings
    steps_arms = [a for a in plan.arms if set(s["arm_settings"][a]) == {"model", "inference_steps"}]
    if len({s["arm_settings"][a]["inference_steps"] for a in steps_arms}) < len(steps_arms):
        return plot_arms(plan, table, path)  # arms that differ in their model, not in their steps
    guided = [a for a in plan.arms if "guidance_scale" in s["arm_settings"][a]]
    base = s.get("guidance_baseline")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for key in plan.evals:
        for ax, arms, x_of in ((ax1, steps_arms, lambda a: s["arm_settings"][a]["inference_steps"]),
                               (ax2, ([base] if base else []) + guided,
                                lambda a: s["arm_settings"][a].get("guidance_scale", 0.0))):
            pts = [(x_of(a), table.summary(a, key)) for a in arms]
            pts = sorted((x, m) for x, m in pts if m["mean"] is not None)
            if pts:
                ax.errorbar([x for x, _ in pts], [100 * m["mean"] for _, m in pts],
                            yerr=[100 * (m["sd"] or 0) for _, m in pts], marker="o", capsize=3, label=key)
        for a in [a for a in plan.arms if set(s["arm_settings"][a]) == {"model"}]:  # e.g. the AR parent: a line
            m = table.summary(a, key)["mean"]
            if m is not None:
                for ax in (ax1, ax2):
                    ax.axhline(100 * m, ls="--", lw=1, color="gray")
                    ax.annotate(f"{a} ({key})", (0.01, 100 * m), xycoords=("axes fraction", "data"), fontsize=7)
    ax1.set(xscale="log", xlabel="inference steps (argmax projection)", ylabel="accuracy (%)",
            title="accuracy vs inference steps")
    ax2.set_xscale("symlog", linthresh=0.1)
    steps = sorted({s["arm_settings"][a].get("inference_steps") for a in guided} - {None})
    ax2.set(xlabel=f"guidance scale η (0 = no guidance; steps {', '.join(map(str, steps))})", ylabel="accuracy (%)",
            title="reward guidance")
    for ax in (ax1, ax2):
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    fig.suptitle(f"{plan.name}: mean ± sd over seeds {list(plan.seeds)}, n = {s['n']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_arms(plan: Plan, table: StudyTable, path: str | Path) -> None:
    """One bar per arm (mean over seeds, sd as error bar, each seed a dot), one group per evaluation: for plans whose
    arms are different models sampled the same way (e.g. the ablations)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(plan.arms) * len(plan.evals)), 4))
    width = 0.8 / len(plan.evals)
    for j, key in enumerate(plan.evals):
        arms = plan.planned_arms(key)
        xs = [plan.arms.index(a) + (j - (len(plan.evals) - 1) / 2) * width for a in arms]
        summ = [table.summary(a, key) for a in arms]
        ax.bar(xs, [100 * (m["mean"] or 0) for m in summ], width, yerr=[100 * (m["sd"] or 0) for m in summ],
               capsize=3, alpha=0.7, label=key)
        for x, m in zip(xs, summ):
            ax.plot([x] * len(m["per_seed"]), [100 * v for v in m["per_seed"]], "k.", ms=4)
    ax.set_xticks(range(len(plan.arms)), plan.arms, rotation=20)
    ax.set(ylabel="accuracy (%)", title=f"{plan.name}: mean ± sd over seeds {list(plan.seeds)} (dots: seeds)\n"
           f"n = {plan.settings['n']} problems")
    ax.set_ylim(bottom=0)
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- command line ---------------------------------------------------------------------------------------------------
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("section", choices=["init", "loss", "steps", "guidance", "speed", "intrinsic", "test-eval",
                                        "study", "report", "report-easy"])
    ap.add_argument("model", nargs="*", help="simplex model (run or model dir); several for loss, intrinsic, "
                    "test-eval (training run dirs)")
    ap.add_argument("--data")
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--values", help="comma-separated grid: steps or η")
    ap.add_argument("--gen-length", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=50)
    ap.add_argument("--steps", type=int, default=25, help="guidance, intrinsic: inference steps")
    ap.add_argument("--early-stop", type=int, default=None, help="steps: early-stop patience")
    ap.add_argument("--reward-model")
    ap.add_argument("--guidance-steps", type=int, default=1)
    ap.add_argument("--ar", help="speed: AR baseline of the same size")
    ap.add_argument("--reference-model", help="intrinsic: held-out AR model")
    ap.add_argument("--no-mauve", action="store_true", help="intrinsic: skip MAUVE")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], help="init: recipe override (repeatable), a.b=c")
    ap.add_argument("--json", help="the results JSON: sections merge into it under --key; study/report: the table")
    ap.add_argument("--key", help="the section's key in --json (default: the section name)")
    ap.add_argument("--out", help="also write the section's result alone to this file (as tess2-shakespeare.md does)")
    ap.add_argument("--plan", help="study, report: the pre-registered plan (YAML)")
    ap.add_argument("--max-minutes", type=float, help="study: stop (resumably) after this wall time")
    ap.add_argument("--seeds", help="study: comma-separated subset of the plan's seeds, run in this order (a limit or "
                    "an order only, e.g. one driver per core; the table always holds the plan's seeds)")
    ap.add_argument("--arms", help="study: comma-separated subset of the plan's arms, run in this order within each "
                    "seed (a limit or an order only, like --seeds)")
    ap.add_argument("--reuse", help="study: comma-separated study tables of other plans; a missing cell one of them "
                    "ran (the same training chain, sampler options, problems and seed, with a seed whose weights both "
                    "tables pinned equal) is taken over instead of trained and evaluated again, marked copied_from")
    ap.add_argument("--doc", help="report: the results doc whose study markers are rewritten")
    ap.add_argument("--plot", help="report: the plot (default: the doc's name with .png)")
    args = ap.parse_args(argv)
    try:
        run_section(args)
    except DlmError as e:
        raise SystemExit(f"tess2_tinymath.py {args.section}: {e}") from None


def run_section(args) -> None:
    if args.section == "report-easy":
        if not (args.json and args.doc):
            raise DlmError("report-easy: pass --json docs/results/tess2-tinymath.json "
                           "--doc docs/results/tess2-tinymath.md")
        print(f"wrote {', '.join(report_easy(args.json, args.doc))} into {args.doc}")
        return
    if args.section in ("study", "report"):
        if not (args.plan and args.json):
            raise DlmError("pass --plan PLAN.yaml and --json TABLE.json")
        plan = Plan.load(args.plan)
        table = StudyTable(args.json, plan)
        if args.section == "study":
            deadline = time.time() + 60 * args.max_minutes if args.max_minutes else None
            seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else None
            arms = args.arms.split(",") if args.arms else None
            reuse = args.reuse.split(",") if args.reuse else None
            added = Study(plan, table, deadline, seeds=seeds, arms=arms, reuse=reuse).run()
            left = sum(1 for _ in table.missing())
            print(f"{added} cells added; {left} planned cells missing", flush=True)
            return
        check_plan(plan)
        backfill_measurements(plan, table)
        if not args.doc:
            raise DlmError("report: pass --doc DOC.md (with study markers)")
        plot = Path(args.plot) if args.plot else Path(args.doc).with_suffix(".png")
        command = (f"python benchmarks/tess2_tinymath.py report --plan {args.plan} --json {args.json} "
                   f"--doc {args.doc}" + (f" --plot {args.plot}" if args.plot else ""))
        lines = report_lines(plan, table, command)
        if table.cells:
            plot_study(plan, table, plot)
            lines.append(f"![accuracy vs steps and η]({plot.name})")
        write_study_section(args.doc, lines)
        print(f"wrote {args.doc}" + (f" and {plot}" if table.cells else " (no cells yet: no plot)"))
        return
    if args.section == "test-eval":
        out = test_eval_section(args.model)
    elif args.section == "init":
        if len(args.model) != 1:
            raise DlmError("init: pass one output directory")
        out = init_section(args.model[0], args.set)
    else:
        if not args.data or not args.model:
            raise DlmError(f"{args.section}: pass the model(s) and --data")
        records = read_jsonl(args.data, required=("prompt", "response"))[: args.n]
        values = [float(v) for v in args.values.split(",")] if args.values else []
        if args.section in ("steps", "guidance", "speed") and not values:
            raise DlmError(f"{args.section}: pass --values (the grid)")
        t0 = time.perf_counter()
        if args.section == "loss":
            out = loss_section(args.model, records, args)
        elif args.section == "intrinsic":
            out = intrinsic_section(args.model, args)
        else:
            model, tok = load_for_inference(args.model[0])
            section = {"steps": steps_section, "guidance": guidance_section, "speed": speed_section}[args.section]
            out = section(model, tok, records, values, args)
        if args.section != "intrinsic":
            out = {"section": args.section, "model": args.model, "data": args.data, "n": len(records), "result": out,
                   "wall_s": time.perf_counter() - t0}
    if args.json:
        merge_json(args.json, args.key or args.section, out)
        print(f"{args.json}: wrote {args.key or args.section}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
