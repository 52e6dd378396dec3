"""RL post-training (`train.objective: grpo`): each likelihood estimator against exact enumeration of its masks on a
tiny model, a rewarded completion's likelihood rising under the policy loss (and a penalised one's falling), rewards
whose failures score 0 and are counted, and the recipe section's refusals."""

import itertools
import json
import math
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from dlm.config import Recipe, RecipeError, RewardTerm, load_recipe
from dlm.evaluation.rewards import Rewards, has_solution
from dlm.training.objectives.grpo import GRPOObjective, Rollout
from dlm.training.objectives.likelihood import Completions, Draw, draw, token_logps
from tests.conftest import perturb, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

MASK, PAD, VOCAB = 3, 0, 40
PROMPTS = [[5, 9, 11], [5, 9, 11], [12, 13]]
CANVAS = torch.tensor([[7, 8, 20, 2], [21, 6, 2, 2], [30, 31, 32, 33]])  # 2 = EOS filler after the first EOS
SCORED = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
GROUPS = torch.tensor([0, 0, 1])


def _comp() -> Completions:
    return Completions([list(p) for p in PROMPTS], CANVAS.clone(), SCORED.clone(), GROUPS.clone())


def _masked(block: bool):
    extra = {"block_size": 2} if block else {}
    return perturb(tiny_model(VOCAB, "block_causal" if block else "bidirectional", "masked", label_shift=True,
                              mask_token_id=MASK, **extra))


def _row_logp(model, prompt, canvas_row, noised_row) -> torch.Tensor:
    """log p(canvas token) at every canvas position of one row whose canvas is `noised_row` (the slow reference:
    one row, no padding, no batching)."""
    from dlm.evaluation.elbo import masked_logits

    logits = masked_logits(model, [prompt + noised_row], [len(prompt)], PAD, MASK, [prompt + canvas_row])[0]
    logp = torch.log_softmax(logits[len(prompt):len(prompt) + len(canvas_row)].float(), -1)
    return logp.gather(-1, torch.tensor(canvas_row)[:, None]).squeeze(-1)


def _subsets(positions):
    """Every non-empty subset of `positions` with its probability under `sample_masks` (level l uniform on 1..n,
    then a uniform subset of size l) and its weight n/l."""
    n = len(positions)
    for size in range(1, n + 1):
        for s in itertools.combinations(positions, size):
            yield set(s), 1 / (n * math.comb(n, size)), n / size


def _exact_bounds(model, block: int | None, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token (ELBO term, SPG upper-bound term) by enumerating every mask (independent per block)."""
    W = CANVAS.shape[1]
    blocks = [list(range(b, min(b + block, W))) for b in range(0, W, block)] if block else [list(range(W))]
    elbo, power = torch.zeros(CANVAS.shape, dtype=torch.float64), torch.zeros(CANVAS.shape, dtype=torch.float64)
    for combo in itertools.product(*[list(_subsets(b)) for b in blocks]):
        masked = set().union(*(s for s, _, _ in combo))
        prob = math.prod(p for _, p, _ in combo)
        weight = {i: w for s, _, w in combo for b in blocks if set(b) & s for i in b}
        for r, (prompt, row) in enumerate(zip(PROMPTS, CANVAS.tolist())):
            noised = [MASK if i in masked else t for i, t in enumerate(row)]
            logp = _row_logp(model, prompt, row, noised).double()
            for i in masked:
                elbo[r, i] += prob * weight[i] * logp[i]
                power[r, i] += prob * weight[i] * torch.exp(beta * logp[i])
    return elbo * SCORED, torch.log(power) / beta * SCORED


@pytest.mark.parametrize("block", [None, 2])
def test_elbo_and_spg_estimates_converge_to_their_exact_enumeration(block):
    model = _masked(block is not None)
    exact_elbo, exact_upper = _exact_bounds(model, block, beta=1.5)
    assert (exact_upper >= exact_elbo - 1e-9).all()  # the sandwich, per token, in expectation (Jensen)
    comp = _comp()
    with torch.no_grad():  # the Monte-Carlo ELBO: unbiased, so its mean over many keys meets the enumeration
        draws = torch.stack([token_logps(model, comp, "elbo", draw("elbo", comp, (0, k), mc_num=2, block_size=block),
                                         pad_id=PAD, mask_id=MASK) for k in range(300)]).double()
    se = draws.std(0) / math.sqrt(len(draws)) + 1e-6
    assert ((draws.mean(0) - exact_elbo).abs() <= 4.5 * se).all(), (draws.mean(0), exact_elbo)
    many = draw("spg", comp, (0, 1), mc_num=4000, block_size=block)  # the upper bound: log of a mean, consistent
    negative = torch.tensor([True, True, False])
    with torch.no_grad():
        spg = token_logps(model, comp, "spg", many, pad_id=PAD, mask_id=MASK, negative=negative, spg_mix=1.0)
    torch.testing.assert_close(spg[:2].double(), exact_upper[:2], atol=0.05, rtol=0)
    torch.testing.assert_close(spg[2].double(), exact_elbo[2], atol=0.15, rtol=0)  # positive rows: the ELBO


def test_mean_field_estimate_converges_to_its_enumeration_over_prompt_masks():
    model, p = _masked(False), 0.3
    exact = torch.zeros(CANVAS.shape, dtype=torch.float64)
    for r, (prompt, row) in enumerate(zip(PROMPTS, CANVAS.tolist())):
        for bits in itertools.product([False, True], repeat=len(prompt)):
            prob = math.prod(p if b else 1 - p for b in bits)
            noised_prompt = [MASK if b else t for b, t in zip(bits, prompt)]
            logits_row = _row_logp(model, noised_prompt, row, [MASK] * len(row)).double()
            exact[r] += prob * logits_row
    exact *= SCORED
    comp = _comp()
    with torch.no_grad():
        draws = torch.stack([token_logps(model, comp, "mean_field", draw("mean_field", comp, (0, k),
                                                                         prompt_mask_prob=p),
                                         pad_id=PAD, mask_id=MASK) for k in range(300)]).double()
    se = draws.std(0) / math.sqrt(len(draws)) + 1e-6
    assert ((draws.mean(0) - exact).abs() <= 4.5 * se).all()
    # rows of one group share their prompt mask (common random numbers), other groups draw their own
    masks = [draw("mean_field", comp, (0, k), prompt_mask_prob=0.5).prompt_masks for k in range(20)]
    assert all(torch.equal(m[0], m[1]) for m in masks)
    assert any(not torch.equal(m[0][:2], m[2][:2]) for m in masks)


def test_exact_estimator_of_an_ar_policy_is_its_log_likelihood():
    from dlm.evaluation.elbo import ar_loglikelihood

    model = perturb(tiny_model(VOCAB))
    comp = _comp()
    with torch.no_grad():
        per_token = token_logps(model, comp, "exact", Draw(), pad_id=PAD)
    n = SCORED.sum(-1).tolist()
    want = ar_loglikelihood(model, [(p, CANVAS[i, : n[i]].tolist()) for i, p in enumerate(PROMPTS)], pad_id=PAD)
    torch.testing.assert_close(per_token.sum(-1), torch.tensor([w for w, _ in want]), atol=1e-4, rtol=0)
    assert (per_token[~SCORED] == 0).all()


def _objective(estimator: str, family: str = "masked", inner_steps: int = 1, kl: float = 0.0) -> GRPOObjective:
    recipe = Recipe.model_validate({"model": {"init_from": "start"}, "train": {"objective": "grpo", "batch_size": 4},
                                    "rl": {"family": family, "estimator": estimator, "group_size": 2,
                                           "inner_steps": inner_steps, "reference": "frozen" if kl else "none",
                                           "kl_beta": kl, "mc_num": 4}})
    return GRPOObjective(recipe)


@pytest.mark.parametrize("estimator,family", [("mean_field", "masked"), ("elbo", "masked"), ("spg", "masked"),
                                              ("exact", "autoregressive")])
def test_the_policy_loss_raises_the_rewarded_completion_and_lowers_the_penalised_one(estimator, family):
    """One group of two completions of the same prompt, rewards 1 and 0: a few steps on the GRPO loss raise the
    exact (enumerated) ELBO, or the AR log-likelihood, of the rewarded one and lower the other's."""
    model = perturb(tiny_model(VOCAB)) if family == "autoregressive" else _masked(False)
    model.train()
    obj = _objective("mean_field" if estimator == "exact" else estimator, family)
    obj.model, obj.tok, obj.block = model, SimpleNamespace(pad_token_id=PAD), None
    comp = Completions([PROMPTS[0], PROMPTS[0]], CANVAS[:2].clone(), SCORED[:2].clone(), torch.tensor([0, 0]))
    adv = torch.tensor([1.0, -1.0])  # rewards (1, 0) normalised in their group
    obj.buffer[0] = Rollout(0, comp, adv, None, {})

    def score():
        with torch.no_grad():
            if family == "autoregressive":
                return token_logps(model, comp, "exact", Draw(), pad_id=PAD).sum(-1)
            model.eval()
            elbo = _exact_bounds_rows(model, comp)
            model.train()
            return elbo
    before = score()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(4):  # the same rollouts each time (a cycle's first step would sample new ones)
        loss, count, metrics = obj.loss(model, None, {"micro": 0, "inner": 0})
        opt.zero_grad()
        (loss / count).backward()
        opt.step()
    after = score()
    assert after[0] > before[0] + 0.05 and after[1] < before[1] - 0.05, (before, after)
    assert metrics["rl/clip_frac"] == 0.0 and count == SCORED[:2].sum()


def _exact_bounds_rows(model, comp) -> torch.Tensor:
    """Σ over scored tokens of the exact ELBO term of each row of `comp` (full canvas)."""
    W = comp.canvas.shape[1]
    total = torch.zeros(len(comp.prompts), dtype=torch.float64)
    for masked, prob, weight in _subsets(list(range(W))):
        for r, (prompt, row) in enumerate(zip(comp.prompts, comp.canvas.tolist())):
            logp = _row_logp(model, prompt, row, [MASK if i in masked else t for i, t in enumerate(row)]).double()
            total[r] += sum(prob * weight * logp[i] for i in masked if comp.scored[r, i])
    return total


def test_inner_steps_use_the_sampling_policy_as_old_and_clip():
    """With μ = 2 the second step's ratio is against the policy that sampled: after a large first step some tokens
    leave the trust region and are clipped (their gradient is zero)."""
    model = _masked(False).train()
    obj = _objective("mean_field", inner_steps=2)
    obj.model, obj.tok, obj.block = model, SimpleNamespace(pad_token_id=PAD), None
    comp = Completions([PROMPTS[0], PROMPTS[0]], CANVAS[:2].clone(), SCORED[:2].clone(), torch.tensor([0, 0]))
    adv = torch.tensor([1.0, -1.0])
    obj.buffer[0] = Rollout(0, comp, adv, None, {})
    obj.buffer[0].old = obj._old_logps(model, comp, adv, 0)
    opt = torch.optim.SGD(model.parameters(), lr=2.0)
    first = obj.loss(model, None, {"micro": 0, "inner": 0})
    assert first[2]["rl/clip_frac"] == 0.0  # step 0: the policy is the sampling policy
    opt.zero_grad()
    (first[0] / first[1]).backward()
    opt.step()
    second = obj.loss(model, None, obj.plan(None, 1, 0))
    assert second[2]["rl/clip_frac"] > 0.0


def test_rewards_score_failures_zero_and_count_them():
    records = [{"prompt": "p", "answer": 3}] * 4
    completions = ["def solution():\n    return 3", "def solution():\n    return 4",
                   "def solution():\n    while True:\n        pass", "def solution(:"]
    terms = [RewardTerm(name="tinymath"), RewardTerm(name="format", weight=0.5),
             RewardTerm(name="reward_model", path="/nonexistent/reward-model")]
    scores = Rewards(terms, timeout=0.5)(records, completions)
    assert scores.terms["tinymath"] == [1.0, 0.0, 0.0, 0.0]
    assert scores.terms["format"] == [1.0, 1.0, 1.0, 0.0]
    assert scores.failures["tinymath"] == 1  # the loop that ran out of time, not the wrong answer
    assert scores.terms["reward_model"] == [0.0] * 4 and scores.failures["reward_model"] == 4  # it raised
    assert scores.total == [1.5, 0.5, 0.5, 0.0]
    assert has_solution("def solution():\n    return 1") and not has_solution("x = 1")


def test_rl_section_refusals(tmp_path):
    base = {"model": {"init_from": "start"}, "train": {"objective": "grpo", "batch_size": 16}}
    with pytest.raises(ValueError, match="multiple of rl.group_size"):
        Recipe.model_validate(base | {"train": {"objective": "grpo", "batch_size": 12}})
    with pytest.raises(ValueError, match="set train.lora"):
        Recipe.model_validate(base | {"rl": {"reference": "adapters"}})
    with pytest.raises(ValueError, match="rl.kl_beta: 0"):
        Recipe.model_validate(base | {"rl": {"reference": "none"}})
    with pytest.raises(ValueError, match="only apply to train.objective grpo"):
        Recipe.model_validate({"rl": {"group_size": 4}})
    with pytest.raises(ValueError, match="post-trains a model"):
        Recipe.model_validate({"train": {"objective": "grpo", "batch_size": 16}, "rl": {"reference": "frozen"}})
    bad = tmp_path / "r.yaml"
    bad.write_text("model: {init_from: x}\ntrain: {objective: grpo, batch_size: 16}\nrl: {estimator: exactly}\n")
    with pytest.raises(RecipeError, match="rl.estimator"):
        load_recipe(bad)


@pytest.fixture(scope="module")
def starts(tmp_path_factory):
    """(a nano MDM policy, a nano Bradley-Terry reward model, the data dir): 2 updates each on tinymath easy."""
    from dlm.training.loop import train
    from tests.test_training import small_recipe

    root = tmp_path_factory.mktemp("rl")
    data = root / "data"
    policy = train(small_recipe(root / "mdm", data, "train.steps=2", "train.objective=mdm",
                                "model.attention=bidirectional", "data.n_test=2"), progress=False)
    reward = train(small_recipe(root / "reward", data, "train.steps=2", "train.objective=reward",
                                "data.preference_pairs=true", "data.n_test=2"), progress=False)
    block = train(small_recipe(root / "block", data, "train.steps=2", "train.objective=mdm", "model.label_shift=true",
                               "model.attention=block_causal", "model.block_size=4", "data.n_test=2"), progress=False)
    ar = train(small_recipe(root / "ar", data, "train.steps=2", "data.n_test=2"), progress=False)
    return policy / "model", reward / "model", data, block / "model", ar / "model"


def grpo_recipe(out, starts, *extra):
    """A GRPO run from the nano MDM, rewarded by the nano reward model (varied scores from an untrained policy)."""
    from tests.test_training import small_recipe

    policy, reward, data = starts[:3]
    return small_recipe(out, data, "train.objective=grpo", "model.attention=bidirectional",
                        f"model.init_from={policy}", "train.batch_size=4", "rl.group_size=2",
                        "rl.reference=frozen", "rl.max_new_tokens=8", "rl.estimator=elbo", "rl.inner_steps=2",
                        f"rl.reward=[{{name: reward_model, path: {reward}}}, {{name: tinymath}}]",
                        "eval.policy=top_u", "eval.reveal_count=2", "data.n_test=2", "train.checkpoint_every=100",
                        *extra)


def test_grpo_resumes_exactly_in_the_middle_of_a_cycle(starts, tmp_path):
    """Stopped after update 1 of a μ = 2 cycle, the run resumes with the cycle's rollouts from its checkpoint and
    follows the uninterrupted run exactly (rollouts, rewards, prompts, reference, optimizer)."""
    from dlm.config import load_recipe
    from dlm.training.loop import train
    from tests.test_resume import lrs
    from tests.test_training import losses

    full = train(grpo_recipe(tmp_path / "full", starts, "train.steps=4"), progress=False)
    cut = train(grpo_recipe(tmp_path / "cut", starts, "train.steps=4", "train.max_minutes=1e-9"), progress=False)
    assert len(losses(cut)) == 1
    step1 = torch.load(cut / "checkpoints" / "step_0000001" / "data_rank0.pt", weights_only=False)["objective"]
    assert step1["buffer"][0]["cycle"] == 0 and step1["buffer"][0]["old"] is not None  # mid-cycle rollouts kept
    train(load_recipe(cut / "recipe.yaml", ["train.max_minutes=1000"]), resume=True, progress=False)
    records = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    again = [json.loads(line) for line in (cut / "metrics.jsonl").read_text().splitlines()]
    assert losses(cut) == losses(full) and lrs(cut) == lrs(full)
    assert [r["rl/reward"] for r in again] == [r["rl/reward"] for r in records]
    assert records[0]["rl/reward"] != records[2]["rl/reward"]  # update 2 sampled new rollouts
    assert records[1]["rl/kl"] > 0 and records[0]["rl/reward_group_std"] > 0  # the policy moved; rewards vary
    a, b = (load_file(r / "model" / "model.safetensors") for r in (full, cut))
    assert all(torch.equal(a[k], b[k]) for k in a)


LAYOUTS = {  # each policy layout and estimator with the loop's options: LoRA (its base as the reference), bf16 and
    # activation checkpointing on a block-causal policy (KV-cached rollouts), an AR policy (exact likelihood)
    "lora-mean_field": ["rl.estimator=mean_field", "train.lora={r: 4}", "rl.reference=adapters"],
    "block-spg-bf16": ["model.attention=block_causal", "model.block_size=4", "model.label_shift=true",
                       "rl.estimator=spg", "train.precision=bf16", "train.activation_checkpointing=true"],
    "ar-exact": ["model.attention=causal", "rl.family=autoregressive"],
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_grpo_trains_every_policy_layout(starts, tmp_path, layout):
    from tests.test_training import losses

    init = {"block-spg-bf16": starts[3], "ar-exact": starts[4]}.get(layout, starts[0])
    run = train_grpo(grpo_recipe(tmp_path / layout, starts, "train.steps=3", "rl.inner_steps=1",
                                 f"model.init_from={init}", *LAYOUTS[layout]))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses(run)) == 3 and all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in records)
    assert records[0]["rl/kl"] == pytest.approx(0.0, abs=1e-6)  # the first update's policy is its reference
    assert records[-1]["rl/kl"] > 0 and records[0]["rl/reward_group_std"] > 0
    assert (run / "model" / "dlm.json").is_file() and (run / "training_curve.png").is_file()


def train_grpo(recipe):
    from dlm.training.loop import train

    return train(recipe, progress=False)


def test_a_groups_reward_model_scores_do_not_depend_on_the_other_groups(starts):
    """batch_size = G (what GRPO passes): a prompt's completions are one batch of their own, so their scores are the
    same bits whichever prompts share the update; a group of near-tied rewards would otherwise see float noise."""
    from dlm.config import RewardTerm
    from dlm.evaluation.rewards import Rewards

    long = "A farmer has 120 sheep, sells 45, buys 30 more and then gives 12 away. How many are left? " * 3
    records = [{"prompt": "Tom has 7 pens and buys 5 more. How many pens does he have?"}] * 2 + [{"prompt": long}] * 2
    texts = ["def solution():\n    return 7 + 5", "def solution():\n    return 7 - 5",
             "def solution():\n    total = 120 - 45 + 30 - 12\n    return total" * 2, "x = 1"]
    rewards = Rewards([RewardTerm(name="reward_model", path=str(starts[1]))], batch_size=2)
    together, alone = rewards(records, texts), rewards(records[:2], texts[:2])
    assert together.failures["reward_model"] == 0 and together.total[:2] == alone.total  # bit for bit
    assert together.total[0] != together.total[1]  # the scores are real, not a constant


def test_answer_reward_reads_the_final_answer_without_running_anything():
    records = [{"prompt": "p", "answer": 1234}, {"prompt": "p", "answer": 42}, {"prompt": "p", "answer": 7.5},
               {"prompt": "p", "answer": 8}, {"prompt": "p", "answer": 3}]
    completions = ["12 + 1222 so \\boxed{1,234}.", "it is 41.\n#### 42", "first 5, then 7.5", "7 apples",
                   "import os; os.system('echo 3')"]
    scores = Rewards([RewardTerm(name="answer")])(records, completions)
    assert scores.terms["answer"] == [1.0, 1.0, 1.0, 0.0, 1.0] and scores.failures["answer"] == 0


def test_dry_run_counts_grpo_passes_reference_and_rollouts():
    """elbo/spg: mc_num passes per completion; a frozen reference: one more copy of the weights; rollouts: their
    forwards once per cycle (fewer FLOPs per update as rl.inner_steps grows)."""
    from pathlib import Path

    from dlm.training.dryrun import estimate

    path = Path(__file__).resolve().parents[1] / "recipes" / "scale" / "llada8b-grpo-lora.yaml"
    base = estimate(load_recipe(path), path)
    assert base["memory_bytes"]["reference"] == 0  # the LoRA base is the reference
    frozen = estimate(load_recipe(path, ["rl.reference=frozen"]), path)
    assert frozen["memory_bytes"]["reference"] == pytest.approx(2 * frozen["parameters"]["total"])
    elbo = estimate(load_recipe(path, ["rl.estimator=elbo", "rl.mc_num=4"]), path)
    assert elbo["micro_batch"]["sequences"] == 4 * base["micro_batch"]["sequences"]
    once = estimate(load_recipe(path, ["rl.inner_steps=1"]), path)
    assert once["flops_per_update"] > base["flops_per_update"]  # the recipe's mu = 4 shares each rollout


def test_unit_test_reward_runs_the_records_tests_in_the_sandbox():
    record = {"prompt": "def add(a, b):\n", "test": "def check(f):\n    assert f(1, 2) == 3\n", "entry_point": "add"}
    completions = ["    return a + b\n", "    return a - b\n", "    import socket\n    return 3\n"]
    scores = Rewards([RewardTerm(name="unit_tests")])([record] * 3, completions)
    assert scores.terms["unit_tests"] == [1.0, 0.0, 0.0] and scores.failures["unit_tests"] == 0


def test_grpo_refuses_a_start_of_another_family(starts, tmp_path):
    from dlm.errors import DlmError

    with pytest.raises(DlmError, match="rl.family is masked, but .* is of family autoregressive: set rl.family"):
        train_grpo(grpo_recipe(tmp_path / "x", starts, "train.steps=1", f"model.init_from={starts[4]}",
                               "model.attention=causal"))
