"""The simplex sampler's contract beyond its numbers: defaults of a direct call, when reward guidance runs (and is
checked) and when it is skipped, one clear error line for a model or option it cannot use, and `show_steps`, the
TESS 2 App. F view of a trace (frames, text, colours by top-token probability, strike-through after the EOS)."""

import pytest
import torch
from rich.style import Style

import dlm.sampling.guidance as guidance
import dlm.sampling.simplex as sx
from tests.test_simplex import Oracle, simplex_model

pytestmark = pytest.mark.usefixtures("one_thread")


def reward_model(vocab=40, **spec):
    from tests.conftest import tiny_model

    return tiny_model(vocab, "causal", "reward", seed=1, **{"eos_token_id": 1, "pad_token_id": 0, **spec})


def test_direct_call_defaults(monkeypatch):
    """100 steps (of T = 1000 timesteps: fewer than T, so the count shows), argmax, no early stop, no trace."""
    monkeypatch.setattr(sx, "simplex_logits", Oracle(torch.tensor([[7, 8, 1]]), 40))
    out = sx.generate(simplex_model(vocab=40, T=1000), [[5]], 3, eos_id=1, pad_id=0)
    assert out.nfe == [100] and out.trace is None and out.tokens == [[7, 8]]


def test_live_trace_and_the_end_of_early_stopping(monkeypatch):
    """A given `trace` list fills as the steps happen and is the one returned; once every row has stopped, the
    loop ends: no further (empty) steps are recorded."""
    monkeypatch.setattr(sx, "simplex_logits", Oracle(torch.tensor([[7, 8, 1]] * 2), 40))
    live = []
    out = sx.generate(simplex_model(vocab=40), [[5], [6, 7]], 3, eos_id=1, pad_id=0, inference_steps=50,
                      early_stop_patience=2, trace=live)
    assert out.trace is live and len(live) == 3 and out.nfe == [3, 3]
    assert [s["timestep"] for s in live] == [99, 97, 95]  # 50 steps over T = 100: every other timestep


@pytest.fixture
def spy(monkeypatch):
    calls, real = [], guidance.reward_guidance

    def record(*args, **kwargs):
        calls.append(args[3:6])  # (η, guidance steps, temperature)
        return real(*args, **kwargs)

    monkeypatch.setattr(guidance, "reward_guidance", record)
    return calls


def test_guidance_defaults_and_when_it_runs(spy):
    m, rm = simplex_model(vocab=40), reward_model()
    kw = dict(gen_length=4, eos_id=1, pad_id=0, inference_steps=2)
    sx.generate(m, [[5]], reward_model=rm, guidance_scale=0.5, **kw)
    assert spy == [(0.5, 1, 1.0)] * 2  # one ascent step at τ = 1 by default
    sx.generate(m, [[5]], reward_model=rm, guidance_scale=1.0, guidance_steps=3, guidance_temperature=0.5, **kw)
    assert spy[2:] == [(1.0, 3, 0.5)] * 2
    del spy[:]
    sx.generate(m, [[5]], reward_model=rm, **kw)  # η defaults to 0: no guidance
    assert spy == []
    plain = sx.generate(m, [[5, 6]], generator=torch.Generator().manual_seed(0), **kw)
    no_rm = sx.generate(m, [[5, 6]], generator=torch.Generator().manual_seed(0), guidance_scale=2.0, **kw)
    assert spy == [] and no_rm.tokens == plain.tokens  # η without a reward model: nothing to guide with


def test_an_incompatible_reward_model_is_refused_for_any_nonzero_eta():
    m = simplex_model(vocab=40)
    for eta in (1.0, -0.5):
        with pytest.raises(ValueError, match=r"tokenizer.*they differ: vocabulary 40 vs 50 rows\."):
            sx.generate(m, [[5]], 4, eos_id=1, pad_id=0, inference_steps=2, reward_model=reward_model(vocab=50),
                        guidance_scale=eta)


NOT_SIMPLEX = "the simplex sampler needs a simplex model (dlm.json with simplex_k and simplex_timesteps)"


@pytest.mark.parametrize("update", [{"family": "masked"}, {"simplex_k": None}, {"simplex_timesteps": None}])
def test_a_model_without_the_simplex_spec_is_one_clear_error(update):
    m = simplex_model(vocab=40)
    m.spec = m.spec.model_copy(update=update)
    with pytest.raises(ValueError) as err:
        sx.generate(m, [[5]], 4, eos_id=1, pad_id=0, inference_steps=2)
    assert str(err.value) == NOT_SIMPLEX


def test_temperature_is_refused_with_the_alternative():
    with pytest.raises(ValueError) as err:
        sx.generate(simplex_model(vocab=40), [[5]], 4, eos_id=1, pad_id=0, temperature=0.5)
    assert str(err.value) == "the simplex sampler has no temperature: sample with top_p (e.g. 0.99) instead"


class Tok:
    def decode(self, ids):
        return {3: "ab", 4: "\x07", 1: "</s>"}.get(ids[0], f"<{ids[0]}>")


class Printed:
    def __init__(self):
        self.lines = []

    def print(self, line):
        self.lines.append(line)


def _trace(n):
    """n steps of 2 rows × 4 positions; row 0 is [3, 1, 4, 5] with confidences in each colour band."""
    tokens = torch.tensor([[3, 1, 4, 5], [5, 5, 5, 5]])
    conf = torch.tensor([[0.2, 0.5, 0.89, 0.95], [0.99] * 4])
    return [{"timestep": 99 - 4 * k, "tokens": tokens, "confidence": conf} for k in range(n)]


def test_show_steps_frames_text_and_colours():
    out = Printed()
    assert sx.show_steps(_trace(25), Tok(), 0, eos_id=1, console=out) == 13  # every 2nd step of 25, and the last
    first = out.lines[0]
    assert first.plain == "step    2/25 t=   95 │ ab⟨eos⟩␇<5>" and Style.parse(str(first.style)) == Style.parse("dim")
    assert out.lines[-1].plain.startswith("step   25/25 t=    3 │ ")
    assert [line.plain[:9] for line in out.lines] == [f"step {k:>4}" for k in (*range(2, 25, 2), 25)]
    prefix = len("step    2/25 t=   95 │ ")
    assert [(s.start - prefix, s.end - prefix, Style.parse(str(s.style))) for s in first.spans] == [
        (0, 2, Style.parse("on red")), (2, 7, Style.parse("on yellow")),  # the EOS itself is not struck
        (7, 8, Style.parse("strike dim on yellow")), (8, 11, Style.parse("strike dim on green"))]
    out = Printed()
    assert sx.show_steps(_trace(25), Tok(), 1, eos_id=1, every=10, console=out) == 3
    assert [line.plain[:9] for line in out.lines] == ["step   10", "step   20", "step   25"]
    assert [Style.parse(str(s.style)) for s in out.lines[0].spans] == [Style.parse("on green")] * 4  # no EOS
    out = Printed()
    assert sx.show_steps(_trace(20), Tok(), 0, eos_id=1, console=out) == 10  # every 20 // 10 = 2nd step
    out = Printed()
    assert sx.show_steps(_trace(5), Tok(), 0, eos_id=1, console=out) == 5  # fewer than 10 steps: every one


def test_show_steps_prints_to_the_terminal_by_default(capsys):
    assert sx.show_steps(_trace(1), Tok(), 0, eos_id=1) == 1
    assert "step    1/1 t=   99 │ ab⟨eos⟩␇<5>" in capsys.readouterr().out
