"""The carry input (PUMBA Eq. 3.1, §3.2) as a pure function, by hand: LayerNorm of the state, the label-shift
alignment, padding that neither passes nor receives a state, `carry_positions="masked"`, and the zero-initialised
LayerNorm (a fresh carry layer changes nothing)."""

import pytest
import torch
from torch import nn

from dlm.modeling.carry import carry_input, carry_norm_for, new_carry_norm

MASK = 9


def _norm(d=4, seed=0, dtype=torch.float32):
    norm = nn.LayerNorm(d, eps=1e-5, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(d, generator=g))
        norm.bias.copy_(torch.randn(d, generator=g))
    return norm


def _by_hand(norm, h):
    mean = h.mean(-1, keepdim=True)
    var = h.var(-1, unbiased=False, keepdim=True)
    return (h - mean) / torch.sqrt(var + norm.eps) * norm.weight + norm.bias


def test_new_carry_norm_is_zero_initialised():
    norm = new_carry_norm(6, eps=1e-6, dtype=torch.bfloat16)
    assert isinstance(norm, nn.LayerNorm) and norm.normalized_shape == (6,) and norm.eps == 1e-6
    assert norm.weight.dtype == torch.bfloat16 and not norm.weight.any() and not norm.bias.any()
    assert not norm(torch.randn(2, 3, 6, dtype=torch.bfloat16)).any()  # a fresh carry adds exactly zero
    assert new_carry_norm(6).eps == 1e-5


def test_carry_norm_for_follows_the_backbone():
    from tests.conftest import tiny_model

    backbone = tiny_model(40).backbone.to(torch.bfloat16)
    norm = carry_norm_for(backbone)
    assert norm.normalized_shape == (backbone.config.hidden_size,) and norm.eps == backbone.config.rms_norm_eps
    assert norm.weight.dtype == torch.bfloat16 and not norm.weight.any() and not norm.bias.any()


def test_carry_norm_for_a_backbone_without_rms_norm_eps_on_its_device():
    """A config without `rms_norm_eps` gets the default 1e-5; the norm lives where the embeddings live."""
    from types import SimpleNamespace

    class Backbone(nn.Module):
        config = SimpleNamespace(hidden_size=5)

        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(7, 5, device="meta", dtype=torch.float16)

        def get_input_embeddings(self):
            return self.embed

    norm = carry_norm_for(Backbone())
    assert norm.eps == 1e-5 and norm.weight.device.type == "meta" and norm.weight.dtype == torch.float16
    assert new_carry_norm(3, device="meta").bias.device.type == "meta"


def test_all_positions_without_label_shift():
    norm = _norm()
    h = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(1))
    ids = torch.full((2, 5), 3)
    out = carry_input(norm, h, ids, MASK, label_shift=False)
    torch.testing.assert_close(out, _by_hand(norm, h), rtol=1e-5, atol=1e-5)


def test_label_shift_moves_each_state_one_position_right():
    """Under label shift the state that predicted token i sits at i-1: position i receives state i-1, position 0
    nothing."""
    norm = _norm()
    h = torch.randn(1, 5, 4, generator=torch.Generator().manual_seed(2))
    out = carry_input(norm, h, torch.full((1, 5), 3), MASK, label_shift=True)
    expected = _by_hand(norm, h)
    assert not out[0, 0].any()
    torch.testing.assert_close(out[0, 1:], expected[0, :4], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("label_shift", [False, True])
def test_padding_neither_passes_nor_receives(label_shift):
    norm = _norm()
    h = torch.randn(1, 6, 4, generator=torch.Generator().manual_seed(3))
    attention = torch.tensor([[0, 0, 1, 1, 1, 1]])  # two left-padding positions
    out = carry_input(norm, h, torch.full((1, 6), 3), MASK, label_shift, attention_mask=attention)
    expected = _by_hand(norm, h)
    assert not out[0, :2].any()  # padding receives nothing
    if label_shift:
        assert not out[0, 2].any()  # the first real token receives the padding's state: nothing
        torch.testing.assert_close(out[0, 3:], expected[0, 2:5], rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out[0, 2:], expected[0, 2:], rtol=1e-5, atol=1e-5)
    # a padded row receives what it would receive alone
    alone = carry_input(norm, h[:, 2:], torch.full((1, 4), 3), MASK, label_shift)
    torch.testing.assert_close(out[0, 2:], alone[0], rtol=1e-5, atol=1e-5)


def test_masked_positions_only():
    norm = _norm()
    h = torch.randn(1, 5, 4, generator=torch.Generator().manual_seed(4))
    ids = torch.tensor([[3, MASK, 4, MASK, MASK]])
    out = carry_input(norm, h, ids, MASK, label_shift=True, positions="masked")
    full = carry_input(norm, h, ids, MASK, label_shift=True, positions="all")
    keep = (ids == MASK)[..., None]
    torch.testing.assert_close(out, full * keep)
    assert out[0, 1].any() and out[0, 3].any() and not out[0, 2].any()
    with pytest.raises(ValueError, match="carry_positions='masked' needs the model's mask token id"):
        carry_input(norm, h, ids, None, label_shift=True, positions="masked")


def test_fp32_carry_enters_in_the_norms_dtype():
    norm = _norm(dtype=torch.bfloat16)
    h = torch.randn(1, 3, 4, dtype=torch.float32)
    out = carry_input(norm, h, torch.full((1, 3), 3), MASK, label_shift=False)
    assert out.dtype == torch.bfloat16
