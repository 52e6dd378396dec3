"""`dlm demo`: the embedded default, end to end on a laptop. Generates tinymath, trains a short AR run, adapts it into
a masked diffusion model (the adaptation route of both papers), evaluates both on the test split and shows the
masked model's denoising step by step."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from dlm.config import load_recipe

COMMON = ["data.level=easy", "data.n_train=20000", "model.preset=small", "model.vocab_size=1024", "model.max_length=96",
          "train.batch_size=32", "train.log_every=20", "train.checkpoint_every=100", "eval.max_new_tokens=48"]
# Stage 1: the AR baseline (causal, next-token loss on response + EOS).
AR_STAGE = ["name=demo-ar", "train.objective=autoregressive", "train.steps=400", "optim.lr=1e-3",
            "optim.warmup_steps=30"]
# Stage 2: masked diffusion initialised from it: bidirectional attention, label shift kept (PUMBA Eq. 2.1 loss),
# 800 updates (at 300 it stayed near 88 %), decoded over a 40-position canvas (easy responses are at most ~34 tokens
# with EOS) with Fast-dLLM's threshold rule, tau = 0.9: every masked position the model is >= 90 % sure of is revealed
# in the same pass. Top-u (u = 2) reveals a fixed number per step and often copies one number into two slots: after
# 800 updates it scores 89-92 % (two seeds) against 96.4 % for the threshold rule, which needs ~1.4 NFE instead of ~19.
MDM_STAGE = ["name=demo-mdm", "train.objective=mdm", "model.attention=bidirectional", "model.label_shift=true",
             "train.steps=800", "optim.lr=3e-4", "optim.warmup_steps=30", "eval.max_new_tokens=40",
             "eval.policy=threshold", "eval.confidence_threshold=0.9"]
# Wall-clock caps (train.max_minutes) are shared in proportion to the updates (400 : 800, per-update cost is alike),
# so on 2 idle cores (~0.35-0.4 s per update) neither stage is cut short; on a loaded machine they are.
STAGE_SHARES = {"ar": 1 / 3, "mdm": 2 / 3}


def run_demo(out: str | Path = "runs/demo", minutes: float = 9.0, device="auto", dtype="auto") -> dict:
    """Train both stages within about `minutes`, evaluate each on the test split, show a denoising; all on `device`
    at `dtype` (`dlm.modeling.device`; training is placed by accelerate, kept off a present GPU for the CPU, and in
    bf16 mixed precision for bfloat16)."""
    from dlm.evaluation.tasks import trivial_baseline
    from dlm.modeling.device import resolve_device, resolve_dtype
    from dlm.sampling import MaskedOptions, generate_text
    from dlm.training.loop import train

    out, dev = Path(out), resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if dev.type == "cpu" and torch.cuda.is_available():
        os.environ["ACCELERATE_USE_CPU"] = "true"  # accelerate would take the GPU that is there
    elif dev.type == "cuda" and dev.index:
        torch.cuda.set_device(dev)
    precision = ["train.precision=bf16"] if dt == torch.bfloat16 else []
    data = [f"data.dir={out / 'data'}"]
    results = {}
    for stage, overrides in (("ar", AR_STAGE), ("mdm", MDM_STAGE)):
        run = out / stage
        init = [f"model.init_from={out / 'ar'}"] if stage == "mdm" else []
        run_opts = [f"out_dir={run}", f"train.max_minutes={minutes * STAGE_SHARES[stage]}"]
        recipe = load_recipe(None, COMMON + data + overrides + init + run_opts + precision)
        title = "AR baseline" if stage == "ar" else "masked diffusion (MDM), initialised from the AR model"
        print(f"\n== dlm demo {stage}: {title} on tinymath {recipe.data.level} ==")
        train(recipe, resume=(run / "checkpoints" / "latest").is_file())
        results[stage] = json.loads((run / "eval.json").read_text())
        last = (run / "metrics.jsonl").read_text().splitlines()[-1]
        results[stage]["updates"] = (json.loads(last)["step"], recipe.train.steps)
    test = [json.loads(line) for line in (out / "data" / "test.jsonl").read_text().splitlines()]
    print(f"\n== results on {len(test)} test problems (trivial baseline {100 * trivial_baseline(test):.1f}%) ==")
    for stage, name in (("ar", "AR (KV cache)"), ("mdm", "MDM (threshold, τ=0.9)")):
        r = results[stage]
        done, planned = r["updates"]
        print(f"  {name:22s} accuracy {100 * r['eval/accuracy']:5.1f}% | mean NFE {r['eval/mean_nfe']:5.1f} | "
              f"{r['eval/ms_per_problem']:.0f} ms/problem | {done}/{planned} updates"
              f"{' (stopped by the wall-clock cap; raise --minutes)' if done < planned else ''}")
    print("\n== the masked model's denoising, top-u u=2 to show every step (colour = confidence when revealed) ==")
    top_u = MaskedOptions(policy="top_u", reveal_count=2)
    for g in generate_text(out / "mdm", [test[0]["prompt"]], top_u, max_new_tokens=40, show_steps=True, device=dev,
                           dtype=dt):
        print(f"assistant ({g['nfe']} NFE):\n{g['response']}\n(expected answer: {test[0]['answer']})")
    print(f"\nmodels:  {out / 'ar' / 'model'}  {out / 'mdm' / 'model'}\nmetrics: {out / 'mdm' / 'metrics.jsonl'}\n"
          f"plots:   {out / 'ar' / 'training_curve.png'}  {out / 'mdm' / 'training_curve.png'}\n"
          f"every test problem: {out / 'mdm' / 'test_samples.jsonl'}\n"
          f"next: dlm eval {out / 'mdm'} {out / 'ar'} --sweep u=1,2,4,8 --max-new-tokens 40 --out {out / 'sweep.json'}")
    return results
