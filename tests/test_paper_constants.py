"""Spec values that come from the seed papers, asserted in one place against the papers' numbers (not against the
code's own constants), each with the section it comes from. A change to one of these is a change of the method: it
should fail here and be argued, not pass silently.

Sources: ../shared/seeds/tess2-simplex-diffusion.txt (TESS 2), ../shared/seeds/pumba-trajectory-aware-mdm.txt
(PUMBA), ../shared/notes-tess2.md (what TESS 2 defers to TESS and its public code)."""

import inspect
import math

import pytest
import torch

from dlm.config import MaskedConfig, ProgressiveConfig, SimplexConfig
from dlm.data import ul2
from dlm.diffusion import masking, progressive, simplex
from dlm.sampling.options import MaskedOptions, SimplexOptions
from dlm.training.objectives.block_mdm import BlockMDMObjective, block_mdm_loss
from dlm.training.objectives.mdm import MDMObjective
from dlm.training.objectives.pu_pass import pass_loss
from dlm.training.objectives.simplex import SimplexObjective

# --- TESS 2 App. A.1: the UL2 mixture ---------------------------------------------------------------------------


def test_ul2_rates_and_span_sets():
    assert ul2.T5["rate"] == 0.15, "TESS 2 App. A.1: T5 masks until roughly 15% of the input is masked"
    assert set(ul2.T5["spans"]) == {3, 8}, "TESS 2 App. A.1: T5 mask spans of 3 or 8 tokens"
    assert ul2.AGGRESSIVE_T5["rate"] == 0.50, "TESS 2 App. A.1: aggressive T5 masks until roughly 50% is masked"
    assert set(ul2.AGGRESSIVE_T5["spans"]) == {3, 8, 48}, "TESS 2 App. A.1: aggressive T5 spans of 3, 8 or 48 tokens"
    assert set(ul2.STRATEGIES) == {"t5", "aggressive_t5", "prefix_lm"}, \
        "TESS 2 App. A.1: T5, aggressive T5 or prefix-LM, chosen per batch"


@pytest.mark.parametrize("strategy, rate, spans", [("t5", 0.15, {3, 8}), ("aggressive_t5", 0.50, {3, 8, 48})])
def test_ul2_masks_the_papers_share(strategy, rate, spans):
    """The mechanism, measured, against the paper's share (not the module's constant)."""
    valid = torch.ones(64, 512, dtype=torch.bool)
    gen, used = ul2_mask_with(valid, strategy)
    assert used == strategy
    assert gen.float().mean().item() == pytest.approx(rate, abs=0.01), \
        f"TESS 2 App. A.1: {strategy} masks roughly {rate:.0%} of the sequence"
    padded = torch.cat([gen, torch.zeros(64, 1, dtype=torch.bool)], 1).int()
    run_lengths = set()
    for row in padded:
        edges = row.diff(prepend=torch.zeros(1, dtype=torch.int)).nonzero().squeeze(1).tolist()
        run_lengths |= {b - a for a, b in zip(edges[::2], edges[1::2])}
    assert run_lengths == spans, f"TESS 2 App. A.1: {strategy} spans are {sorted(spans)} tokens"


def ul2_mask_with(valid, strategy):
    return ul2.ul2_mask(valid, torch.Generator().manual_seed(0), strategy)


def test_ul2_prefix_lm_generates_the_second_half():
    valid = torch.ones(1, 40, dtype=torch.bool)
    gen, _ = ul2.ul2_mask(valid, torch.Generator().manual_seed(0), "prefix_lm")
    assert gen[0].tolist() == [False] * 20 + [True] * 20, \
        "TESS 2 App. A.1: prefix-LM masks the first half and predicts the rest"


# --- TESS 2 §3.1, §4.1, §4.3; notes-tess2.md --------------------------------------------------------------------


def test_simplex_value_and_timesteps():
    for where, k, T in (("SimplexConfig", SimplexConfig().simplex_value, SimplexConfig().timesteps),
                        ("SimplexObjective", *_defaults(SimplexObjective.__init__, "simplex_value", "timesteps"))):
        assert k == 5, f"{where}: TESS 2 §4.1 'We use a simplex value of 5'"
        assert T == 5000, f"{where}: notes-tess2.md (TESS configs): T = 5000 training timesteps"
    assert SimplexConfig().self_condition_prob == 0.5, "notes-tess2.md: self-conditioning with probability 0.5"
    assert _defaults(SimplexObjective.__init__, "self_condition_prob") == (0.5,), "notes-tess2.md: probability 0.5"


def test_simplex_is_plus_minus_k():
    s = simplex.to_simplex(torch.tensor([2]), 4, 5.0)
    assert s.tolist() == [[-5.0, -5.0, 5.0, -5.0]], "TESS 2 Eq. 1: +k at the token, -k elsewhere"


def test_cosine_schedule_endpoints_and_shape():
    T, s = 5000, 1e-4
    a = simplex.cosine_alpha_bar(T)
    assert a.shape == (T,), "notes-tess2.md: alpha_bar_t for t = 0 ... T-1"
    assert a[0].item() == pytest.approx(1.0, abs=1e-7), "notes-tess2.md: alpha_bar_0 = 1 (clean at t = 0)"
    assert a[-1].item() < 1e-6, "notes-tess2.md: alpha_bar decreases towards 0 at t = T"
    assert bool((a[1:] <= a[:-1]).all()), "Nichol & Dhariwal Eq. 17: alpha_bar decreases monotonically"
    f = lambda u: math.cos((u + s) / (1 + s) * math.pi / 2) ** 2  # noqa: E731
    for t in (1, 1250, 2500, 3750, 4990):
        assert a[t].item() == pytest.approx(f(t / T) / f(0), rel=1e-5, abs=1e-7), \
            f"notes-tess2.md / Nichol & Dhariwal Eq. 17 with s = 1e-4, t = {t}"


def test_noise_scale_is_k():
    s0 = torch.zeros(1, 1, 3)
    z = torch.ones(1, 1, 3)
    st = simplex.noise_simplex(s0, torch.tensor([0.36]), z, 5.0)
    assert torch.allclose(st, torch.full_like(st, 0.8 * 5.0)), "TESS 2 Eq. 2: eps ~ N(0, k^2 I), sqrt(1 - 0.36) = 0.8"


def test_simplex_sampling_defaults():
    o = SimplexOptions()
    assert o.inference_steps == 100, "TESS 2 §4.3: 100 diffusion steps at inference time"
    assert o.top_p is None, "TESS 2 Eq. 5: the paper's projection is the argmax (top-p is the public code's option)"
    assert o.guidance_scale == 0.0 and o.guidance_steps == 1, \
        "TESS 2 §3.4: guidance is inference-time and optional; notes-tess2.md: one ascent step per diffusion step"


# --- PUMBA Eq. 2.1, App. B.4: the MDM loss ---------------------------------------------------------------------


def test_mdm_weight_cap_and_z_loss_defaults_everywhere():
    where = {"MaskedConfig": (MaskedConfig().weight_cap, MaskedConfig().z_loss),
             "masking.mdm_loss": _defaults(masking.mdm_loss, "weight_cap", "z_loss"),
             "MDMObjective": _defaults(MDMObjective.__init__, "weight_cap", "z_loss"),
             "BlockMDMObjective": _defaults(BlockMDMObjective.__init__, "weight_cap", "z_loss"),
             "block_mdm_loss": _defaults(block_mdm_loss, "weight_cap", "z_loss"),
             "pu_pass.pass_loss": _defaults(pass_loss, "weight_cap", "z_loss")}
    for name, (cap, z) in where.items():
        assert cap == 5, f"{name}: PUMBA App. B.4 / Table 5: MDM loss weighting min(1/t, 5) (gamma = 5)"
        assert z == 1e-5, f"{name}: PUMBA App. B.4 / Table 5: z-loss weighted 1e-5"
    assert _defaults(masking.loss_weight, "weight_cap") == (5,), "PUMBA App. B.4: gamma = 5"


def test_mdm_loss_defaults_in_use():
    """Called without them, mdm_loss weighs by min(1/t, 5) and adds 1e-5 · lse² (not just declared defaults)."""
    logits = torch.tensor([[[3.0, 1.0, 0.5]]])
    args = (logits, torch.tensor([[1]]), torch.tensor([[True]]), torch.tensor([[True]]), torch.tensor([0.1]))
    lse = torch.logsumexp(logits[0, 0], -1).item()
    expected = 5 * (lse - 1.0) + 1e-5 * lse**2
    assert masking.mdm_loss(*args)[0].item() == pytest.approx(expected, rel=2e-6), \
        "PUMBA App. B.4 / Table 5: min(1/t, 5) and z-loss 1e-5"


def test_mdm_weight_is_min_of_inverse_t_and_5():
    t = torch.tensor([0.1, 0.2, 0.25, 0.5, 1.0])
    assert masking.loss_weight(t).tolist() == pytest.approx([5.0, 5.0, 4.0, 2.0, 1.0]), \
        "PUMBA Eq. 2.1 with App. B.4: weight min(1/t, 5)"


# --- PUMBA App. B.2, Table 3-4: progressive unmasking and its curriculum ------------------------------------------


def test_thresholds_are_tau_0_9():
    assert ProgressiveConfig().threshold == 0.9, "PUMBA App. B.2: commit every position with confidence above 0.9"
    assert _defaults(progressive.StageConstruction.__init__, "threshold") == (0.9,), \
        "PUMBA Table 4: confidence threshold 0.9 (Section B.2)"
    assert MaskedOptions().confidence_threshold == 0.9, "PUMBA App. B.2 / §4: tau = 0.9"


def test_reveal_count_and_carry_defaults():
    assert ProgressiveConfig().reveal_count == 2, "PUMBA §3.3 / Table 2: u = 2, the regime of interest"
    assert MaskedOptions().reveal_count == 2, "PUMBA §3.3 / Table 2: u = 2 at inference"
    assert ProgressiveConfig().carry_drop_prob == 0.0, "PUMBA App. B.3 / Table 4: carry dropout p = 1 (always passed)"


def test_curriculum_on_k():
    c = ProgressiveConfig()
    assert (c.stages_start, c.stages_end, c.stages_increment, c.stages_every, c.stages_from) == \
        (12, 42, 3, 30000, 60000), "PUMBA App. B.3 / Table 4: K from 12, +3 every 30k updates from 60k, up to 42"
    k = lambda u: progressive.stage_count(u, c.stages_start, c.stages_end, c.stages_increment,  # noqa: E731
                                          c.stages_every, c.stages_from)
    assert k(0) == 12 and k(59_999) == 12, "PUMBA App. B.3: K starts at 12 until update 60k"
    assert k(60_000) == 15 and k(89_999) == 15 and k(90_000) == 18, "PUMBA App. B.3: rises by 3 every 30k from 60k"
    assert k(329_999) == 39 and k(330_000) == 42, "PUMBA App. B.3: reaching 42 at update 330k"
    assert k(907_000) == 42, "PUMBA Table 4: K stays at 42 for the rest of training"


def _defaults(fn, *names):
    params = inspect.signature(fn).parameters
    return tuple(params[n].default for n in names)
