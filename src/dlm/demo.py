"""`dlm demo`: the embedded default, end to end on a laptop. Generates tinymath, trains a short AR run, adapts it into
a masked diffusion model (the adaptation route of both papers), evaluates both on the test split and shows the
masked model's denoising step by step."""

from __future__ import annotations

import json
from pathlib import Path

from dlm.config import load_recipe

COMMON = ["data.level=easy", "data.n_train=20000", "model.preset=small", "model.vocab_size=1024", "model.max_length=96",
          "train.batch_size=32", "train.log_every=20", "train.checkpoint_every=100", "eval.max_new_tokens=48"]
# Stage 1: the AR baseline (causal, next-token loss on response + EOS).
AR_STAGE = ["name=demo-ar", "train.objective=autoregressive", "train.steps=400", "optim.lr=1e-3", "optim.warmup_steps=30"]
# Stage 2: masked diffusion initialised from it: bidirectional attention, label shift kept (PUMBA Eq. 2.1 loss),
# decoded with top-u, u=2 over a 40-position canvas (easy responses are at most ~34 tokens with EOS).
MDM_STAGE = ["name=demo-mdm", "train.objective=mdm", "model.attention=bidirectional", "model.label_shift=true",
             "train.steps=300", "optim.lr=3e-4", "optim.warmup_steps=30", "eval.max_new_tokens=40",
             "eval.policy=top_u", "eval.reveal_count=2"]


def run_demo(out: str | Path = "runs/demo", minutes: float = 8.0) -> dict:
    """Train both stages within about `minutes`, evaluate each on the test split, show a denoising."""
    from dlm.evaluation.tasks import trivial_baseline
    from dlm.sampling import MaskedOptions, generate_text
    from dlm.training.loop import train

    out = Path(out)
    data = [f"data.dir={out / 'data'}"]
    results = {}
    for stage, overrides, share in (("ar", AR_STAGE, 0.5), ("mdm", MDM_STAGE, 0.5)):
        run = out / stage
        init = [f"model.init_from={out / 'ar'}"] if stage == "mdm" else []
        recipe = load_recipe(None, COMMON + data + overrides + init + [f"out_dir={run}", f"train.max_minutes={minutes * share}"])
        title = "AR baseline" if stage == "ar" else "masked diffusion (MDM), initialised from the AR model"
        print(f"\n== dlm demo {stage}: {title} on tinymath {recipe.data.level} ==")
        train(recipe, resume=(run / "checkpoints" / "latest").is_file())
        results[stage] = json.loads((run / "eval.json").read_text())
    test = [json.loads(line) for line in (out / "data" / "test.jsonl").read_text().splitlines()]
    print(f"\n== results on {len(test)} test problems (trivial baseline {100 * trivial_baseline(test):.1f}%) ==")
    for stage, name in (("ar", "AR (KV cache)"), ("mdm", "MDM (top-u, u=2)")):
        r = results[stage]
        print(f"  {name:18s} accuracy {100 * r['eval/accuracy']:5.1f}% | mean NFE {r['eval/mean_nfe']:5.1f} | "
              f"{r['eval/ms_per_problem']:.0f} ms/problem")
    print("\n== the masked model's denoising (colour = confidence when revealed) ==")
    top_u = MaskedOptions(policy="top_u", reveal_count=2)
    for g in generate_text(out / "mdm", [test[0]["prompt"]], top_u, max_new_tokens=40, show_steps=True):
        print(f"assistant ({g['nfe']} NFE):\n{g['response']}\n(expected answer: {test[0]['answer']})")
    print(f"\nmodels:  {out / 'ar' / 'model'}  {out / 'mdm' / 'model'}\nmetrics: {out / 'mdm' / 'metrics.jsonl'}\n"
          f"plots:   {out / 'ar' / 'training_curve.png'}  {out / 'mdm' / 'training_curve.png'}\n"
          f"every test problem: {out / 'mdm' / 'test_samples.jsonl'}\n"
          f"next: dlm eval {out / 'mdm'} {out / 'ar'} --sweep u=1,2,4,8 --max-new-tokens 40 --out {out / 'sweep.json'}")
    return results
