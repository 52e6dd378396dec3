"""Reward guidance against slow references (TESS 2 §3.4, Eqs. 6–8): the reward of soft inputs equals the reward of
the real tokens when the logits are one-hot, read at the first predicted EOS; the ascent step equals a hand-derived
gradient (chain rule through softmax(Ŝ/τ) and c = E·p, with only ∂R/∂c taken by autograd); left padding with its
mask changes no number; the tokenizer check and the reward-model loader say exactly what is wrong."""

import pytest
import torch

from dlm.sampling.guidance import check_compatible, first_eos_or_last, reward_guidance, reward_of_logits
from tests.conftest import perturb

pytestmark = pytest.mark.usefixtures("one_thread")


def reward_model(vocab=40, seed=1, **spec):
    from tests.conftest import tiny_model

    spec = {"eos_token_id": 1, "pad_token_id": 0, **spec}
    return perturb(tiny_model(vocab, "causal", "reward", seed=seed, **spec), seed=seed)


def test_first_eos_or_last_hand_values():
    tokens = torch.tensor([[3, 1, 4, 1, 2], [2, 2, 2, 2, 2], [1, 5, 5, 5, 5], [6, 6, 6, 6, 1]])
    assert first_eos_or_last(tokens, 1).tolist() == [1, 4, 0, 4]  # first EOS; none: the last index (G - 1 = 4)
    assert first_eos_or_last(tokens, 2).tolist() == [4, 0, 4, 4]
    assert first_eos_or_last(torch.tensor([[1], [3]]), 1).tolist() == [0, 0]  # a one-position region


def _left_pad(contexts, pad_id=0):
    """[B, P] left-padded ids, the 2-D mask over [context | G generated] and the sampler's position ids."""
    P = max(len(c) for c in contexts)
    ids = torch.tensor([[pad_id] * (P - len(c)) + c for c in contexts])
    ctx_mask = torch.tensor([[0] * (P - len(c)) + [1] * len(c) for c in contexts])
    return ids, ctx_mask


def _mask_and_positions(ctx_mask, G):
    attention = torch.cat([ctx_mask, torch.ones(ctx_mask.shape[0], G, dtype=ctx_mask.dtype)], 1)
    return attention, (attention.cumsum(-1) - 1).clamp(min=0)


def test_soft_reward_of_one_hot_logits_is_the_token_reward_at_the_first_eos():
    """Sharp logits make softmax exactly one-hot, so c = E·p is the token embedding: R must equal the reward model
    on the real ids, read at P + the first EOS of the argmax (the last position when there is none)."""
    from dlm.modeling.reward import reward_scores

    rm = reward_model()
    context = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]])
    tokens = torch.tensor([[4, 1, 9, 1, 3], [7, 7, 8, 2, 2], [3, 3, 3, 3, 1]])
    logits = 60.0 * torch.nn.functional.one_hot(tokens, 40).float() - 30.0
    with torch.no_grad():
        soft = reward_of_logits(rm, logits, context, eos_id=1)
        ids = torch.cat([context, tokens], 1)
        hard = reward_scores(rm, torch.tensor([3 + 1, 3 + 4, 3 + 4]), input_ids=ids)
        elsewhere = reward_scores(rm, torch.tensor([3 + 4, 3 + 2, 3 + 2]), input_ids=ids)
    torch.testing.assert_close(soft, hard, rtol=1e-4, atol=1e-4)
    assert (soft - elsewhere).abs().min() > 1e-2  # the read position matters on this model


def test_temperature_divides_the_logits():
    rm = reward_model()
    torch.manual_seed(0)
    context, logits = torch.randint(2, 40, (3, 4)), 3 * torch.randn(3, 6, 40)
    with torch.no_grad():
        cold = reward_of_logits(rm, logits, context, 1, temperature=0.5)
        torch.testing.assert_close(cold, reward_of_logits(rm, logits / 0.5, context, 1), rtol=1e-5, atol=1e-5)
        assert (cold - reward_of_logits(rm, logits, context, 1)).abs().min() > 1e-3  # τ matters on this model
        torch.testing.assert_close(reward_of_logits(rm, logits, context, 1),
                                   reward_of_logits(rm, logits, context, 1, temperature=1.0))  # default τ = 1


def test_soft_reward_in_bfloat16_matches_float32():
    """p is cast to the reward model's dtype before c = E·p: a bf16 reward model scores float32 logits."""
    import copy

    rm = reward_model()
    torch.manual_seed(0)
    context, logits = torch.randint(2, 40, (2, 4)), 3 * torch.randn(2, 6, 40)
    with torch.no_grad():
        full = reward_of_logits(rm, logits, context, 1)
        half = reward_of_logits(copy.deepcopy(rm).to(torch.bfloat16), logits, context, 1)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, full, rtol=0.05, atol=0.1)


def _hand_gradient(rm, s, context, eos_id, temperature):
    """∇_Ŝ R by the chain rule: p = softmax(Ŝ/τ), c = E·p, so ∂R/∂Ŝ = p ⊙ (g − ⟨g, p⟩) / τ with g = E ∂R/∂c;
    only ∂R/∂c (the reward model's own gradient at its input embeddings) comes from autograd."""
    from dlm.modeling.reward import reward_scores

    E = rm.backbone.get_input_embeddings().weight.detach()
    p = torch.exp(s / temperature - torch.logsumexp(s / temperature, -1, keepdim=True))
    c = torch.cat([E[context], p @ E], 1).requires_grad_(True)
    last = context.shape[1] + first_eos_or_last(s.argmax(-1), eos_id)
    with torch.enable_grad():
        (dc,) = torch.autograd.grad(reward_scores(rm, last, inputs_embeds=c).sum(), c)
    g = dc[:, context.shape[1]:] @ E.T  # ∂R/∂p [B, G, V]
    return p * (g - (g * p).sum(-1, keepdim=True)) / temperature


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_guidance_steps_follow_the_hand_derived_gradient(temperature):
    rm = reward_model()
    torch.manual_seed(2)
    context, logits = torch.randint(2, 40, (3, 4)), 2 * torch.randn(3, 5, 40)
    logits[0, 2, 1] = 20.0  # row 0 predicts EOS at position 2: R is read there
    eta = 0.3
    one = logits + eta * _hand_gradient(rm, logits, context, 1, temperature)  # TESS 2 Eq. 8
    s = one
    for _ in range(2):
        s = s + eta * _hand_gradient(rm, s, context, 1, temperature)
    kw = {} if temperature == 1.0 else {"temperature": temperature}  # the default τ is 1
    torch.testing.assert_close(reward_guidance(logits, context, rm, eta, eos_id=1, **kw), one, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(reward_guidance(logits, context, rm, eta, 3, eos_id=1, **kw), s, rtol=1e-4, atol=1e-5)
    assert (one - logits).abs().max() > 1e-2  # the step is not negligible


def test_left_padding_changes_no_guided_number():
    """A batch of contexts of different lengths, left-padded with the sampler's mask and position ids, gives each
    row exactly what it gets alone: the mask must reach the reward model in both the score and the gradient."""
    rm = reward_model()
    torch.manual_seed(3)
    contexts = [[5, 6, 7, 8], [9], [10, 11]]
    G = 5
    logits = 2 * torch.randn(3, G, 40)
    ids, ctx_mask = _left_pad(contexts)
    attention, positions = _mask_and_positions(ctx_mask, G)
    with torch.no_grad():
        batched = reward_of_logits(rm, logits, ids, 1, 0.7, attention, positions)
    guided = reward_guidance(logits, ids, rm, 0.5, 2, 0.7, attention, positions, eos_id=1)
    for b, c in enumerate(contexts):
        with torch.no_grad():
            alone = reward_of_logits(rm, logits[b:b + 1], torch.tensor([c]), 1, 0.7)
        torch.testing.assert_close(batched[b:b + 1], alone, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(guided[b:b + 1], reward_guidance(logits[b:b + 1], torch.tensor([c]), rm, 0.5, 2,
                                                                     0.7, eos_id=1), rtol=1e-4, atol=1e-4)


def test_eos_and_pad_mismatch_is_one_clear_error():
    from tests.test_simplex import simplex_model

    sx = simplex_model(vocab=40)  # eos 1, pad 0
    with pytest.raises(ValueError) as err:
        check_compatible(sx, reward_model(eos_token_id=2, pad_token_id=3))
    assert str(err.value) == (
        "reward guidance needs a reward model with the diffusion model's tokenizer (TESS 2 §3.4); they differ: "
        "eos_token_id 1 vs 2, pad_token_id 0 vs 3. Train the reward model from the same checkpoint family (e.g. "
        "model.init_from the AR baseline the diffusion model was adapted from).")
    with pytest.raises(ValueError, match=r"differ: eos_token_id 1 vs 2\. Train"):
        check_compatible(sx, reward_model(eos_token_id=2))
    check_compatible(sx, reward_model(eos_token_id=None, pad_token_id=None))  # unknown ids: nothing to compare
    sx.spec = sx.spec.model_copy(update={"eos_token_id": None})
    check_compatible(sx, reward_model(eos_token_id=2))


def test_a_non_reward_model_directory_is_refused_with_the_fix(tmp_path):
    from dlm.sampling.guidance import resolve_reward_model
    from tests.test_simplex import simplex_model

    simplex_model(vocab=40).save_pretrained(tmp_path / "sx")
    with pytest.raises(ValueError) as err:
        resolve_reward_model(tmp_path / "sx")
    assert str(err.value) == (f"reward_model {(tmp_path / 'sx').resolve()}: not a reward model (dlm.json family "
                              "'simplex'; train one with `dlm train recipes/tinymath/reward.yaml`)")
