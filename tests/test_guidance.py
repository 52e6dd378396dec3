"""Reward guidance (TESS 2 §3.4, Eqs. 6–8): an ascent step with η > 0 raises the reward of the soft sequence, η = 0
changes nothing, a reward model with another tokenizer is refused, and the sampler applies it at every step."""

import json

import pytest
import torch

from dlm.sampling.guidance import check_compatible, reward_guidance, reward_of_logits

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: latency-bound on 1 thread


def reward_model(vocab=40, seed=1):
    from tests.conftest import tiny_model

    return tiny_model(vocab, "causal", "reward", seed=seed, eos_token_id=1, pad_token_id=0)


def test_a_guidance_step_raises_the_reward():
    torch.manual_seed(0)
    rm = reward_model()
    context = torch.randint(2, 40, (6, 4))
    logits = 3 * torch.randn(6, 8, 40)
    before = reward_of_logits(rm, logits, context, eos_id=1)
    for eta in (0.05, 0.2):
        guided = reward_guidance(logits, context, rm, eta, eos_id=1)
        after = reward_of_logits(rm, guided, context, eos_id=1)
        assert bool((after > before).all()), (eta, before, after)
        assert not torch.equal(guided, logits)
    more = reward_guidance(logits, context, rm, 0.05, guidance_steps=4, eos_id=1)
    assert bool((reward_of_logits(rm, more, context, eos_id=1) > reward_of_logits(
        rm, reward_guidance(logits, context, rm, 0.05, eos_id=1), context, eos_id=1)).all())  # more steps, more reward
    assert torch.equal(reward_guidance(logits, context, rm, 0.0, eos_id=1), logits)  # η = 0: no change
    assert all(p.grad is None for p in rm.parameters())  # the reward model is not trained by guidance


def test_guidance_gradient_matches_finite_differences():
    torch.manual_seed(1)
    rm = reward_model()
    context = torch.randint(2, 40, (1, 3))
    logits = torch.randn(1, 5, 40, dtype=torch.float32)
    eta = 1e-2
    step = reward_guidance(logits, context, rm, eta, eos_id=1) - logits  # η ∇R
    i, j, v = 0, 2, 7
    h = 1e-2
    plus, minus = logits.clone(), logits.clone()
    plus[i, j, v] += h
    minus[i, j, v] -= h
    with torch.no_grad():
        fd = (reward_of_logits(rm, plus, context, 1) - reward_of_logits(rm, minus, context, 1)) / (2 * h)
    assert step[i, j, v].item() / eta == pytest.approx(fd.item(), rel=0.05, abs=1e-5)


def test_tokenizer_mismatch_is_a_clear_error():
    from tests.test_simplex import simplex_model

    with pytest.raises(ValueError, match="tokenizer.*vocabulary 40 vs 50"):
        check_compatible(simplex_model(vocab=40), reward_model(vocab=50))
    check_compatible(simplex_model(vocab=40), reward_model(vocab=40))  # same vocabulary: fine


def test_sampler_guides_every_step(monkeypatch):
    import dlm.sampling.guidance as guidance
    from dlm.sampling.simplex import generate  # the family sampler: it also takes a loaded reward model
    from tests.test_simplex import simplex_model

    calls = []
    real = guidance.reward_guidance

    def spy(*args, **kwargs):
        calls.append(args[3])
        return real(*args, **kwargs)

    monkeypatch.setattr(guidance, "reward_guidance", spy)
    m, rm = simplex_model(vocab=40), reward_model(vocab=40)
    kw = dict(gen_length=6, eos_id=1, pad_id=0, inference_steps=5)
    plain = generate(m, [[5, 6], [7]], generator=torch.Generator().manual_seed(0), **kw)
    guided = generate(m, [[5, 6], [7]], generator=torch.Generator().manual_seed(0), reward_model=rm,
                      guidance_scale=50.0, **kw)
    assert calls == [50.0] * 5 and guided.nfe == plain.nfe == [5, 5]
    assert guided.tokens != plain.tokens  # a large η changes the outcome
    generate(m, [[5]], generator=torch.Generator().manual_seed(0), reward_model=rm, guidance_scale=0.0, **kw)
    assert len(calls) == 5  # η = 0 skips the reward model entirely


def test_reward_model_given_as_a_directory(tmp_path):
    from dlm.sampling import SimplexOptions, generate
    from dlm.sampling.guidance import resolve_reward_model
    from tests.test_simplex import simplex_model

    rm = reward_model(vocab=40)
    rm.save_pretrained(tmp_path / "rm")
    loaded = resolve_reward_model(str(tmp_path / "rm"))
    assert resolve_reward_model(tmp_path / "rm") is loaded  # loaded once per process
    assert torch.equal(loaded.backbone.dlm_reward_head.weight, rm.backbone.dlm_reward_head.weight)
    options = SimplexOptions(inference_steps=2, reward_model=tmp_path / "rm", guidance_scale=0.5)
    out = generate(simplex_model(vocab=40), [[5]], options, max_new_tokens=4, eos_id=1, pad_id=0)
    assert out.nfe == [2]
    with pytest.raises(ValueError, match="not a reward model"):
        simplex_model(vocab=40).save_pretrained(tmp_path / "sx")
        resolve_reward_model(tmp_path / "sx")


def test_eval_sweeps_eta(tmp_path, tiny_tokenizer):
    from dlm.cli import main
    from tests.test_simplex import simplex_model

    sx = simplex_model(vocab=len(tiny_tokenizer))
    rm = reward_model(vocab=len(tiny_tokenizer))
    for m, name in ((sx, "sx"), (rm, "rm")):
        m.spec = m.spec.model_copy(update={"eos_token_id": tiny_tokenizer.eos_token_id,
                                           "pad_token_id": tiny_tokenizer.pad_token_id})
        m.save_pretrained(tmp_path / name)
        tiny_tokenizer.save_pretrained(tmp_path / name)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Ann has {i} cats.", "response": f"return {i}", "answer": i}) + "\n"
                            for i in range(4)))
    main(["eval", str(tmp_path / "sx"), "--data", str(data), "--steps", "2", "--reward-model", str(tmp_path / "rm"),
          "--sweep", "eta=0,0.5", "--max-new-tokens", "4", "--out", str(tmp_path / "s.json")])
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert [(r["guidance_scale"], r["inference_steps"], r["mean_nfe"]) for r in rows] == [(0.0, 2, 2), (0.5, 2, 2)]
