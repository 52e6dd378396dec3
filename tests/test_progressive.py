"""PUMBA machinery: the two progressive-unmasking constructions (hand-checked reveal sets, retirement, refill), the
K curriculum, the carry (identity at initialisation, save/load, sampler passing), truncated BPTT gradients against a
hand-unrolled computation, activation checkpointing, the discrete bridges and the PU+ pool."""

import copy

import pytest
import torch

from dlm.config import ProgressiveConfig
from dlm.data.canvas import Example, collate
from dlm.diffusion.masking import loss_weight
from dlm.diffusion.progressive import StageConstruction, ThresholdConstruction, stage_count, student_forcing_ratio
from dlm.modeling.build import load_model
from dlm.modeling.carry import CARRY_MODULE
from dlm.sampling.masked import generate
from dlm.training.objectives.progressive import ProgressiveObjective
from dlm.training.trajectories import TrajectoryPool
from tests.conftest import tiny_model

PAD, EOS, MASK, VOCAB = 0, 1, 2, 40
G = torch.Generator


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: latency-bound on 1 thread


# ---- constructions ----------------------------------------------------------------------------------------------
def test_threshold_construction_hand_cases():
    conf = torch.tensor([[0.5, 0.95, 0.2, 0.7, 0.91, 0.3]])
    masked = torch.tensor([[True, True, True, True, False, True]])  # position 4 already revealed
    loss_mask = torch.tensor([[True, True, True, True, True, False]])  # position 5: padding, out of the loss
    maskable = torch.ones_like(masked)
    c = ThresholdConstruction(reveal_count=2, threshold=0.9)
    reveal, retire, _ = c.step(conf, masked, maskable, ~masked, torch.zeros(1, dtype=torch.long), loss_mask, None)
    assert reveal.tolist() == [[False, True, False, True, False, False]]  # top-2 = {1, 3}; nothing else above 0.9
    assert not retire.item()
    c = ThresholdConstruction(reveal_count=1, threshold=0.6)
    reveal, _, _ = c.step(conf, masked, maskable, ~masked, torch.zeros(1, dtype=torch.long), loss_mask, None)
    assert reveal.tolist() == [[False, True, False, True, False, False]]  # top-1 = {1}, plus 3 (0.7 >= 0.6)
    c = ThresholdConstruction(reveal_count=3, threshold=None)  # App. F.7: exactly u
    reveal, _, _ = c.step(conf, masked, maskable, ~masked, torch.zeros(1, dtype=torch.long), loss_mask, None)
    assert reveal.tolist() == [[True, True, False, True, False, False]]
    # Retirement: once the positions in the loss are revealed, even if padding is still masked.
    masked = torch.tensor([[False, False, True, False, False, True]])
    reveal, retire, _ = ThresholdConstruction(1, 0.9).step(conf, masked, maskable, ~masked,
                                                            torch.zeros(1, dtype=torch.long), loss_mask, None)
    assert reveal.tolist() == [[False, False, False, False, False, True]]  # 0.3 > 0.2: padding goes first
    assert not retire.item()
    reveal, retire, _ = ThresholdConstruction(2, 0.9).step(conf, masked, maskable, ~masked,
                                                            torch.zeros(1, dtype=torch.long), loss_mask, None)
    assert retire.item()


def test_stage_construction_step_hand_case():
    """K=4, L=8 maskable, stage 1 with 2 revealed: target round(r·8), r in [2/4, 3/4) → 4..6, so 2..4 new, taken in
    confidence order; then everything above tau; the stage is recomputed from the revealed fraction."""
    c = StageConstruction(stages=4, threshold=0.9)
    maskable = torch.ones(1, 8, dtype=torch.bool)
    revealed = torch.zeros(1, 8, dtype=torch.bool)
    revealed[0, [0, 1]] = True
    masked = maskable & ~revealed
    conf = torch.tensor([[0.0, 0.0, 0.3, 0.8, 0.1, 0.6, 0.95, 0.5]])
    order = [6, 3, 5, 7, 2, 4]  # by confidence
    seen = set()
    for seed in range(40):
        reveal, retire, stage = c.step(conf, masked, maskable, revealed, torch.tensor([1]), maskable,
                                       G().manual_seed(seed))
        n = int(reveal.sum())
        assert 2 <= n <= 4 and reveal[0, order[:n]].all()  # the n most confident (6 is also above tau)
        assert stage.item() == min(3, (2 + n) * 4 // 8) and not retire.item()
        seen.add(n)
    assert seen == {2, 3, 4}
    # A step at stage K-1 retires the trajectory; its target is capped at L-1 (one position stays masked).
    revealed = torch.zeros(1, 8, dtype=torch.bool)
    revealed[0, :6] = True
    conf = torch.tensor([[0.0] * 6 + [0.5, 0.4]])
    reveal, retire, _ = c.step(conf, maskable & ~revealed, maskable, revealed, torch.tensor([3]), maskable,
                               G().manual_seed(0))
    assert reveal.tolist() == [[False] * 6 + [True, False]] and retire.item()
    # Padding out of the loss: once the loss positions are revealed the trajectory retires before stage K-1.
    loss_mask = torch.tensor([[True] * 5 + [False] * 3])
    revealed = torch.zeros(1, 8, dtype=torch.bool)
    revealed[0, :3] = True
    conf = torch.tensor([[0.0, 0.0, 0.0, 0.95, 0.97, 0.1, 0.2, 0.3]])
    reveal, retire, stage = c.step(conf, maskable & ~revealed, maskable, revealed, torch.tensor([1]), loss_mask,
                                   G().manual_seed(0))
    assert reveal[0, 3:5].all() and retire.item() and stage.item() < 3


def test_stage_construction_start_spreads_stages():
    c = StageConstruction(stages=4, threshold=0.9)
    maskable = torch.zeros(8, 20, dtype=torch.bool)
    maskable[:, 5:] = True
    revealed, stage = c.start(maskable, G().manual_seed(0), spread=True)
    assert stage.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert not (revealed & ~maskable).any()
    frac = revealed.sum(-1).float() / 15
    assert ((frac >= stage / 4 - 1 / 30) & (frac < (stage + 1) / 4 + 1 / 30)).all()
    fresh, s0 = c.start(maskable, G().manual_seed(1))
    assert (s0 == 0).all() and (fresh.sum(-1) <= 4).all()  # r < 1/4 of 15, rounded


def test_stage_curriculum_matches_table_4():
    k = lambda u: stage_count(u, 12, 42, 3, 30000, 60000)  # noqa: E731
    assert [k(0), k(59_999), k(60_000), k(89_999), k(90_000), k(300_000), k(330_000), k(10**7)] == \
        [12, 12, 15, 15, 18, 39, 42, 42]


# ---- the pool ---------------------------------------------------------------------------------------------------
class _Stream:
    """Examples 0, 1, 2, ... with a prompt of 2 tokens and a response of 3 + (i % 3) tokens."""

    def __init__(self):
        self.i = 0

    def take(self, n):
        out = []
        for _ in range(n):
            out.append(Example([3 + self.i % 5, 4], [10 + (self.i + j) % 20 for j in range(3 + self.i % 3)]))
            self.i += 1
        return out


def _collate(examples, pad_to=None):
    return collate(examples, EOS, PAD, pad_to=pad_to)


def test_pool_retires_and_refills():
    stream = _Stream()
    pool = TrajectoryPool(3, 10, stream.take, _collate, MASK, ThresholdConstruction(2, None), G().manual_seed(0),
                          carry_dim=4)
    assert stream.i == 3 and (pool.canvas[pool.maskable] == MASK).all() and (pool.canvas[~pool.maskable] != MASK).all()
    rows = torch.arange(3)
    pool.carry += 1.0
    conf = torch.linspace(0.1, 0.9, 10).repeat(3, 1)  # later positions are more confident
    steps = 0
    while not pool.done.all():
        reveal, retired = pool.advance(rows, conf)
        steps += 1
        # teacher forcing: the committed tokens are the targets
        assert (pool.canvas[pool.revealed] == pool.target[pool.revealed]).all()
    # responses of 3, 4, 5 tokens + EOS start at position 2; padding (after EOS) is revealed first (more confident),
    # so row i needs ceil(8 / 2) = 4 steps to reach its first EOS... every row ends when its loss positions are revealed
    assert steps == 4 and pool.steps.tolist() == [4, 4, 4]
    first = pool.target.clone()
    pool.refill(rows[pool.done])
    assert stream.i == 6 and not pool.done.any() and (pool.steps == 0).all()
    assert (pool.carry == 0).all() and not torch.equal(first, pool.target) and not pool.revealed.any()


def test_pool_state_roundtrip():
    stream = _Stream()
    pool = TrajectoryPool(2, 10, stream.take, _collate, MASK, ThresholdConstruction(2, 0.9), G().manual_seed(0),
                          carry_dim=3)
    pool.advance(torch.arange(2), torch.rand(2, 10, generator=G().manual_seed(1)))
    other = TrajectoryPool(2, 10, _Stream().take, _collate, MASK, ThresholdConstruction(2, 0.9), G().manual_seed(5),
                           carry_dim=3)
    other.load_state_dict(pool.state_dict())
    for k in ("target", "canvas", "revealed", "steps", "carry"):
        assert torch.equal(getattr(other, k), getattr(pool, k))
    with pytest.raises(ValueError, match="shape"):
        TrajectoryPool(3, 10, _Stream().take, _collate, MASK, ThresholdConstruction(2, 0.9), G(),
                       carry_dim=3).load_state_dict(pool.state_dict())


# ---- the carry --------------------------------------------------------------------------------------------------
def _carry_model(seed=0, label_shift=False, positions="all"):
    return tiny_model(VOCAB, attention="bidirectional", family="masked", label_shift=label_shift, seed=seed,
                      carry=True, mask_token_id=MASK, carry_positions=positions)


def test_fresh_carry_layer_is_the_identity():
    plain = tiny_model(VOCAB, attention="bidirectional", family="masked", seed=0)
    m = _carry_model(seed=0)
    ids = torch.randint(3, VOCAB, (2, 9), generator=G().manual_seed(0))
    carry = torch.randn(2, 9, m.config.hidden_size, generator=G().manual_seed(1)) * 5
    with torch.no_grad():
        out, hidden = m(ids, carry=carry, return_hidden=True)
        assert torch.equal(out, plain(ids))
        # a trained (non-zero) carry layer does change the output
        getattr(m.backbone, CARRY_MODULE).weight.fill_(0.5)
        assert not torch.allclose(m(ids, carry=carry), out)
    assert hidden.shape == (2, 9, m.config.hidden_size)


def test_carry_placement_label_shift_and_masked_positions():
    ids = torch.tensor([[5, MASK, 7, MASK]])
    m = _carry_model(label_shift=True, positions="masked")
    norm = getattr(m.backbone, CARRY_MODULE)
    with torch.no_grad():
        norm.bias.fill_(1.0)
        carry = torch.zeros(1, 4, m.config.hidden_size)
        captured = {}
        hook = m.backbone.base_model.register_forward_pre_hook(lambda mod, a, kw: captured.update(kw), with_kwargs=True)
        m(ids, carry=carry)
        hook.remove()
    added = captured["inputs_embeds"] - m.backbone.get_input_embeddings()(ids)
    # LN(0) = bias = 1, shifted right by one (position 0 gets nothing), kept only where the token is the mask
    assert added[0, :, 0].tolist() == [0.0, 1.0, 0.0, 1.0]


def test_carry_model_save_load_roundtrip(tmp_path):
    m = _carry_model()
    with torch.no_grad():
        getattr(m.backbone, CARRY_MODULE).weight.normal_()
    m.save_pretrained(tmp_path / "m")
    back = load_model(tmp_path / "m")
    ids = torch.randint(3, VOCAB, (1, 6))
    carry = torch.randn(1, 6, m.config.hidden_size)
    with torch.no_grad():
        assert torch.allclose(back(ids, carry=carry), m(ids, carry=carry))


def _sampler_reference(model, prompt, gen_length, eos_id, u, seen=None):
    """One prompt, top-u, carry passed literally from step to step (zero at the first); `seen` collects each step's
    logits."""
    P, seq, nfe = len(prompt), list(prompt) + [MASK] * gen_length, 0
    carry = torch.zeros(1, P + gen_length, model.config.hidden_size)
    while True:
        region = seq[P:]
        if MASK not in region[: region.index(eos_id) if eos_id in region else gen_length]:
            break
        with torch.no_grad():
            logits, carry = model(torch.tensor([seq]), carry=carry, return_hidden=True)
        if seen is not None:
            seen.append(logits[0].clone())
        nfe += 1
        masked = [i for i in range(P, P + gen_length) if seq[i] == MASK]
        conf = {}
        for i in masked:
            row = logits[0, i].clone()
            row[MASK] = float("-inf")
            p = torch.softmax(row, -1)
            conf[i] = (float(p.max()), int(p.argmax()))
        for i in sorted(masked, key=lambda i: (-conf[i][0], i))[:u]:
            seq[i] = conf[i][1]
    region = seq[P:]
    return region[: region.index(eos_id)] if eos_id in region else region, nfe


def test_sampler_passes_the_carry_like_the_reference():
    m = _carry_model(seed=3, label_shift=True)
    g = G().manual_seed(3)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        getattr(m.backbone, CARRY_MODULE).weight.normal_(generator=g)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]]
    calls = []  # (canvas, logits) of every forward the batched sampler makes
    forward = m.forward

    def spy(ids, *a, **kw):
        out = forward(ids, *a, **kw)
        calls.append((ids.clone(), out[0].detach().clone()))
        return out

    m.forward = spy
    out = generate(m, prompts, 10, 99, PAD, MASK, policy="top_u", reveal_count=2)
    del m.forward
    P = max(map(len, prompts))
    for p, toks, nfe in zip(prompts, out.tokens, out.nfe):
        seen = []
        assert (toks, nfe) == _sampler_reference(m, p, 10, 99, 2, seen)
        # the numbers, not only the tokens picked from them: each step's logits of this row (left-padded in the
        # batch, finished rows dropped) equal the one-prompt reference's, carry included; index 0 is left out, it
        # predicts nothing under label shift (`align_logits` gives it an unused output, a pad's in a padded row).
        # Padding changes float rounding, and this random carry layer amplifies it ~4x a step (2.8e-3 at step 5 of
        # logits ~10): a misplaced or stale carry moves them by units.
        padded = torch.tensor([PAD] * (P - len(p)) + p)
        for k, want in enumerate(seen):
            ids, logits = calls[k]
            row = [r for r in range(len(ids)) if torch.equal(ids[r, :P], padded)]
            assert len(row) == 1, (p, k)
            assert torch.allclose(logits[row[0], P - len(p) + 1:], want[1:], rtol=1e-3, atol=1e-2), (p, k)
    # the carry matters: without it (fresh layer) the outputs differ
    with torch.no_grad():
        getattr(m.backbone, CARRY_MODULE).weight.zero_()
        getattr(m.backbone, CARRY_MODULE).bias.zero_()
    assert generate(m, prompts, 10, 99, PAD, MASK, policy="top_u", reveal_count=2).tokens != out.tokens


# ---- the objective: BPTT ----------------------------------------------------------------------------------------
def _objective(window, carry=True, **kw):
    cfg = ProgressiveConfig(window=window, carry=carry, reveal_count=2, threshold=0.9, **kw)
    obj = ProgressiveObjective(cfg, MASK, seed=0, rank=0, batch_size=3, grad_accum=1, max_length=12)
    obj.attach(_Stream(), _collate, 32 if carry else None)
    return obj


def _trained_carry_model():
    m = _carry_model(seed=5)
    with torch.no_grad():
        getattr(m.backbone, CARRY_MODULE).weight.normal_(generator=G().manual_seed(0))
    return m.train()


def _manual_window(model, pool, window, z_loss=1e-5, detach_between=False):
    """Algorithm 1 written out: W passes, each loss = Σ min(1/t,5)·CE + z·lse² over masked ∩ loss positions, / count,
    × fraction of active rows; the commit is the policy's top-2 plus all above 0.9 (ground truth); mean over passes."""
    from dlm.diffusion.masking import mdm_loss
    from dlm.diffusion.policies import confidences, top_u_or_threshold

    w = int(pool.lengths.max())  # the batch is cut to its longest canvas
    canvas, revealed = pool.canvas[:, :w].clone(), pool.revealed[:, :w].clone()
    carry = pool.carry[:, :w].clone()
    maskable, loss_mask, target = pool.maskable[:, :w], pool.loss_mask[:, :w], pool.target[:, :w]
    total = 0.0
    for _ in range(window):
        masked = maskable & ~revealed
        in_loss = masked & loss_mask
        logits, hidden = model(canvas, attention_mask=torch.ones_like(canvas), carry=carry, return_hidden=True)
        t = in_loss.sum(-1).float() / loss_mask.sum(-1).float()
        s, n = mdm_loss(logits, target, masked, loss_mask, t, 5.0, z_loss)
        total = total + s / n * in_loss.any(-1).float().mean()
        conf, _, _ = confidences(logits.detach(), MASK)
        reveal = top_u_or_threshold(conf, masked, 2, 0.9)
        canvas = torch.where(reveal, target, canvas)
        revealed = revealed | reveal
        carry = hidden.detach() if detach_between else hidden
    return total / window


def _grads(model, loss):
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_bptt_gradient_matches_hand_unrolled_window(checkpointing):
    model = _trained_carry_model()
    obj = _objective(window=3, activation_checkpointing=checkpointing)
    start = copy.deepcopy(obj.pool)
    loss, count, metrics = obj.loss(model)
    got = _grads(model, loss)
    assert metrics["passes"] == 3 and count.item() == 1
    ref_loss = _manual_window(model, start, 3)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    want = _grads(model, ref_loss)
    assert got.keys() == want.keys()
    for n in want:
        assert torch.allclose(got[n], want[n], rtol=1e-4, atol=1e-6), n
    # the gradient really flows through the carry: detaching it between passes changes the gradient
    cut = _grads(model, _manual_window(model, start, 3, detach_between=True))
    assert any(not torch.allclose(cut[n], want[n], rtol=1e-3, atol=1e-6) for n in want)
    # the stored carry is detached (the next window starts a new graph) and is the last pass's hidden state
    pool = obj.pool
    assert pool.carry.requires_grad is False
    live, fresh = pool.steps > 0, pool.steps == 0  # fresh rows were retired and refilled: zero carry
    assert (pool.carry[fresh] == 0).all() and all(pool.carry[i].abs().sum() > 0 for i in live.nonzero().flatten())


def test_window_one_equals_plain_pu_loss_and_carry_changes_nothing_at_init():
    """At W=1 with a fresh (zero) carry layer the loss equals PU without a carry."""
    torch.manual_seed(0)
    a = _objective(window=1, carry=True)
    b = _objective(window=1, carry=False)
    m_carry = _carry_model(seed=7).train()
    m_plain = tiny_model(VOCAB, attention="bidirectional", family="masked", seed=7).train()
    m_plain.spec = m_plain.spec.model_copy(update={"mask_token_id": MASK})
    for _ in range(4):
        la, _, _ = a.loss(m_carry)
        lb, _, _ = b.loss(m_plain)
        assert la.item() == pytest.approx(lb.item(), rel=1e-6)
        assert torch.equal(a.pool.canvas, b.pool.canvas)


def test_bridges_keep_the_forward_teacher_forced_but_change_the_gradient():
    plain = tiny_model(VOCAB, attention="bidirectional", family="masked", seed=9).train()
    plain.spec = plain.spec.model_copy(update={"mask_token_id": MASK})
    results = {}
    for bridge in ("none", "straight_through", "gumbel", "reinforce"):
        obj = _objective(window=2, carry=False, bridge=bridge)
        loss, _, _ = obj.loss(plain)
        results[bridge] = (loss.item(), _grads(plain, loss), obj.pool.canvas.clone())
    base_loss, base_grad, base_canvas = results["none"]
    for bridge in ("straight_through", "gumbel"):
        loss, grad, canvas = results[bridge]
        assert loss == pytest.approx(base_loss, rel=1e-6)  # forward unchanged (teacher forced)
        assert torch.equal(canvas, base_canvas)
        assert any(not torch.allclose(grad[n], base_grad[n], rtol=1e-4, atol=1e-7) for n in base_grad)
    loss, grad, _ = results["reinforce"]
    assert any(not torch.allclose(grad[n], base_grad[n], rtol=1e-4, atol=1e-7) for n in base_grad)


def test_reinforce_leave_one_out_advantages():
    obj = _objective(window=2, carry=False, bridge="reinforce", reinforce_weight=2.0)
    logp = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    reward = torch.tensor([1.0, 2.0, 6.0])
    term = obj._reinforce(logp, reward, torch.ones(3, dtype=torch.bool))
    term.backward()
    # baselines: mean of the others = 4, 3.5, 1.5 → raw advantages -3, -1.5, 4.5, std 3.9686 → normalised
    raw = torch.tensor([-3.0, -1.5, 4.5])
    adv = raw / raw.std()
    assert torch.allclose(logp.grad, -2.0 * adv / 3)


class _Spy(torch.nn.Module):
    """Wraps a model like DDP does (`.module`) and records the embeds_delta of every forward."""

    def __init__(self, inner):
        super().__init__()
        self.module, self.deltas = inner, []

    def forward(self, *args, **kwargs):
        self.deltas.append(kwargs.get("embeds_delta"))
        return self.module(*args, **kwargs)


def test_sampled_reinforce_feeds_the_next_pass_a_sample_and_keeps_the_pool_teacher_forced():
    """reinforce_sampled: pass 2 reads, at the positions pass 1 committed, the embedding of a token the model sampled
    (never the mask token), and nothing changed elsewhere; the pool itself commits the ground truth only."""
    inner = tiny_model(VOCAB, attention="bidirectional", family="masked", seed=9).train()
    inner.spec = inner.spec.model_copy(update={"mask_token_id": MASK})
    base = _objective(window=2, carry=False)
    start = copy.deepcopy(base.pool)
    base_loss, _, _ = base.loss(inner)
    first = _objective(window=1, carry=False)  # pass 1 alone: its reveal set
    first.loss(inner)
    obj = _objective(window=2, carry=False, bridge="reinforce_sampled")
    spy = _Spy(inner)
    loss, _, metrics = obj.loss(spy)
    assert metrics["passes"] == 2 and spy.deltas[0] is None
    pool = obj.pool
    assert torch.equal(pool.canvas[pool.revealed], pool.target[pool.revealed])  # teacher forced across windows
    delta = spy.deltas[1]
    width = delta.shape[1]
    committed = (first.pool.revealed & ~start.revealed)[:, :width]
    assert committed.any() and (pool.revealed[:, :width] | ~committed).all()  # pass 1's commits are the same
    assert not (delta.abs().sum(-1) > 0)[~committed].any()  # nothing outside pass 1's commits
    weight = inner.backbone.get_input_embeddings().weight.detach()
    target = start.target[:, :width]
    read = weight[target] + delta  # what pass 2 reads at each position
    dist = torch.cdist(read[committed], weight)  # a sampled token's own embedding: distance 0 to its row
    token = dist.argmin(-1)
    assert torch.allclose(dist.min(-1).values, torch.zeros(len(token)), atol=1e-4)
    assert (token != MASK).all() and (token != target[committed]).any()  # an untrained model's samples, not the truth
    assert loss.item() != pytest.approx(base_loss.item(), rel=1e-6)  # so pass 2 computes something else


def test_sampled_reinforce_score_has_no_drift_and_samples_the_model_distribution():
    """E_a[grad log p(a)] = 0 when a ~ p (the mask token excluded): averaged over 4,000 draws it is ~0 (< 0.02 per
    logit), where the score of a fixed token (the teacher-forced reading, `reinforce`) has mean 1 - p on that token.
    The draws' frequencies match softmax without the mask token."""
    from dlm.training.objectives.bridges import SampledReinforceBridge, gumbel_noise

    bridge = SampledReinforceBridge(1.0)
    logits = torch.tensor([[[2.0, 0.5, 3.0, -1.0, 1.0]]], requires_grad=True)  # token 2 (most likely) is the mask
    weight, targets, n = torch.randn(5, 4), torch.tensor([[1]]), 4000
    g = G().manual_seed(0)
    grads, counts = torch.zeros(5), torch.zeros(5)
    for _ in range(n):
        logp, delta = bridge.from_logits(logits, gumbel_noise((1, 1, 5), g, "cpu"), weight, targets, mask_id=2)
        (grad,) = torch.autograd.grad(logp.sum(), logits)
        grads += grad[0, 0]
        read = (weight[targets] + delta)[0, 0]  # the embedding the next pass reads
        token = int((read - weight).abs().sum(-1).argmin())
        counts[token] += 1
    p = torch.softmax(torch.tensor([2.0, 0.5, float("-inf"), -1.0, 1.0]), -1)
    assert counts[2] == 0 and torch.allclose(counts / n, p, atol=0.025)
    assert grads.div(n).abs().max() < 0.02
    fixed = torch.log_softmax(logits.detach().masked_fill(torch.arange(5) == 2, float("-inf")), -1)
    assert 1 - fixed[0, 0, 1].exp() > 0.8  # the fixed token's score would have mean ~0.9 on its own logit


def test_student_forcing_schedule_and_commits():
    assert student_forcing_ratio(500, k=100.0, floor=0.1, warmup=1000) == 1.0
    assert student_forcing_ratio(1000, k=100.0, floor=0.1, warmup=1000) == pytest.approx(100 / 101)
    assert (student_forcing_ratio(1000 + 460, k=100.0, floor=0.1, warmup=1000)
            == pytest.approx(100 / (100 + 99.484), rel=1e-3))
    assert student_forcing_ratio(10**9, k=100.0, floor=0.1, warmup=0) == 0.1
    # eps = floor 0 with no warm-up: committed tokens are the model's argmax, not the ground truth
    obj = _objective(window=1, carry=False, student_forcing_k=1e-3, student_forcing_floor=0.0, student_forcing_warmup=0)
    plain = tiny_model(VOCAB, attention="bidirectional", family="masked", seed=9)
    plain.spec = plain.spec.model_copy(update={"mask_token_id": MASK})
    obj.loss(plain)
    committed = obj.pool.revealed
    assert (obj.pool.canvas[committed] != obj.pool.target[committed]).any()


def test_pu_plus_pool_visits_disjoint_rows_in_turn():
    obj = _objective(window=1, carry=False, pool_factor=3)
    assert obj.pool.size == 9
    plain = tiny_model(VOCAB, attention="bidirectional", family="masked", seed=9)
    plain.spec = plain.spec.model_copy(update={"mask_token_id": MASK})
    touched = []
    for _ in range(3):
        before = obj.pool.steps.clone()
        obj.loss(plain)
        touched.append(set((obj.pool.steps != before).nonzero().flatten().tolist()))
    assert touched == [{0, 1, 2}, {3, 4, 5}, {6, 7, 8}]


def test_loss_weight_uses_realised_fraction_and_active_rescale():
    """A pool where one row has retired mid-window: the pass loss is scaled by the active fraction."""
    obj = _objective(window=1, carry=False)
    pool = obj.pool
    pool.done[0] = True
    plain = tiny_model(VOCAB, attention="bidirectional", family="masked", seed=9)
    plain.spec = plain.spec.model_copy(update={"mask_token_id": MASK})
    snapshot = copy.deepcopy(pool)
    loss, _, metrics = obj.loss(plain)
    assert metrics["active_fraction"] == pytest.approx(2 / 3)
    w = int(snapshot.lengths.max())
    assert w < snapshot.length  # the pass ran on the longest canvas of the chunk, not the pool's full width
    with torch.no_grad():
        canvas, target, loss_mask = snapshot.canvas[:, :w], snapshot.target[:, :w], snapshot.loss_mask[:, :w]
        logits = plain(canvas, attention_mask=torch.ones_like(canvas))
        masked = (snapshot.maskable & ~snapshot.revealed)[:, :w] & ~snapshot.done[:, None]
        in_loss = masked & loss_mask
        lse = torch.logsumexp(logits.float(), -1)
        ce = lse - logits.float().gather(-1, target[..., None]).squeeze(-1)
        t = in_loss.sum(-1).float() / loss_mask.sum(-1).float()
        w = torch.where(in_loss.any(-1), loss_weight(t.clamp(min=1e-6)), 0.0)
        want = ((w[:, None] * ce + 1e-5 * lse ** 2) * in_loss).sum() / in_loss.sum() * (2 / 3)
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)


# ---- mask discrepancy -------------------------------------------------------------------------------------------
def test_mmd_estimator_hand_cases():
    from dlm.evaluation.mask_discrepancy import mdm_masks, mmd2

    inf = torch.tensor([True, True, False, False])
    same = inf.repeat(5, 1)
    assert mmd2(same, inf, sigma=0.8) == pytest.approx(0.0, abs=1e-6)  # training = inference: zero
    other = torch.tensor([[False, False, True, True], [False, False, True, True]])
    k = torch.exp(torch.tensor(-4 / 0.8)).item()
    assert mmd2(other, inf, sigma=0.8) == pytest.approx(1 + 1 - 2 * k, rel=1e-6)
    # random MDM masks are further from a fixed left-to-right mask than copies of it, and have the right size
    masks = mdm_masks(20, 0.3, 32, G().manual_seed(0))
    assert (masks.sum(-1) == 6).all()
    ltr = torch.arange(20) >= 14
    assert mmd2(masks, ltr, 4.0) > mmd2(ltr.repeat(32, 1), ltr, 4.0) + 0.1


def test_mask_discrepancy_runs_for_mdm_and_pu(tiny_tokenizer):
    from dlm.evaluation.mask_discrepancy import mask_discrepancy

    tok = tiny_tokenizer
    m = tiny_model(len(tok), attention="bidirectional", family="masked", seed=0)
    m.spec = m.spec.model_copy(update={"mask_token_id": tok.mask_token_id})
    records = [{"prompt": f"Mia has {i} apples.", "response": f"def solution():\n    return {i}"} for i in range(3)]
    mdm = mask_discrepancy(m, tok, records, "mdm", n_train=8, n_problems=3, progress=False)
    pu = mask_discrepancy(m, tok, records, "pu", construction=StageConstruction(4, 0.9), n_train=8, n_problems=3,
                          progress=False)
    for res in (mdm, pu):
        vals = [v for v in res["d_mask"].values() if v is not None]
        assert len(vals) >= 5 and all(-0.2 < v <= 2.0 for v in vals)
    assert mdm["problems_per_t"]["0.5"] == 3
    # the PU pools' budget bounds the construction's forward passes: 1 pool x 3 steps per problem
    calls = []
    m.register_forward_hook(lambda *a: calls.append(1))
    mask_discrepancy(m, tok, records[:1], "pu", construction=StageConstruction(4, 0.9), n_train=64, n_problems=1,
                     progress=False, pools=1, steps=3)
    inference = len(calls) - 3
    calls.clear()
    mask_discrepancy(m, tok, records[:1], "pu", construction=StageConstruction(4, 0.9), n_train=64, n_problems=1,
                     progress=False, pools=2, steps=3)
    assert len(calls) - inference == 6 and inference > 0
    # each problem's own values average to the reported D_mask(t) (for paired comparisons between runs)
    for res in (mdm, pu):
        assert len(res["per_problem"]) == 3 and all(len(v) == 9 for v in res["per_problem"])
        for i, t in enumerate(res["d_mask"]):
            vals = [v[i] for v in res["per_problem"] if v[i] is not None]
            assert len(vals) == res["problems_per_t"][t]
            if vals:
                assert sum(vals) / len(vals) == pytest.approx(res["d_mask"][t], rel=1e-9)


def test_pu_plus_random_initial_masking_and_loss_balance():
    # random initial masking: fresh trajectories start with a spread of revealed fractions (not all fully masked)
    c = ThresholdConstruction(2, 0.9, random_initial_masking=True)
    maskable = torch.ones(64, 20, dtype=torch.bool)
    revealed, _ = c.start(maskable, G().manual_seed(0))
    frac = revealed.float().mean(-1)
    assert frac.min() < 0.15 and frac.max() > 0.85 and 0.35 < frac.mean() < 0.65
    # Eq. F.2 with lambda = 1: the pass loss is the mean CE over the positions this step reveals, nothing else
    plain = tiny_model(VOCAB, attention="bidirectional", family="masked", seed=9)
    plain.spec = plain.spec.model_copy(update={"mask_token_id": MASK})
    obj = _objective(window=1, carry=False, balance_lambda=1.0)
    snapshot = copy.deepcopy(obj.pool)
    loss, _, _ = obj.loss(plain)
    w = int(snapshot.lengths.max())
    revealed_now = (obj.pool.revealed & ~snapshot.revealed)[:, :w]
    with torch.no_grad():
        canvas = snapshot.canvas[:, :w]
        logits = plain(canvas, attention_mask=torch.ones_like(canvas)).float()
        lse = torch.logsumexp(logits, -1)
        ce = lse - logits.gather(-1, snapshot.target[:, :w, None]).squeeze(-1)
        in_loss = (snapshot.maskable & ~snapshot.revealed & snapshot.loss_mask)[:, :w]
        sel = revealed_now & in_loss
        want = (ce * sel).sum() / sel.sum() + 1e-5 * (lse ** 2 * in_loss).sum() / in_loss.sum()
    assert sel.any() and loss.item() == pytest.approx(want.item(), rel=1e-5)


def test_fast_confidences_match_the_policy_definition():
    from dlm.diffusion.policies import confidences
    from dlm.training.objectives.pu_pass import fast_confidences

    logits = torch.randn(3, 7, VOCAB, generator=G().manual_seed(0)) * 3
    logits[0, 0, MASK] = 20.0  # the mask token is the argmax here: the next best is taken
    want_conf, want_tok, _ = confidences(logits, MASK)
    conf, tok = fast_confidences(logits, torch.logsumexp(logits, -1), MASK)
    assert torch.equal(tok, want_tok) and torch.allclose(conf, want_conf, rtol=1e-4, atol=1e-6)
