"""Device bugs in the training objectives seen on a CPU-only machine (issue 43): each objective's plan, loss and
backward run with the model on the fake accelerator (`tests.fake_device`) and the batch moved there, as the training
loop's accelerate moves it, and must give the CPU's loss, counts, metrics and gradients. Per-example noise drawn on
CPU generators and the PU trajectory pool are CPU-side by design and reach the model's device by explicit transfers,
which the fake device allows; a tensor made without `device=` that meets the model's tensors fails here as on a GPU.
PU across ranks runs on simulated collectives that check their backend's device. The last tests plant such bugs in
the objectives' source and see the check fail; a static rule over the objectives' factory calls is the cheap
complement."""

import __future__

import ast
import inspect
import sys
import textwrap
from collections import Counter

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from dlm.config import ProgressiveConfig
from dlm.data.canvas import Example, collate, collate_pairs
from dlm.data.ul2 import STRATEGIES as UL2_STRATEGIES
from dlm.modeling.carry import CARRY_MODULE
from tests.conftest import perturb, tiny_model
from tests.fake_device import FAKE, OnAccelerator, fake_accelerator, to_accelerator
from tests.test_device_check import reads_source

pytestmark = pytest.mark.usefixtures("one_thread")
PAD, EOS, MASK, VOCAB, BLOCK = 0, 1, 2, 40, 4
EXAMPLES = [Example([5, 6, 7], [8, 9]), Example([5], [8, 9, 10, 11]), Example([12, 13, 14, 15], [16])]


def batch(block_size=None, pairs=False):
    """A collated batch as the trainer's stream gives it (with `example_id`, which keys the per-example noise)."""
    if pairs:  # reward models: chosen canvases, then the rejected ones
        b = collate_pairs([(EXAMPLES[0], EXAMPLES[1]), (EXAMPLES[2], Example([5], [9]))], EOS, PAD)
    else:
        b = collate(EXAMPLES, EOS, PAD, block_size=block_size)
    return b | {"example_id": torch.arange(10, 10 + b["input_ids"].shape[0])}


def masked(attention="bidirectional", carry=False, label_shift=False, **spec):
    """A perturbed tiny masked model (spread confidences: the PU commits are not near-ties) in training mode; its
    carry layer away from the identity, so the carry reaches the outputs."""
    m = tiny_model(VOCAB, attention, "masked", label_shift=label_shift, carry=carry, mask_token_id=MASK,
                   eos_token_id=EOS, seed=1, **spec)
    perturb(m)
    if carry:
        with torch.no_grad():
            getattr(m.backbone, CARRY_MODULE).weight.normal_(1, 1, generator=torch.Generator().manual_seed(7))
    return m.train()


def checkpointed():
    """train.activation_checkpointing: every decoder layer recomputed in the backward."""
    m = masked()
    m.enable_activation_checkpointing()
    return m


def simplex():
    from tests.test_simplex import simplex_model

    return perturb(simplex_model(vocab=VOCAB)).train()


def reward():
    from tests.test_guidance import reward_model

    return perturb(reward_model(VOCAB)).train()


def cpu_data(t: torch.Tensor) -> torch.Tensor:
    return t.inner if isinstance(t, OnAccelerator) else t


def train_on_both(build, steps):
    """steps(model, device) -> a list of numbers (losses, counts, metrics) and tensors (state), with the backward of
    each loss done inside, on a CPU model, then under the check on the same model on the fake accelerator: the same
    numbers and state (float tolerance) and the same gradient of every parameter, which lives on the accelerator."""
    cpu, placed = build(), to_accelerator(build(), trainable=True)
    with sdpa_kernel(SDPBackend.MATH):  # the fake device's attention under autograd (torch's fallback for a device)
        expected = steps(cpu, torch.device("cpu"))
    with fake_accelerator():
        got = steps(placed, FAKE)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        if isinstance(b, torch.Tensor) and b.is_floating_point():  # state: within float rounding of its scale
            torch.testing.assert_close(cpu_data(a), b, rtol=1e-4, atol=1e-4 * float(b.abs().max()) + 1e-7)
        elif isinstance(b, torch.Tensor):
            assert torch.equal(cpu_data(a), b)
        else:
            assert a == pytest.approx(b, rel=1e-4, abs=1e-6)
    grads = {n: p.grad for n, p in cpu.named_parameters() if p.grad is not None}
    placed_grads = {n: p.grad for n, p in placed.named_parameters() if p.grad is not None}
    assert grads and grads.keys() == placed_grads.keys()
    for n, g in placed_grads.items():
        assert isinstance(g, OnAccelerator), f"{n}: gradient on the CPU"
        scale = float(grads[n].abs().max())
        torch.testing.assert_close(cpu_data(g), grads[n], rtol=1e-4, atol=1e-4 * scale + 1e-7,
                                   msg=lambda m, n=n: f"{n}: {m}")


def numbers(loss, count, metrics, device) -> list[float]:
    """A step's loss (backpropagated here), count and metrics as plain numbers; the loss and count on `device`."""
    assert loss.device.type == count.device.type == device.type, (loss.device, count.device)
    loss.backward()
    return [loss.item(), float(count), *(float(v) for _, v in sorted(metrics.items()))]


def on_device(b: dict, device) -> dict:
    return {k: v.to(device) for k, v in b.items()}


def batch_steps(make_objective, make_batch=batch, updates=2):
    """The loop's use of a batch objective: plan every micro-batch on the moved batch, then loss and backward."""
    def steps(model, device):
        objective, out = make_objective(), []
        for update in range(updates):
            b = on_device(make_batch(), device)
            plan = objective.plan(b, update, 0)
            out += [float(plan["count"]), *numbers(*objective.loss(model, b, plan), device)]
        return out
    return steps


def _objectives():
    from dlm.training.objectives.autoregressive import AutoregressiveObjective
    from dlm.training.objectives.block_mdm import BlockMDMObjective
    from dlm.training.objectives.mdm import MDMObjective
    from dlm.training.objectives.reward import RewardObjective
    from dlm.training.objectives.simplex import SimplexObjective

    def simplex_objective(masking="prefix_lm", strategy=None):
        return lambda: SimplexObjective(5.0, 100, self_condition_prob=1.0, masking=masking, label_shift=True, seed=3,
                                        ul2_strategy=strategy, max_length=16)

    return {  # (model, objective, batch)
        "autoregressive": (lambda: tiny_model(VOCAB, seed=1).train(), AutoregressiveObjective, batch),
        "mdm": (masked, lambda: MDMObjective(MASK, seed=0, max_length=16), batch),
        "mdm_layer_checkpointing": (checkpointed, lambda: MDMObjective(MASK, seed=0, max_length=16), batch),
        "block_mdm": (lambda: masked("block_causal", label_shift=True),
                      lambda: BlockMDMObjective(MASK, BLOCK, seed=0, max_length=16), lambda: batch(BLOCK)),
        "simplex_self_conditioned": (simplex, simplex_objective(), batch),
        **{f"simplex_ul2_{s}": (simplex, simplex_objective("ul2", s), batch) for s in UL2_STRATEGIES},
        "simplex_ul2_mixture": (simplex, simplex_objective("ul2"), batch),
        "reward": (reward, RewardObjective, lambda: batch(pairs=True)),
    }


@pytest.mark.parametrize("name", list(_objectives()))
def test_batch_objective_trains_on_the_accelerator(name):
    train_on_both(*steps_of(name, short=False))


# ---- PU: the pool on the CPU, the windows on the model's device --------------------------------------------------
class Stream:
    """Examples 0, 1, 2, ...: a prompt of 2 tokens and a response of 3 + (i % 3) tokens."""

    def __init__(self):
        self.i = 0

    def take(self, n):
        out = [Example([3 + (self.i + j) % 5, 4], [10 + (self.i + j + k) % 20 for k in range(3 + (self.i + j) % 3)])
               for j in range(n)]
        self.i += n
        return out

    def take_shared(self, count, start, n):
        return self.take(count)[start:start + n]


PU = {  # (progressive settings, block PUMBA)
    "carry_window_2": ({"window": 2, "carry": True, "carry_drop_prob": 0.3}, False),
    "carry_checkpointed": ({"window": 2, "carry": True, "activation_checkpointing": True}, False),
    "gumbel_student_forcing": ({"window": 2, "bridge": "gumbel", "student_forcing_k": 1.0,
                                "student_forcing_warmup": 0}, False),
    "straight_through": ({"window": 2, "bridge": "straight_through"}, False),
    "reinforce": ({"window": 2, "bridge": "reinforce"}, False),
    "reinforce_sampled": ({"window": 2, "bridge": "reinforce_sampled"}, False),
    "pu_plus": ({"pool_factor": 2, "random_initial_masking": True, "balance_lambda": 0.3, "threshold": None}, False),
    "stages": ({"construction": "stages", "stages_start": 3, "stages_end": 3}, False),
    "block_pumba_carry_window_2": ({"window": 2, "carry": True, "reveal_count": 1, "threshold": None}, True),
}


def pu_steps(settings: dict, block: bool, windows: int = 3, world: int = 1):
    """PU as the trainer runs it (`attach`, then plan and loss with no batch): `windows` windows, each backpropagated;
    then the pool's state (CPU-side by design), which must equal the CPU run's."""
    from dlm.training.objectives.progressive import ProgressiveObjective

    def steps(model, device):
        cfg = ProgressiveConfig(**{"reveal_count": 2, "threshold": 0.9, **settings})
        objective = ProgressiveObjective(cfg, MASK, seed=0, rank=0, batch_size=3, grad_accum=1, max_length=16,
                                         block_size=BLOCK if block else None, world=world)
        objective.attach(Stream(), lambda ex, pad_to=None: collate(ex, EOS, PAD, pad_to=pad_to,
                                                                   block_size=BLOCK if block else None),
                         model.config.hidden_size)
        out = []
        for micro in range(windows):
            plan = objective.plan(None, micro, 0)
            out += [float(plan["count"]), *numbers(*objective.loss(model, None, plan), device)]
        pool = objective.pool
        assert all(t.device.type == "cpu" for t in (pool.canvas, pool.revealed, pool.steps))
        out += [pool.canvas.clone(), pool.revealed.clone(), pool.steps.clone()]
        if pool.carry is not None:
            assert pool.carry.device.type == "cpu" and float(pool.carry.abs().sum()) > 0
            out.append(pool.carry.clone())
        return out
    return steps


def steps_of(case: str, short=True):
    """(model builder, steps) of a case of `_objectives()` or `PU`; short: one update or window, else 2 or 3."""
    if case in PU:
        settings, block = PU[case]
        carry = settings.get("carry", False)
        build = (lambda: masked("block_causal", carry=carry, label_shift=True)) if block else (
            lambda: masked(carry=carry))
        return build, pu_steps(settings, block, windows=1 if short else 3)
    build, objective, make_batch = _objectives()[case]
    return build, batch_steps(objective, make_batch, updates=1 if short else 2)


@pytest.mark.parametrize("case", PU)
def test_pu_window_trains_on_the_accelerator(case):
    train_on_both(*steps_of(case, short=False))


class Ranks:
    """torch.distributed for 2 ranks that hold what this process holds (a sum doubles): each collective checks that
    its tensors are on the backend's device (gloo: the CPU; NCCL: the GPU, here the fake accelerator)."""

    def __init__(self, backend: str):
        self.backend, self.calls = backend, Counter()
        self.device = torch.device("cpu")  # where the collectives' tensors must be (the fake device under NCCL)

    def get_backend(self, group=None):
        return self.backend

    def _on_device(self, t: torch.Tensor):
        assert t.device.type == self.device.type, f"{self.backend} collective on a {t.device} tensor"

    def all_reduce(self, t, op=None, group=None):
        self.calls["all_reduce"] += 1
        self._on_device(t)
        if op != torch.distributed.ReduceOp.MAX:
            t.mul_(2)

    def all_gather(self, parts, t, group=None):
        self.calls["all_gather"] += 1
        for p in parts:
            self._on_device(p)
            p.copy_(t)


def across_ranks(backend: str, monkeypatch):
    """(model builder, steps) of PU with 2 ranks (global widths, counts and refills through the collectives), the
    collectives simulated by `Ranks`."""
    import torch.distributed as dist

    from dlm.training.objectives import progressive

    ranks = Ranks(backend)
    for name in ("get_backend", "all_reduce", "all_gather"):
        monkeypatch.setattr(dist, name, getattr(ranks, name))
    if backend == "nccl":  # the GPU's collectives: the model's (fake) device, as torch.cuda.current_device() gives
        monkeypatch.setattr(progressive, "_collective_device", lambda: ranks.device)
    build, _ = steps_of("carry_window_2")
    steps = pu_steps(PU["carry_window_2"][0], False, windows=3, world=2)

    def on_the_backends_device(model, device):
        ranks.device = device if backend == "nccl" else torch.device("cpu")
        ranks.calls.clear()
        out = steps(model, device)
        assert ranks.calls["all_reduce"] and ranks.calls["all_gather"]  # reductions, and refills in rank order
        return out
    return build, on_the_backends_device


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_pu_across_ranks_on_the_accelerator(backend, monkeypatch):
    """PU with 2 ranks: the collectives get their backend's device, and what they return reaches the model's."""
    train_on_both(*across_ranks(backend, monkeypatch))


# ---- planted bugs: the check must fail on them -------------------------------------------------------------------
def replaced(fn, old: str, new: str):
    """`fn` recompiled from its own source with the one occurrence of `old` replaced by `new`."""
    fn = inspect.unwrap(fn)
    lines, first = inspect.getsourcelines(fn)
    source = textwrap.dedent("".join(lines))
    assert source.count(old) == 1, f"{source.count(old)} occurrences of {old!r} in {fn.__qualname__}"
    tree = ast.parse(source.replace(old, new))
    ast.increment_lineno(tree, first - 1)  # tracebacks point at the real file's lines
    namespace = dict(vars(sys.modules[fn.__module__]))
    exec(compile(tree, inspect.getsourcefile(fn), "exec", flags=__future__.annotations.compiler_flag,
                 dont_inherit=True), namespace)
    return namespace[fn.__name__]


def _plants():
    from dlm.training.objectives import block_mdm, bridges, mdm, progressive, pu_pass, simplex

    P = progressive.ProgressiveObjective
    return {  # (object holding the function, its name, (source text, its bug), the case that must now fail)
        # a factory without device=
        "pu_attention": (P, "_open_window", ("long, device=device)", "long)"), "carry_window_2"),
        "block_pumba_weights": (pu_pass, "block_weights", ("n, device=group.device).scatter_add_(1, group, in_",
                                                           "n).scatter_add_(1, group, in_"),
                                "block_pumba_carry_window_2"),
        "reinforce_sampled_mask": (bridges.SampledReinforceBridge, "from_logits",
                                   ("device=logits.device", ""), "reinforce_sampled"),
        "simplex_ul2_positions": (simplex, "generated_positions", ("device=ids.device)[None", ")[None"),
                                  "simplex_ul2_t5"),
        # CPU-side noise or pool state not moved to the model's device
        "mdm_masks": (mdm.MDMObjective, "plan", ("masked.to(device), t.to", "masked, t.to"), "mdm"),
        "block_mdm_levels": (block_mdm.BlockMDMObjective, "plan", ("level.to(device)", "level"), "block_mdm"),
        "simplex_epsilon": (simplex.SimplexObjective, "loss", ("L, vocab, device)", "L, vocab)"),
                            "simplex_self_conditioned"),
        "pu_canvas": (P, "_forward", ("pool.canvas[rows, :width].to(device)", "pool.canvas[rows, :width]"),
                      "straight_through"),
        "pu_carry": (P, "loss", ("pool.carry[rows, :width].to(device)", "pool.carry[rows, :width]"),
                     "carry_window_2"),
        "pu_gumbel": (bridges, "gumbel_noise", (").to(device)", ")"), "gumbel_student_forcing"),
    }


@reads_source
@pytest.mark.parametrize("plant", ["pu_attention", "block_pumba_weights", "reinforce_sampled_mask",
                                   "simplex_ul2_positions", "mdm_masks", "block_mdm_levels", "simplex_epsilon",
                                   "pu_canvas", "pu_carry", "pu_gumbel"])
def test_a_device_bug_in_an_objective_fails_the_check(plant, monkeypatch):
    """A `device=` dropped, or a CPU-side tensor's transfer dropped, in the real source of an objective: invisible
    on the CPU, refused here."""
    owner, name, (old, new), case = _plants()[plant]
    monkeypatch.setattr(owner, name, replaced(getattr(owner, name), old, new))
    build, steps = steps_of(case)
    steps(build(), torch.device("cpu"))  # on the CPU the bug is invisible
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        train_on_both(build, steps)


@reads_source
def test_a_collective_off_its_backends_device_fails_the_check(monkeypatch):
    """The PU reduction without its transfer to the collective's device: gloo would get the model's tensor."""
    from dlm.training.objectives import progressive

    P = progressive.ProgressiveObjective
    monkeypatch.setattr(P, "_all", replaced(P._all, "out.to(_collective_device())", "out"))
    build, steps = across_ranks("gloo", monkeypatch)
    steps(build(), torch.device("cpu"))  # on the CPU the bug is invisible
    with pytest.raises(AssertionError, match="gloo collective on a lazy:0 tensor"):
        train_on_both(build, steps)


# ---- the static complement ---------------------------------------------------------------------------------------
CPU_BY_DESIGN = {  # per-example noise, the PU pool's side and per-batch choices: made on the CPU, moved before use
    "noise.py": {"row_generators", "batch_generator", "rows_rand", "ids", "uniforms"},
    "block_mdm.py": {"sample_block_mask"},
    "progressive.py": {"__init__", "plan", "_next_rows", "_end_window", "drop_carry",
                       "_commit: torch.rand(len(rows), width, generator=g)"},  # student forcing: the pool's commits
    "bridges.py": {"gumbel_noise"},
    "simplex.py": {"plan"},
    # RL: the prompt stream's indices, each group's masks (drawn on the CPU from keyed generators, moved before use)
    "grpo.py": {"_indices"},
    "likelihood.py": {"group_generator", "draw"},
}


@reads_source
def test_objective_factories_name_their_device():
    """Every torch factory call in the training objectives passes `device=` (or is CPU-side by design): the fake
    accelerator's rule, for the paths no test runs (a new objective, a config the cases above leave out)."""
    from tests.test_device_check import FACTORIES, SRC

    missing = []
    for path in sorted(SRC.glob("training/objectives/*.py")):
        allowed = CPU_BY_DESIGN.get(path.name, set())
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef) or fn.name in allowed:
                continue
            for node in ast.walk(fn):
                if (isinstance(node, ast.Call) and ast.unparse(node.func) in {f"torch.{f}" for f in FACTORIES}
                        and not any(k.arg == "device" for k in node.keywords)
                        and f"{fn.name}: {ast.unparse(node)}" not in allowed):
                    missing.append(f"training/objectives/{path.name}:{node.lineno} {ast.unparse(node)}")
    assert not missing, "factory calls without device= (pass device=, or make it from an existing tensor):\n" + \
        "\n".join(missing)
