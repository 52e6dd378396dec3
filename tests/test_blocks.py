"""Block-causal attention: the mask rule by hand, and what the HF backbone does with it (eager and sdpa)."""

import pytest
import torch

from dlm.modeling.blocks import block_causal_allowed, block_causal_mask, canvas_blocks
from tests.conftest import perturb, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def test_rule_by_hand():
    # prompt (block 0, 2 tokens) | clean block 1 (2) | noised block 1 (2) | noised block 2 (2)
    block = torch.tensor([[0, 0, 1, 1, 1, 1, 2, 2]])
    noised = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    got = block_causal_allowed(block, noised, block, noised)[0].int().tolist()
    expected = [
        [1, 1, 0, 0, 0, 0, 0, 0],  # prompt: itself only
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],  # clean block 1: prompt + itself
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 1, 0, 0],  # noised block 1: prompt (earlier clean) + itself, not its clean copy
        [1, 1, 0, 0, 1, 1, 0, 0],
        [1, 1, 1, 1, 0, 0, 1, 1],  # noised block 2: clean blocks 0-1 + itself
        [1, 1, 1, 1, 0, 0, 1, 1],
    ]
    assert got == expected


def test_padding_keys_removed_and_empty_rows_safe():
    block = torch.tensor([[0, 0, 0, 1]])
    noised = torch.tensor([[0, 0, 0, 1]], dtype=torch.bool)
    valid = torch.tensor([[0, 1, 1, 1]])
    m = block_causal_mask(block, noised, k_valid=valid)
    assert m.shape == (1, 1, 4, 4)
    assert (m[0, 0, :, 0] < 0).all()  # the pad key is attended by nobody
    assert torch.isfinite(m).all()
    assert canvas_blocks(3, 5, 2).tolist() == [[0, 0, 0, 1, 1, 2, 2, 3]]


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_backbone_honours_the_mask(impl):
    """Clean positions ignore every noised token; a noised block ignores later blocks and other noised blocks."""
    model = perturb(tiny_model(64, attention="block_causal", family="masked"))  # outputs that depend on context
    model.backbone.set_attn_implementation(impl)
    block = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2]])
    noised = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    pos = torch.tensor([[0, 1, 2, 3, 4, 3, 4, 5, 6]])
    mask = block_causal_mask(block, noised)
    ids = torch.randint(0, 60, (1, 9), generator=torch.Generator().manual_seed(0))
    out = model(ids, attention_mask=mask, position_ids=pos, align=False)
    changed = ids.clone()
    changed[0, 5:] = (changed[0, 5:] + 1) % 60  # every noised token
    out2 = model(changed, attention_mask=mask, position_ids=pos, align=False)
    assert torch.allclose(out[0, :5], out2[0, :5], atol=1e-5)  # clean outputs untouched
    changed = ids.clone()
    changed[0, 7:] = (changed[0, 7:] + 1) % 60  # noised block 2 only
    out3 = model(changed, attention_mask=mask, position_ids=pos, align=False)
    assert torch.allclose(out[0, :7], out3[0, :7], atol=1e-5)
    assert not torch.allclose(out[0, 7:], out3[0, 7:], atol=1e-3)
    changed = ids.clone()
    changed[0, 3] = (changed[0, 3] + 1) % 60  # clean block 1 is seen by noised block 2, not by noised block 1
    out4 = model(changed, attention_mask=mask, position_ids=pos, align=False)
    assert torch.allclose(out[0, 5:7], out4[0, 5:7], atol=1e-5)
    assert not torch.allclose(out[0, 7:], out4[0, 7:], atol=1e-3)
    # the same layout, attention implementation aside, gives the same numbers
    other = "sdpa" if impl == "eager" else "eager"
    model.backbone.set_attn_implementation(other)
    assert torch.allclose(out, model(ids, attention_mask=mask, position_ids=pos, align=False), atol=1e-4)
