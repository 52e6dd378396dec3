"""`dlm demo`: the embedded default, end to end on a laptop — tinymath, a short training run, evaluation, samples."""

from __future__ import annotations

import json
from pathlib import Path

from dlm.config import load_recipe

# The demo's recipe: the AR baseline on tinymath (the masked-diffusion issue turns this into the masked demo).
DEMO_OVERRIDES = [
    "name=demo-ar",
    "data.level=easy",
    "data.n_train=20000",
    "model.preset=small",
    "model.vocab_size=1024",
    "model.max_length=224",
    "train.objective=autoregressive",
    "train.steps=900",
    "train.batch_size=32",
    "train.log_every=20",
    "train.checkpoint_every=200",
    "optim.lr=1e-3",
    "optim.warmup_steps=50",
    "eval.n=200",
]


def run_demo(out: str | Path = "runs/demo", minutes: float = 8.0) -> dict:
    """Train the demo recipe for at most `minutes`, evaluate on the test split, print a few generations."""
    from dlm.evaluation.tasks import trivial_baseline
    from dlm.sampling import generate_text
    from dlm.training.loop import train

    out = Path(out)
    recipe = load_recipe(None, DEMO_OVERRIDES + [f"out_dir={out}", f"train.max_minutes={minutes}"])
    print(f"dlm demo: training the AR baseline on tinymath ({recipe.data.level}) for up to {minutes:g} minutes")
    run_dir = train(recipe, resume=(out / "checkpoints" / "latest").is_file())
    result = json.loads((run_dir / "eval.json").read_text())
    test = [json.loads(line) for line in (run_dir / "data" / "test.jsonl").read_text().splitlines()]
    print(f"\ntrivial baseline (most common answer): {100 * trivial_baseline(test):.1f}%")
    print("\nsample generations:")
    for r, g in zip(test[:3], generate_text(run_dir / "model", [r["prompt"] for r in test[:3]])):
        print(f"\nuser: {r['prompt']}\nassistant ({g['nfe']} NFE):\n{g['response']}\n(expected answer: {r['answer']})")
    print(f"\nmodel:      {run_dir / 'model'}\nmetrics:    {run_dir / 'metrics.jsonl'}\n"
          f"plot:       {run_dir / 'training_curve.png'}\nresults:    {run_dir / 'eval.json'} "
          f"(every test problem: {run_dir / 'test_samples.jsonl'})")
    return result
