"""EMA of the trainable weights: the closed form of the update at a decay where `decay` and `1 - decay` differ,
tied weights averaged once, frozen weights not shadowed, `applied` / `weights_for` / state round trip."""

import io

import pytest
import torch
from torch import nn

from dlm.training.ema import EMA


class Tied(nn.Module):
    """An embedding tied to the output head (two state-dict names, one tensor), a trainable layer and a frozen one."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.mid = nn.Linear(3, 3)
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)


def _steps(model, n, seed=0):
    """n random new values for every parameter; yields after each so the caller can update the EMA."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        yield {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("decay", [0.9, 0.75])
def test_update_matches_closed_form(decay):
    """s_n = decay^n s_0 + sum_i (1 - decay) decay^(n-i) w_i, for each trainable tensor; a tied weight is averaged
    once per update (twice would give decay^2)."""
    torch.manual_seed(0)
    m = Tied()
    initial = {k: v.detach().clone() for k, v in m.state_dict().items()}
    ema = EMA(m, decay)
    seen = []
    for values in _steps(m, 4):
        ema.update(m)
        seen.append(values)
    n = len(seen)
    for k in ("embed.weight", "head.weight", "mid.weight", "mid.bias"):
        expected = decay ** n * initial[k] + sum((1 - decay) * decay ** (n - 1 - i) * v[k] for i, v in enumerate(seen))
        torch.testing.assert_close(ema.shadow[k], expected, rtol=1e-5, atol=1e-6, msg=k)
    assert ema.shadow["embed.weight"] is ema.shadow["head.weight"]  # one shadow for the tied weight
    assert "frozen.weight" not in ema.shadow and "frozen.bias" not in ema.shadow


def test_shadow_is_an_fp32_copy_not_the_live_weight():
    m = Tied().to(torch.bfloat16)
    ema = EMA(m, 0.9)
    assert all(s.dtype == torch.float32 for s in ema.shadow.values())
    before = ema.shadow["mid.weight"].clone()
    with torch.no_grad():
        m.mid.weight.add_(1.0)
    assert torch.equal(ema.shadow["mid.weight"], before)  # editing the model in place leaves the shadow alone
    w = ema.weights_for(m)
    assert w["mid.weight"].dtype == torch.bfloat16  # loadable into the model as it is
    assert torch.equal(w["mid.weight"], before.to(torch.bfloat16))


def test_applied_swaps_in_the_average_and_restores():
    torch.manual_seed(0)
    m = Tied()
    ema = EMA(m, 0.9)
    for _ in _steps(m, 2):
        ema.update(m)
    live = {k: v.detach().clone() for k, v in m.state_dict().items()}
    with ema.applied(m) as same:
        assert same is m
        for k in ("embed.weight", "mid.weight", "mid.bias"):
            torch.testing.assert_close(m.state_dict()[k], ema.shadow[k])
        torch.testing.assert_close(m.frozen.weight, live["frozen.weight"])
    for k, v in m.state_dict().items():
        assert torch.equal(v, live[k]), k  # restored exactly
    with pytest.raises(RuntimeError), ema.applied(m):
        raise RuntimeError("boom")
    assert torch.equal(m.mid.weight, live["mid.weight"])  # restored on error too


def test_weights_for_and_state_round_trip():
    torch.manual_seed(0)
    m = Tied()
    ema = EMA(m, 0.9)
    for _ in _steps(m, 3):
        ema.update(m)
    w = ema.weights_for(m)
    assert set(w) == set(m.state_dict())
    torch.testing.assert_close(w["mid.weight"], ema.shadow["mid.weight"])
    assert w["frozen.weight"].data_ptr() == m.frozen.weight.data_ptr()  # the live tensor, not a copy

    # a checkpoint round trip into a fresh EMA with another decay: the decay and the tie come back, updates agree
    buf = io.BytesIO()
    torch.save(ema.state_dict(), buf)
    buf.seek(0)
    other = EMA(Tied(), 0.5)
    other.load_state_dict(torch.load(buf))
    assert other.decay == 0.9
    assert other.shadow["embed.weight"] is other.shadow["head.weight"]
    for _ in _steps(m, 2, seed=5):
        ema.update(m)
        other.update(m)
    for k in ema.shadow:
        torch.testing.assert_close(other.shadow[k], ema.shadow[k], rtol=0, atol=0)
