"""The block-causal module's contract, piece by piece against hand-computed values: the vectorised training layout
(PUMBA App. B.4.1) index by index, the dense mask's dtype and empty rows, backend dispatch (dense, flex, auto and
DLM_BLOCK_ATTENTION), the backbone switch that takes a BlockMask, and the inputs each function refuses."""

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_mask

from dlm.modeling.blocks import (
    BLOCK_ATTENTION_ENV,
    SDPA_OR_FLEX,
    VectorisedLayout,
    attends_nothing,
    block_attention_mask,
    block_causal_allowed,
    block_causal_block_mask,
    block_causal_mask,
    block_forward,
    canvas_blocks,
    num_blocks,
    response_blocks,
    use_block_attention,
)
from tests.conftest import perturb, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
EOS, MASK = 2, 63
F, T = False, True


def _flex_allowed(block_mask):
    B, _, Q, K = block_mask.shape
    return create_mask(block_mask.mask_mod, B, None, Q, K, device="cpu")[:, 0]


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(BLOCK_ATTENTION_ENV, raising=False)


# ---- the vectorised layout -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("label_shift", [False, True])
def test_layout_by_hand(label_shift):
    # row 0: prompt 2, two blocks of 2 -> [p0 p1 | C0 C0 N0 N0 | C1 C1 N1 N1]; row 1: prompt 1, one block -> padded
    layout = VectorisedLayout(torch.tensor([2, 1]), torch.tensor([6, 3]), 2, label_shift)
    assert layout.src.tolist() == [[0, 1, 2, 3, 2, 3, 4, 5, 4, 5], [0, 1, 2, 1, 2, 0, 0, 0, 0, 0]]
    assert torch.equal(layout.position_ids, layout.src)
    assert layout.noised.tolist() == [[F, F, F, F, T, T, F, F, T, T], [F, F, F, T, T, F, F, F, F, F]]
    assert layout.block.tolist() == [[0, 0, 1, 1, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 0, 0, 0, 0, 0]]
    assert layout.valid.tolist() == [[T] * 10, [T] * 5 + [F] * 5]
    assert layout.block.dtype == layout.src.dtype == torch.long
    # the noised copy of logical position i; 0 on the prompt and beyond a row's width
    assert layout.noised_at.tolist() == [[0, 0, 4, 5, 8, 9], [0, 3, 4, 0, 0, 0]]
    if label_shift:  # a block's first token: the last clean position before it (prompt's last, or C_{k-1}'s last)
        assert layout.pred_at.tolist() == [[0, 0, 1, 4, 3, 8], [0, 0, 3, 0, 0, 0]]
    else:
        assert torch.equal(layout.pred_at, layout.noised_at)


def test_layout_refuses_what_it_cannot_lay_out():
    with pytest.raises(ValueError, match="^label shift needs at least one prompt token to predict the first response "
                                         "token$"):
        VectorisedLayout(torch.tensor([0]), torch.tensor([4]), 4, label_shift=True)
    no_prompt = VectorisedLayout(torch.tensor([0]), torch.tensor([4]), 4, label_shift=False)  # fine without the shift
    assert no_prompt.src.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]] and no_prompt.pred_at.tolist() == [[4, 5, 6, 7]]
    with pytest.raises(ValueError, match="^a response region of 5 positions is not a whole number of blocks of 4$"):
        VectorisedLayout(torch.tensor([3]), torch.tensor([8]), 4, label_shift=True)


def test_raw_carry_sits_on_noised_copies_only():
    layout = VectorisedLayout(torch.tensor([2, 1]), torch.tensor([6, 3]), 2, True)
    carry = torch.arange(1, 2 * 6 * 3 + 1, dtype=torch.float32).reshape(2, 6, 3)
    raw = layout.raw_carry(carry)
    assert raw.shape == (2, 10, 3) and raw.dtype == torch.float32
    for b in range(2):
        for t in range(10):
            want = carry[b, layout.src[b, t]] if layout.noised[b, t] and layout.valid[b, t] else torch.zeros(3)
            assert torch.equal(raw[b, t], want), (b, t)


def test_layout_mask_default_dtype_and_backends(no_env):
    # row 1 has no prompt: its padding queries (clean, block 0) have no valid key to attend to
    layout = VectorisedLayout(torch.tensor([2, 0]), torch.tensor([6, 2]), 2, False, dtype=torch.float64)
    dense = layout.mask()  # "auto" on CPU without the environment variable: dense
    assert dense.dtype == torch.float64 and dense.shape == (2, 1, 10, 10)
    allowed = block_causal_allowed(layout.block, layout.noised, layout.block, layout.noised, layout.valid)
    empty = ~allowed.any(-1, keepdim=True)
    assert empty[:, :, 0].tolist() == [[F] * 10, [F] * 4 + [T] * 6]
    lo = torch.tensor(torch.finfo(torch.float64).min, dtype=torch.float64)
    want = torch.where(allowed | empty, torch.zeros((), dtype=torch.float64), lo)[:, None]
    assert torch.equal(dense, want)
    flex = layout.mask("flex")
    assert isinstance(flex, BlockMask)
    assert torch.equal(_flex_allowed(flex), (dense == 0)[:, 0])


# ---- the dense mask ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_dense_mask_dtype_and_rows_that_see_nothing(dtype):
    # queries: two clean prompt positions and a noised block-1 query; keys: clean prompt (first one padding) + block 1
    q_block, q_noised = torch.tensor([[0, 0, 1]]), torch.tensor([[0, 0, 1]])
    k_block, k_noised = torch.tensor([[0, 1, 1]]), torch.tensor([[0, 1, 1]])
    k_valid = torch.tensor([[0, 1, 1]])
    mask = block_causal_mask(q_block, q_noised, k_block, k_noised, k_valid, dtype=dtype)
    lo = torch.finfo(dtype).min
    # prompt queries see no valid clean key of block <= 0: their rows open (all zeros) rather than all minima;
    # the noised query sees its own block's noised keys, not the padding key
    assert mask.dtype == dtype and mask.shape == (1, 1, 3, 3)
    assert mask[0, 0].tolist() == [[0, 0, 0], [0, 0, 0], [lo, 0, 0]]
    # the same through block_attention_mask (dense backend), keys given apart from the queries
    got = block_attention_mask(q_block, q_noised, k_block, k_noised, k_valid, dtype=dtype, backend="dense")
    assert torch.equal(got, mask)


def test_keys_apart_from_queries():
    """KV-cache step: queries are one block, keys the clean context and the block; neither backend may fall back to
    the queries as keys or drop the padding keys."""
    blocks = canvas_blocks(3, 8, 4, 2)
    noised = blocks >= 1
    valid = torch.tensor([[0, 1, 1] + [1] * 8, [1] * 11])
    qb, qn, kb, kn, kv = blocks[:, 3:7], noised[:, 3:7], blocks[:, :7], noised[:, :7], valid[:, :7]
    want = [[0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]]  # a noised block-1 query: the valid prompt + its block
    dense = block_attention_mask(qb, qn, kb, kn, kv, backend="dense")
    assert dense.shape == (2, 1, 4, 7)
    assert (dense[:, 0] == 0).int().tolist() == [[want[0]] * 4, [want[1]] * 4]
    flex = block_attention_mask(qb, qn, kb, kn, kv, backend="flex")
    assert isinstance(flex, BlockMask) and flex.shape == (2, 1, 4, 7)
    assert torch.equal(_flex_allowed(flex), dense[:, 0] == 0)


# ---- backend selection and the backbone switch ---------------------------------------------------------------------

def _sdpa_model():
    return perturb(tiny_model(64, attention="block_causal", family="masked", label_shift=True, block_size=4,
                              mask_token_id=MASK, eos_token_id=EOS))


class _Wrapper(torch.nn.Module):
    """What DDP/accelerate hand over: the model under `.module`."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_auto_backend_reads_the_environment(monkeypatch, no_env):
    block, noised = canvas_blocks(2, 4, 2), canvas_blocks(2, 4, 2) > 0
    model = _sdpa_model()
    auto = block_attention_mask(block, noised, model=model)
    assert torch.equal(auto, block_causal_mask(block, noised))  # dense on CPU; the model is left as it was
    assert model.backbone.config._attn_implementation == "sdpa"
    monkeypatch.setenv(BLOCK_ATTENTION_ENV, "flex")
    flex = block_attention_mask(block, noised)
    assert isinstance(flex, BlockMask)
    assert torch.equal(_flex_allowed(flex), block_causal_mask(block, noised)[:, 0] == 0)
    assert model.backbone.config._attn_implementation == "sdpa"  # no model given: nothing switched
    block_attention_mask(block, noised, model=_Wrapper(model))
    assert model.backbone.config._attn_implementation == SDPA_OR_FLEX


def test_use_block_attention_keeps_dense_outputs(no_env, monkeypatch):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    # registered by an earlier call in this process, maybe: start from transformers' own tables
    monkeypatch.delitem(AttentionInterface._global_mapping, SDPA_OR_FLEX, raising=False)
    monkeypatch.delitem(AttentionMaskInterface._global_mapping, SDPA_OR_FLEX, raising=False)
    model = _sdpa_model()
    layout = VectorisedLayout(torch.tensor([3, 2]), torch.tensor([11, 6]), 4, True)
    ids = torch.randint(3, 60, layout.src.shape, generator=torch.Generator().manual_seed(0))
    dense = layout.mask("dense")
    with torch.no_grad():
        before = model(ids, attention_mask=dense, position_ids=layout.position_ids, align=False)
        plain = model(ids, attention_mask=torch.ones_like(ids))
        use_block_attention(_Wrapper(model))
        assert model.backbone.config._attn_implementation == SDPA_OR_FLEX
        assert AttentionMaskInterface._global_mapping[SDPA_OR_FLEX] is sdpa_mask
        assert SDPA_OR_FLEX in AttentionInterface._global_mapping
        use_block_attention(model)  # a second call leaves the switched backbone as it is
        assert model.backbone.config._attn_implementation == SDPA_OR_FLEX
        assert torch.equal(model(ids, attention_mask=dense, position_ids=layout.position_ids, align=False), before)
        assert torch.equal(model(ids, attention_mask=torch.ones_like(ids)), plain)
    eager = _sdpa_model()
    eager.backbone.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="^block attention backend flex: the backbone runs eager attention, expected "
                                         r"sdpa; use the dense backend \(DLM_BLOCK_ATTENTION=dense\)$"):
        use_block_attention(eager)


def test_sdpa_or_flex_dispatches_on_the_mask_type(monkeypatch):
    """A BlockMask goes to transformers' flex_attention_forward, anything else to its sdpa_attention_forward, with
    every argument passed through (the real flex numbers: test_flex_attention.py, which compiles)."""
    import transformers.integrations.flex_attention as flex_module
    import transformers.integrations.sdpa_attention as sdpa_module
    from transformers import AttentionInterface

    calls = []

    def recorder(name):
        def forward(module, query, key, value, attention_mask, **kwargs):
            calls.append((name, module, query, key, value, attention_mask, kwargs))
            return name
        return forward

    monkeypatch.setattr(flex_module, "flex_attention_forward", recorder("flex"))
    monkeypatch.setattr(sdpa_module, "sdpa_attention_forward", recorder("sdpa"))
    model = _sdpa_model()
    use_block_attention(model)
    attention = AttentionInterface()[SDPA_OR_FLEX]
    block = canvas_blocks(2, 4, 2)
    args = [object(), torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)]
    for mask, name in ((block_causal_block_mask(block, block > 0), "flex"), (block_causal_mask(block, block > 0),
                                                                             "sdpa"), (None, "sdpa")):
        assert attention(*args, mask, scaling=0.5, dropout=0.0) == name
        got = calls.pop()
        assert got[0] == name and got[5] is mask and got[6] == {"scaling": 0.5, "dropout": 0.0}
        assert all(a is b for a, b in zip(got[1:5], args))


# ---- block_forward -------------------------------------------------------------------------------------------------

def test_block_forward_contract(no_env):
    model = _sdpa_model()
    canvas = torch.tensor([[5, 6, 7, MASK, 11, MASK, 13, MASK, 15, MASK, EOS]])
    target = torch.tensor([[5, 6, 7, 10, 11, 12, 13, 14, 15, 16, EOS]])
    prompt_len, width = torch.tensor([3]), torch.tensor([11])
    with torch.no_grad():
        logits = block_forward(model, canvas, target, prompt_len, width)
        # by hand: the raw layout through the model, outputs gathered at pred_at / noised_at
        layout = VectorisedLayout(prompt_len, width, 4, True)
        raw_logits, raw_hidden = model(layout.inputs(canvas, target), attention_mask=layout.mask("dense"),
                                       position_ids=layout.position_ids, return_hidden=True, align=False)
        assert torch.equal(logits, layout.logical(raw_logits, layout.pred_at))
        logits2, hidden = block_forward(model, canvas, target, prompt_len, width, return_hidden=True)
        assert torch.equal(logits2, logits)
        assert torch.equal(hidden, layout.logical(raw_hidden, layout.noised_at))
        # a DDP-style wrapper is read through `.module`
        assert torch.equal(block_forward(_Wrapper(model), canvas, target, prompt_len, width), logits)
    full = tiny_model(64, attention="bidirectional", family="masked", mask_token_id=MASK)
    with pytest.raises(ValueError,
                       match=r"^block_forward needs a model with spec.block_size \(a block-causal model\)$"):
        block_forward(full, canvas, target, prompt_len, width)


# ---- block ids -----------------------------------------------------------------------------------------------------

def test_canvas_blocks_and_response_blocks():
    assert canvas_blocks(2, 3, 1).tolist() == [[0, 0, 1, 2, 3]]  # blocks of one token
    ids = canvas_blocks(2, 5, 2, batch=3)
    assert ids.dtype == torch.long and ids.shape == (3, 7)
    assert ids.tolist() == [[0, 0, 1, 1, 2, 2, 3]] * 3
    with pytest.raises(ValueError, match="^block_size must be >= 1, got 0$"):
        canvas_blocks(2, 4, 0)
    assert [num_blocks(n, 4) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
    maskable = torch.tensor([[F, F, T, T, T, T, T, F], [F, T, T, F, F, F, F, F], [F] * 8])
    assert response_blocks(maskable, 2).tolist() == [[0, 0, 1, 1, 2, 2, 3, 0], [0, 1, 1, 0, 0, 0, 0, 0], [0] * 8]


def test_attends_nothing_by_hand():
    # keys: a clean block-0 key, a noised block-2 key, a padding clean block-1 key
    kb, kn, kv = torch.tensor([[0, 2, 1]]), torch.tensor([[0, 1, 0]]), torch.tensor([[1, 1, 0]])
    qb = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    qn = torch.tensor([[0, 0, 0, 1, 1, 1, 1]])
    # clean queries all see the block-0 key; a noised query needs an earlier clean key (blocks >= 1) or its block's
    # noised key (block 2): only the noised block-0 query sees nothing
    assert attends_nothing(qb, qn, kb, kn, kv).tolist() == [[F, F, F, T, F, F, F]]
    assert attends_nothing(qb, qn, kb, kn).tolist() == [[F, F, F, T, F, F, F]]
    # without the clean block-0 key: clean queries need a clean key of block <= theirs (the padding one is invalid)
    kv = torch.tensor([[0, 1, 0]])
    assert attends_nothing(qb, qn, kb, kn, kv).tolist() == [[T, T, T, T, T, F, T]]
    assert torch.equal(attends_nothing(qb, qn, kb, kn, kv),
                       ~block_causal_allowed(qb, qn, kb, kn, kv).any(-1))
    # more rows than keys: per-row tables, not per-key
    kb, kn = torch.tensor([[0, 1], [1, 2], [2, 0]]), torch.tensor([[0, 1], [0, 1], [1, 1]])
    qb, qn = torch.tensor([[1, 1], [1, 2], [1, 2]]), torch.tensor([[1, 0], [1, 1], [1, 1]])
    assert attends_nothing(qb, qn, kb, kn).tolist() == [[F, F], [T, F], [T, F]]
    assert torch.equal(attends_nothing(qb, qn, kb, kn), ~block_causal_allowed(qb, qn, kb, kn).any(-1))


# ---- the flex path end to end, with a reference kernel ---------------------------------------------------------------

def _reference_flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                              training=False, **_):
    """flex_attention's result by definition: sdpa under the BlockMask's mask_mod evaluated element by element (the
    compiled kernel itself: test_flex_attention.py)."""
    allowed = create_mask(block_mask.mask_mod, query.shape[0], None, query.shape[-2], key.shape[-2], device="cpu")
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scale,
                                                            enable_gqa=enable_gqa)


def test_flex_block_forward_equals_dense(monkeypatch):
    """block_forward through backend flex (BlockMask, switched backbone, transformers' flex_attention_forward) gives
    the dense backend's logits and carry states."""
    import transformers.integrations.flex_attention as flex_module

    monkeypatch.setattr(flex_module, "compile_friendly_flex_attention", _reference_flex_attention)
    model = tiny_model(64, attention="block_causal", family="masked", label_shift=True, block_size=4,
                       mask_token_id=MASK, eos_token_id=EOS, carry=True, seed=3)
    from dlm.modeling.carry import CARRY_MODULE

    with torch.no_grad():
        getattr(model.backbone, CARRY_MODULE).weight.normal_(generator=torch.Generator().manual_seed(0))
    perturb(model, 5)
    g = torch.Generator().manual_seed(1)
    target = torch.randint(3, 60, (2, 11), generator=g)
    canvas = torch.where(torch.rand(2, 11, generator=g) < 0.5, MASK, target)
    prompt_len, width = torch.tensor([3, 2]), torch.tensor([11, 6])
    carry = torch.randn(2, 11, model.config.hidden_size, generator=g)
    with torch.no_grad():
        dense, dense_hidden = block_forward(model, canvas, target, prompt_len, width, carry=carry, return_hidden=True,
                                            backend="dense")
        flex, flex_hidden = block_forward(_Wrapper(model), canvas, target, prompt_len, width, carry=carry,
                                          return_hidden=True, backend="flex")
    assert model.backbone.config._attn_implementation == SDPA_OR_FLEX
    response = torch.arange(11) >= prompt_len[:, None]
    response &= torch.arange(11) < width[:, None]
    torch.testing.assert_close(flex[response], dense[response], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(flex_hidden[response], dense_hidden[response], atol=1e-5, rtol=1e-5)
    assert (dense[response] - dense[response].mean()).abs().max() > 1  # outputs that vary: a wrong mask shows


def test_block_mask_is_defined_on_whole_tiles():
    """mask_mod may be called at indices up to the next whole tile of 128 (pytorch/pytorch#137801; the compiled CUDA
    path does): it is defined there and allows no key beyond K but in opened rows; inside [Q, K] it is the dense
    mask."""
    qb, kb = torch.tensor([[0, 0, 1, 1, 2], [0, 1, 1, 2, 2]]), torch.tensor([[0, 0, 1, 1, 2, 2, 3], [0] * 7])
    qn, kn = qb > 1, kb > 2
    valid = torch.tensor([[1] * 7, [0] * 7])
    block_mask = block_causal_block_mask(qb, qn, kb, kn, valid)
    assert block_mask.shape == (2, 1, 5, 7)
    whole = create_mask(block_mask.mask_mod, 2, None, 128, 128, device="cpu")[:, 0]
    dense = block_causal_mask(qb, qn, kb, kn, valid)[:, 0] == 0
    assert torch.equal(whole[:, :5, :7], dense)
    assert dense[1].all()  # row 1 has no valid key: every query opened, as in the dense mask
    assert not whole[0, :, 7:].any()  # (an opened row, as row 1, is open to every key)
