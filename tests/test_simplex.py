"""TESS 2 simplex diffusion: schedule, simplex round trip, noising statistics, the input path with self-conditioning,
label-shift alignment of the loss, save/load of the timestep embedding, and the reverse process (steps, projection,
early stopping, self-conditioning inputs) checked against an oracle denoiser."""

import math

import pytest
import torch

from dlm.diffusion.simplex import (
    cosine_alpha_bar,
    from_simplex,
    inference_timesteps,
    noise_simplex,
    project_argmax,
    project_top_p,
    reverse_step,
    to_simplex,
    top_p_sample,
)


def simplex_model(vocab=40, label_shift=True, self_conditioning=True, T=100, k=5.0, seed=0):
    from tests.conftest import tiny_model

    m = tiny_model(vocab, "bidirectional", "simplex", label_shift=label_shift, seed=seed, simplex_k=k,
                   simplex_timesteps=T, self_conditioning=self_conditioning, eos_token_id=1, pad_token_id=0)
    with torch.no_grad():  # non-zero, so that the timestep input matters in these tests
        torch.nn.init.normal_(m.backbone.dlm_timestep_embedding.weight, std=0.5)
    return m


# ---- schedule and simplex ---------------------------------------------------------------------------------------
def test_cosine_schedule_values():
    a = cosine_alpha_bar(5000)
    assert a.shape == (5000,) and a[0] == pytest.approx(1.0, abs=1e-7)
    assert bool((a[1:] < a[:-1]).all())  # strictly decreasing
    assert 0 < a[-1] < 1e-6  # nearly pure noise at t = T-1
    s = 1e-4  # Nichol & Dhariwal Eq. 17 at u = 1/2 with offset s
    expect = math.cos((0.5 + s) / (1 + s) * math.pi / 2) ** 2 / math.cos(s / (1 + s) * math.pi / 2) ** 2
    assert a[2500].item() == pytest.approx(expect, rel=1e-5) and abs(a[2500].item() - 0.5) < 1e-3
    assert cosine_alpha_bar(10)[5].item() == pytest.approx(expect, rel=1e-5)  # depends on t/T only


def test_simplex_round_trip():
    ids = torch.randint(0, 50, (3, 7))
    s = to_simplex(ids, 50, 5.0)
    assert set(s.unique().tolist()) == {-5.0, 5.0} and bool(((s == 5.0).sum(-1) == 1).all())
    assert torch.equal(from_simplex(s), ids)
    assert torch.equal(from_simplex(project_argmax(s + 0.1 * torch.randn_like(s), 5.0)), ids)
    assert torch.equal(noise_simplex(s, torch.ones(3), torch.randn_like(s), 5.0), s)  # ᾱ = 1: no noise


def test_noising_statistics():
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (4, 200))
    s0 = to_simplex(ids, 256, 5.0)
    alpha = torch.tensor([0.9, 0.5, 0.1, 0.0])
    st = noise_simplex(s0, alpha, torch.randn_like(s0), 5.0)
    for row, a in enumerate(alpha.tolist()):
        resid = st[row] - math.sqrt(a) * s0[row]  # ε = k z: mean 0, std k √(1-ᾱ); 51,200 draws per row
        assert abs(resid.mean().item()) < 0.1
        assert resid.std().item() == pytest.approx(5.0 * math.sqrt(1 - a), rel=0.02)
    # Little noise keeps the argmax on the token, pure noise does not.
    assert (from_simplex(st[0]) == ids[0]).float().mean() > 0.95
    assert (from_simplex(st[3]) == ids[3]).float().mean() < 0.05


def test_inference_timesteps_and_reverse_step():
    assert inference_timesteps(5000, 1) == [4999]
    ts = inference_timesteps(5000, 100)
    assert len(ts) == 100 and ts[0] == 4999 and ts[-1] == 0 and ts == sorted(ts, reverse=True)
    assert inference_timesteps(10, 500) == list(range(9, -1, -1))  # more steps than timesteps: each once
    s_hat = to_simplex(torch.tensor([[3, 1]]), 8, 5.0)
    z = torch.randn_like(s_hat)
    assert torch.equal(reverse_step(s_hat, 1.0, z, 5.0), s_hat)  # the last step returns the projection
    assert torch.allclose(reverse_step(s_hat, 0.25, z, 5.0), 0.5 * s_hat + math.sqrt(0.75) * 5.0 * z)


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05]])).expand(2000, 4)
    g = torch.Generator().manual_seed(0)
    picks = top_p_sample(logits, 0.8, g)
    assert set(picks.unique().tolist()) == {0, 1}  # 0.6 + 0.3 reaches 0.8: tokens 2, 3 never drawn
    assert (picks == 0).float().mean().item() == pytest.approx(2 / 3, abs=0.05)
    assert torch.equal(top_p_sample(logits[:5], 0.01, g), torch.zeros(5, dtype=torch.long))  # tiny p = argmax
    assert set(project_top_p(logits[:3], 5.0, 0.5, g).unique().tolist()) == {-5.0, 5.0}


# ---- the input path -------------------------------------------------------------------------------------------
def test_input_embeddings_mix_previous_prediction_and_timestep():
    from dlm.modeling.simplex import input_embeddings

    m = simplex_model()
    E = m.backbone.get_input_embeddings().weight
    W = m.backbone.dlm_timestep_embedding.weight[:, 0]
    ids = torch.randint(2, 40, (2, 6))
    noisy, prev = torch.randn(2, 6, 40) * 5, torch.randn(2, 6, 40)
    gen = torch.tensor([[False, False, True, True, True, True]] * 2)
    time = torch.tensor([0.3, 0.9])
    with torch.no_grad():
        out = input_embeddings(m, ids, noisy, gen, time, prev)
        none = input_embeddings(m, ids, noisy, gen, time, None)
    p = 0.5 * (torch.softmax(noisy, -1) + torch.softmax(prev, -1))
    expect = p @ E + time[:, None, None] * W
    assert torch.allclose(out[gen], expect[gen], atol=1e-5)
    assert torch.allclose(out[~gen], E[ids][~gen])  # context: ordinary token embeddings, no timestep
    uniform = 0.5 * (torch.softmax(noisy, -1) + 1 / 40)  # no previous prediction: zeros, i.e. a uniform softmax
    assert torch.allclose(none[gen], (uniform @ E + time[:, None, None] * W)[gen], atol=1e-5)
    m.spec = m.spec.model_copy(update={"self_conditioning": False})
    with torch.no_grad():
        plain = input_embeddings(m, ids, noisy, gen, time, prev)
    assert torch.allclose(plain[gen], (torch.softmax(noisy, -1) @ E + time[:, None, None] * W)[gen], atol=1e-5)


def _batch(tok_ids=((5, 6, 7), (5,)), responses=((8, 9), (8, 9, 10, 11))):
    from dlm.data.canvas import Example, collate

    return collate([Example(list(p), list(r)) for p, r in zip(tok_ids, responses)], eos_id=1, pad_id=0)


@pytest.mark.parametrize("prob", [0.0, 1.0])
def test_self_conditioning_pass(prob):
    from dlm.training.objectives.simplex import SimplexObjective

    m = simplex_model(label_shift=False)
    calls = []

    def record(module, args, kwargs):
        calls.append({"grad": torch.is_grad_enabled(), "embeds": kwargs["inputs_embeds"].detach().clone()})

    m.backbone.register_forward_pre_hook(record, with_kwargs=True)
    obj = SimplexObjective(5.0, 100, self_condition_prob=prob, masking="prefix_lm", seed=0)
    loss, count, metrics = obj.loss(m, _batch())
    assert metrics["self_conditioned"] == prob
    if prob == 0.0:
        assert len(calls) == 1 and calls[0]["grad"]
    else:  # a first pass without gradient, then the training pass whose input depends on it
        assert [c["grad"] for c in calls] == [False, True]
        assert not torch.allclose(calls[0]["embeds"], calls[1]["embeds"])
    loss.backward()
    assert m.backbone.dlm_timestep_embedding.weight.grad.abs().sum() > 0  # the timestep embedding is trained
    assert torch.isfinite(loss) and int(count) == 3 + 5


@pytest.mark.parametrize("label_shift", [True, False])
def test_loss_label_shift_alignment(label_shift):
    """Recompute the objective's loss by hand from the raw backbone outputs: with label shift, token i is scored
    against output i-1 (TESS 2 §3.2); without, against output i."""
    from dlm.modeling.simplex import input_embeddings
    from dlm.training.objectives.simplex import SimplexObjective

    m = simplex_model(label_shift=label_shift)
    batch = _batch()
    obj = SimplexObjective(5.0, 100, self_condition_prob=0.0, masking="prefix_lm", label_shift=label_shift, seed=3)
    plan = obj.plan(batch)
    with torch.no_grad():
        loss, count, _ = obj.loss(m, batch, plan)
    ids = batch["input_ids"]
    B, L = ids.shape
    t = plan["t"]  # the plan's timesteps and each example's ε
    z = obj.epsilon(plan["example_id"], L, 40)
    s_t = noise_simplex(to_simplex(ids, 40, 5.0), cosine_alpha_bar(100)[t], z, 5.0)
    with torch.no_grad():
        emb = input_embeddings(m, ids, s_t, batch["maskable"], t.float() / 100)
        raw = m.backbone(inputs_embeds=emb, attention_mask=batch["attention_mask"]).logits
    ref, n = 0.0, 0
    for b in range(B):
        for i in range(L):
            if batch["loss_mask"][b, i]:
                out = raw[b, i - 1] if label_shift else raw[b, i]
                ref += torch.nn.functional.cross_entropy(out, ids[b, i]).item()
                n += 1
    assert n == int(count) and loss.item() == pytest.approx(ref, rel=1e-5)


def test_save_load_round_trip(tmp_path, tiny_tokenizer):
    from dlm.config import load_recipe
    from dlm.modeling.simplex import simplex_logits
    from dlm.sampling import load_for_inference
    from dlm.training.loop import build_model

    recipe = load_recipe(None, ["train.objective=simplex", "model.preset=nano", "model.attention=bidirectional",
                                "model.label_shift=true", "simplex.timesteps=1000", "simplex.simplex_value=3"])
    m = build_model(recipe, tiny_tokenizer).eval()
    assert m.spec.family == "simplex" and m.spec.simplex_k == 3.0 and m.spec.simplex_timesteps == 1000
    assert not m.backbone.dlm_timestep_embedding.weight.any()  # zero-initialised: an AR start is unchanged
    with torch.no_grad():
        m.backbone.dlm_timestep_embedding.weight.normal_()
    m.save_pretrained(tmp_path / "m")
    tiny_tokenizer.save_pretrained(tmp_path / "m")
    loaded, _ = load_for_inference(tmp_path / "m")
    assert loaded.spec == m.spec and not loaded.backbone.config.is_causal
    assert torch.equal(loaded.backbone.dlm_timestep_embedding.weight, m.backbone.dlm_timestep_embedding.weight)
    V = m.backbone.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, V, (2, 9))
    gen = torch.zeros(2, 9, dtype=torch.bool)
    gen[:, 4:] = True
    noisy, time = torch.randn(2, 9, V), torch.tensor([0.2, 0.7])
    with torch.no_grad():
        a, b = simplex_logits(m, ids, noisy, gen, time), simplex_logits(loaded, ids, noisy, gen, time)
    assert torch.allclose(a, b, atol=1e-5)
    (tmp_path / "m" / "model.safetensors").unlink()
    m.backbone.save_pretrained(tmp_path / "m", state_dict={k: v for k, v in m.backbone.state_dict().items()
                                                         if "dlm_timestep" not in k})
    with pytest.raises(FileNotFoundError, match="timestep embedding"):
        load_for_inference(tmp_path / "m")


# ---- the sampler ----------------------------------------------------------------------------------------------
class Oracle:
    """Stands in for `simplex_logits`: logits that favour fixed target tokens, recording what it was given."""

    def __init__(self, targets, vocab, strength=4.0):
        self.targets, self.vocab, self.strength, self.seen = targets, vocab, strength, []

    def __call__(self, model, input_ids, noisy, generating, time, previous_logits=None, **kw):
        self.seen.append({"time": time.clone(), "previous": previous_logits.clone(), "ids": input_ids.clone(),
                          "generating": generating.clone()})
        B, L = input_ids.shape
        logits = torch.zeros(B, L, self.vocab)
        G = self.targets.shape[1]
        logits[:, L - G:] = self.strength * torch.nn.functional.one_hot(self.targets[:B], self.vocab).float()
        return logits


def test_sampler_reverse_process_with_oracle(monkeypatch):
    import dlm.sampling.simplex as sx

    m = simplex_model(vocab=40)
    targets = torch.tensor([[7, 8, 9, 1, 3], [4, 1, 5, 5, 5]])
    oracle = Oracle(targets, 40)
    monkeypatch.setattr(sx, "simplex_logits", oracle)
    out = sx.generate(m, [[5, 6, 7], [9]], 5, eos_id=1, pad_id=0, inference_steps=7,
                      generator=torch.Generator().manual_seed(0))
    assert out.tokens == [[7, 8, 9], [4]] and out.nfe == [7, 7]  # cut at the first EOS; one NFE per step
    times = [s["time"][0].item() for s in oracle.seen]
    assert times == pytest.approx([t / 100 for t in inference_timesteps(100, 7)])
    assert not oracle.seen[0]["previous"].any()  # no previous prediction at the first step
    assert torch.equal(oracle.seen[1]["previous"][:, -5:].argmax(-1), targets)  # then the last step's logits
    assert not oracle.seen[1]["previous"][:, :-5].any()
    assert oracle.seen[0]["ids"][0].tolist()[:3] == [5, 6, 7] and oracle.seen[0]["ids"][1, 2] == 9  # left-padded
    assert oracle.seen[0]["generating"][:, -5:].all() and not oracle.seen[0]["generating"][:, :-5].any()


def test_sampler_early_stop(monkeypatch):
    import dlm.sampling.simplex as sx

    m = simplex_model(vocab=40)
    monkeypatch.setattr(sx, "simplex_logits", Oracle(torch.tensor([[7, 8, 1]] * 2), 40))
    out = sx.generate(m, [[5], [6]], 3, eos_id=1, pad_id=0, inference_steps=50, early_stop_patience=2)
    assert out.nfe == [3, 3] and out.tokens == [[7, 8], [7, 8]]  # changed once, then unchanged twice


def test_early_stop_watches_the_output_not_the_canvas_after_eos(monkeypatch):
    """TESS 2 §5.3: what settles is the sequence. Tokens after the first EOS are discarded (and, untrained, may never
    settle): they must not keep a row running, while a moved EOS or a changed output token restarts the count."""
    import dlm.sampling.simplex as sx

    class Flicker(Oracle):  # one target row per call
        def __call__(self, model, input_ids, *args, **kw):
            self.targets = plan[min(len(self.seen), len(plan) - 1)][None].expand(input_ids.shape[0], -1)
            return super().__call__(model, input_ids, *args, **kw)

    m = simplex_model(vocab=40)
    plan = torch.tensor([[7, 1, 3, 4], [7, 1, 5, 6], [7, 1, 8, 9], [7, 1, 3, 3], [7, 1, 4, 4], [7, 1, 5, 5]])
    monkeypatch.setattr(sx, "simplex_logits", Flicker(plan[0][None], 40))
    out = sx.generate(m, [[5]], 4, eos_id=1, pad_id=0, inference_steps=50, early_stop_patience=2)
    assert out.nfe == [3] and out.tokens == [[7]]  # [7, EOS] from step 1, unchanged at steps 2 and 3
    plan = torch.tensor([[7, 1, 3, 4], [7, 2, 1, 6], [7, 2, 1, 9], [7, 2, 1, 3], [7, 2, 1, 5]])  # EOS moves at step 2
    monkeypatch.setattr(sx, "simplex_logits", Flicker(plan[0][None], 40))
    out = sx.generate(m, [[5]], 4, eos_id=1, pad_id=0, inference_steps=50, early_stop_patience=2)
    assert out.nfe == [4] and out.tokens == [[7, 2]]
    plan = torch.tensor([[7, 8, 3, 4], [7, 8, 5, 6], [7, 8, 5, 6], [7, 8, 5, 6]])  # no EOS: every position counts
    monkeypatch.setattr(sx, "simplex_logits", Flicker(plan[0][None], 40))
    out = sx.generate(m, [[5]], 4, eos_id=1, pad_id=0, inference_steps=50, early_stop_patience=2)
    assert out.nfe == [4] and out.tokens == [[7, 8, 5, 6]]


def test_sampler_runs_a_real_model_for_any_step_count():
    from dlm.sampling import SimplexOptions, generate

    m = simplex_model(vocab=40)
    for steps in (1, 4, 9):
        options = SimplexOptions(inference_steps=steps, top_p=0.9 if steps == 4 else None)
        out = generate(m, [[5, 6], [7, 8, 9]], options, max_new_tokens=6, eos_id=1, pad_id=0,
                       generator=torch.Generator().manual_seed(0))
        assert out.nfe == [steps, steps] and all(len(t) <= 6 for t in out.tokens)
    with pytest.raises(ValueError, match="top_p"):
        generate(m, [[5]], max_new_tokens=3, eos_id=1, pad_id=0, temperature=0.7)


def test_schedule_and_step_edges():
    assert cosine_alpha_bar(1).tolist() == [1.0]  # T = 1 is allowed: the clean step only
    with pytest.raises(ValueError, match="timesteps must be >= 1, got 0"):
        cosine_alpha_bar(0)
    assert inference_timesteps(5000, 2) == [4999, 0]
    with pytest.raises(ValueError, match="inference steps must be >= 1, got 0"):
        inference_timesteps(5000, 0)


def test_top_p_on_every_position_of_a_batch_and_only_from_the_generator():
    """[B, L, V] logits: each position samples from its own nucleus; a seeded generator alone fixes the draw."""
    logits = torch.log(torch.tensor([[[0.7, 0.2, 0.1, 0.0 + 1e-9], [0.05, 0.05, 0.1, 0.8]],
                                     [[0.15, 0.05, 0.75, 0.05], [0.34, 0.33, 0.33, 1e-9]]]))
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([top_p_sample(logits, 0.85, g) for _ in range(600)])  # [N, 2, 2]
    assert set(draws[:, 0, 0].tolist()) == {0, 1} and set(draws[:, 0, 1].tolist()) == {2, 3}
    assert set(draws[:, 1, 0].tolist()) == {0, 2} and set(draws[:, 1, 1].tolist()) == {0, 1, 2}
    assert (draws[:, 0, 0] == 0).float().mean().item() == pytest.approx(0.7 / 0.9, abs=0.06)
    outs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        outs.append((top_p_sample(logits, 0.9, torch.Generator().manual_seed(5)),
                     project_top_p(logits, 5.0, 0.9, torch.Generator().manual_seed(5))))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
