"""Learning test: a simplex diffusion model trained for a few dozen updates on tinymath (easy) from a fixed seed beats
its untrained self — lower held-out diffusion loss under identical noise, and sampled responses (reverse process,
argmax projection) that match the reference programs token by token far more often."""

import pytest
import torch

from dlm.config import load_recipe
from dlm.data.tokenizer import encode_pair
from dlm.sampling import SimplexOptions, generate
from dlm.training.loop import Trainer
from dlm.training.objectives.simplex import SimplexObjective

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

STEPS = 100


def heldout_loss(trainer, batches) -> float:
    """Mean simplex loss over fixed validation batches with a fixed-seed objective (same t, ε, self-conditioning)."""
    obj = SimplexObjective(5.0, 5000, 0.5, "prefix_lm", True, seed=123)
    model = trainer.unwrapped.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            s, n, _ = obj.loss(model, batch)
            total, count = total + float(s), count + int(n)
    return total / count


def token_accuracy(trainer, records) -> float:
    """Share of reference response tokens (and the EOS) reproduced at their position by the sampler (20 steps)."""
    tok, model = trainer.tok, trainer.unwrapped.eval()
    prompts = [encode_pair(tok, r["prompt"], "")[0] for r in records]
    refs = [encode_pair(tok, "", r["response"])[1] + [tok.eos_token_id] for r in records]
    out = generate(model, prompts, SimplexOptions(inference_steps=20), max_new_tokens=40, eos_id=tok.eos_token_id,
                   pad_id=tok.pad_token_id, generator=torch.Generator().manual_seed(0))
    hits = total = 0
    for got, ref in zip(out.tokens, refs):
        got = got + [tok.eos_token_id]
        hits += sum(a == b for a, b in zip(got, ref))
        total += len(ref)
    return hits / total


def test_simplex_model_learns_tinymath(tmp_path):
    recipe = load_recipe(None, [
        f"out_dir={tmp_path / 'run'}", f"data.dir={tmp_path / 'data'}", "data.level=easy", "data.n_train=2000",
        "data.n_validation=32", "data.n_test=20", "model.preset=tiny", "model.vocab_size=512", "model.max_length=96",
        "model.attention=bidirectional", "model.label_shift=true", "train.objective=simplex", f"train.steps={STEPS}",
        "train.batch_size=16", "train.log_every=10", "optim.lr=3e-3", "optim.warmup_steps=10", "train.seed=0"])
    trainer = Trainer(recipe, progress=False)
    from dlm.data.pipeline import encode_examples

    examples, coll = encode_examples(trainer.tok, trainer.splits["validation"], recipe.model.max_length)
    batches = [coll(examples[i : i + 16]) for i in (0, 16)]
    test = trainer.splits["test"]
    loss_before, acc_before = heldout_loss(trainer, batches), token_accuracy(trainer, test)
    for _ in range(STEPS):
        trainer.train_step()
    loss_after, acc_after = heldout_loss(trainer, batches), token_accuracy(trainer, test)
    print(f"held-out loss {loss_before:.3f} -> {loss_after:.3f}; token accuracy {acc_before:.3f} -> {acc_after:.3f}")
    assert loss_after < 0.6 * loss_before, (loss_before, loss_after)
    assert acc_after > acc_before + 0.2, (acc_before, acc_after)
