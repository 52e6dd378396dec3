"""Block masks that scale: the flex-attention BlockMask evaluates the same rule as the dense mask (element by element
and tile by tile), and a block-causal model gives the same logits through flex_attention as through sdpa, for the
vectorised training layout and for block decoding with a KV cache; a backbone switched to take BlockMasks computes
dense and 2-D masks exactly as before. On CPU transformers compiles flex_attention (gcc): the logits test pays ~25 s
of compile for its three shapes with a cold inductor cache, ~4 s with a warm one."""

import os
import shutil

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask
from transformers import DynamicCache

from dlm.data.canvas import Example, collate
from dlm.modeling.blocks import (
    BLOCK_ATTENTION_ENV,
    SDPA_OR_FLEX,
    VectorisedLayout,
    attends_nothing,
    block_attention_backend,
    block_attention_mask,
    block_causal_allowed,
    block_causal_block_mask,
    block_causal_mask,
    block_forward,
    canvas_blocks,
    use_block_attention,
)
from tests.conftest import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
EOS, PAD, MASK = 2, 0, 63


def _random_facts(B, Q, K, seed):
    g = torch.Generator().manual_seed(seed)
    qb, kb = torch.randint(0, 4, (B, Q), generator=g), torch.randint(0, 4, (B, K), generator=g)
    qn, kn = torch.rand(B, Q, generator=g) < 0.4, torch.rand(B, K, generator=g) < 0.4
    valid = torch.rand(B, K, generator=g) < 0.8
    valid[0] = False  # a row with no valid key at all: every query attends to nothing
    return qb, qn, kb, kn, valid


def _flex_allowed(block_mask):
    B, _, Q, K = block_mask.shape
    return create_mask(block_mask.mask_mod, B, None, Q, K, device="cpu")[:, 0]


@pytest.mark.parametrize("seed", [0, 1])
def test_attends_nothing_matches_the_grid(seed):
    qb, qn, kb, kn, valid = _random_facts(3, 9, 11, seed)
    want = ~block_causal_allowed(qb, qn, kb, kn, valid).any(-1)
    assert want.any() and not want.all()
    assert torch.equal(attends_nothing(qb, qn, kb, kn, valid), want)


def test_block_mask_equals_dense_mask_exactly():
    # random facts (queries and keys of different lengths, padding, empty rows)
    qb, qn, kb, kn, valid = _random_facts(3, 9, 11, 2)
    dense = block_causal_mask(qb, qn, kb, kn, valid)[:, 0] == 0
    assert torch.equal(_flex_allowed(block_causal_block_mask(qb, qn, kb, kn, valid)), dense)
    # the vectorised training layout: rows of different prompts and block counts, right-padded, T > 2 tiles of 128
    prompt_len, width = torch.tensor([20, 7, 33]), torch.tensor([20 + 8 * 16, 7 + 2 * 16, 33 + 5 * 16])
    layout = VectorisedLayout(prompt_len, width, 16, label_shift=True)
    dense = layout.mask("dense")[:, 0] == 0
    block_mask = layout.mask("flex")
    assert block_mask.shape == (3, 1, 276, 276)
    allowed = _flex_allowed(block_mask)
    assert torch.equal(allowed, dense)
    # tile by tile: a tile is computed (partial or full) exactly when some element in it is allowed
    tiles = torch.nn.functional.pad(allowed, (0, 384 - 276, 0, 384 - 276)).reshape(3, 3, 128, 3, 128).any(-1).any(-2)
    assert torch.equal(block_mask.to_dense()[:, 0].bool(), tiles)
    assert not tiles.all()  # the layout really skips tiles
    # the decoding masks: the current block and every later one noised, left-padded prompts
    blocks = canvas_blocks(5, 12, 4, 2)
    noised = blocks > 2
    attention = torch.tensor([[0, 0, 1, 1, 1] + [1] * 12, [1] * 17])
    dense = block_causal_mask(blocks, noised, k_valid=attention)[:, 0] == 0
    assert torch.equal(_flex_allowed(block_causal_block_mask(blocks, noised, k_valid=attention)), dense)
    # KV-cache steps: queries are the block, keys the clean context and the block
    dense = block_causal_mask(blocks[:, 9:13], noised[:, 9:13], blocks[:, :13], noised[:, :13], attention[:, :13])
    flex = block_causal_block_mask(blocks[:, 9:13], noised[:, 9:13], blocks[:, :13], noised[:, :13], attention[:, :13])
    assert torch.equal(_flex_allowed(flex), dense[:, 0] == 0)


def test_backend_selection(monkeypatch):
    monkeypatch.delenv(BLOCK_ATTENTION_ENV, raising=False)
    assert block_attention_backend("auto", "cpu") == "dense"
    assert block_attention_backend("auto", "cuda") == "flex"
    assert block_attention_backend("flex", "cpu") == "flex"
    monkeypatch.setenv(BLOCK_ATTENTION_ENV, "flex")
    assert block_attention_backend("auto", "cpu") == "flex"
    assert block_attention_backend("dense", "cpu") == "dense"  # an explicit argument wins
    monkeypatch.setenv(BLOCK_ATTENTION_ENV, "dense")
    assert block_attention_backend("auto", "cuda") == "dense"
    monkeypatch.setenv(BLOCK_ATTENTION_ENV, " Flex ")  # read case- and space-insensitively
    assert block_attention_backend("auto", "cpu") == "flex"
    monkeypatch.setenv(BLOCK_ATTENTION_ENV, "sparse")
    with pytest.raises(ValueError, match=f"^environment variable {BLOCK_ATTENTION_ENV}: unknown block attention "
                                         r"'sparse'; choose dense or flex \(or auto\)$"):
        block_attention_backend("auto", "cpu")
    with pytest.raises(ValueError, match=r"^backend argument: unknown block attention 'fast'; choose dense or flex "
                                         r"\(or auto\)$"):
        block_attention_backend("fast", "cpu")
    monkeypatch.setenv(BLOCK_ATTENTION_ENV, "")  # empty: as if unset
    assert block_attention_backend() == "dense"  # defaults: auto, no device (the CPU)
    assert block_attention_backend("auto", torch.device("cuda")) == "flex"


def _model():
    model = tiny_model(64, attention="block_causal", family="masked", label_shift=True, block_size=4,
                       mask_token_id=MASK, eos_token_id=EOS, carry=True, seed=3)
    from dlm.modeling.carry import CARRY_MODULE

    with torch.no_grad():
        getattr(model.backbone, CARRY_MODULE).weight.normal_(generator=torch.Generator().manual_seed(0))
    return model


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                    reason="flex_attention on CPU runs through torch.compile, which needs a C++ compiler")
def test_flex_logits_equal_dense_for_training_layout_and_block_decoding():
    # one static compile per shape: torch 2.13's CPU flex template fails to build once dynamo turns a shape dynamic
    # (g++: 'cur_kvSplitSize0' was not declared). torch's own config.patch, not monkeypatch: pytest 9's monkeypatch
    # undoes a setattr on torch's config module with a delattr, which hides the option for the rest of the process
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        _flex_logits_equal_dense()


def _flex_logits_equal_dense():
    model = _model()
    examples = [Example([5, 6, 7], [10, 11, 12, 13, 14]), Example([8, 9], [20, 21]),
                Example([30, 31, 32, 33, 34], [40])]
    b = collate(examples, EOS, PAD, block_size=4)
    g = torch.Generator().manual_seed(0)
    canvas = torch.where((torch.rand(b["input_ids"].shape, generator=g) < 0.5) & b["maskable"], MASK, b["input_ids"])
    carry = torch.randn(*canvas.shape, model.config.hidden_size, generator=g)
    args = (canvas, b["input_ids"], b["prompt_len"], b["attention_mask"].sum(-1))
    with torch.no_grad():
        dense, dense_hidden = block_forward(model, *args, carry=carry, return_hidden=True, backend="dense")
        flex, flex_hidden = block_forward(model, *args, carry=carry, return_hidden=True, backend="flex")
        assert model.backbone.config._attn_implementation == SDPA_OR_FLEX
        # dense and 2-D masks still go through sdpa on the switched backbone: bit for bit what they gave before
        assert torch.equal(block_forward(model, *args, carry=carry, backend="dense"), dense)
        plain = tiny_model(64, attention="bidirectional", family="masked", seed=4)
        ids, ones = b["input_ids"], torch.ones_like(b["input_ids"])
        before = plain(ids, attention_mask=ones)
        use_block_attention(plain)
        assert torch.equal(plain(ids, attention_mask=ones), before)
        response = b["maskable"]
        torch.testing.assert_close(flex[response], dense[response], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(flex_hidden[response], dense_hidden[response], atol=1e-5, rtol=1e-5)

        # block decoding, as the KV-cached decoder runs it: the fused pass [prompt | noised block 1] into a cache,
        # cropped to the prompt, then a step of block 1 against the cache (queries 4, keys 9)
        P, S = 5, 4
        ids = torch.tensor([[PAD, PAD, 5, 6, 7] + [MASK] * 8, [9, 8, 5, 6, 7] + [MASK] * 8])
        attention = (ids != PAD).long()
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        blocks = canvas_blocks(P, 8, S, 2)
        noised = torch.arange(P + S).expand(2, -1) >= P
        logits = {}
        for backend in ("dense", "flex"):
            cache = DynamicCache()
            mask = block_attention_mask(blocks[:, :P + S], noised, blocks[:, :P + S], noised,
                                        attention[:, :P + S], backend=backend, model=model)
            first = model(ids[:, :P + S], attention_mask=mask, position_ids=positions[:, :P + S], cache=cache,
                          use_cache=True, align=False)
            cache.crop(-S)
            step_ids = ids[:, :P + S].clone()
            step_ids[:, P] = 11  # a committed token
            mask = block_attention_mask(blocks[:, P:P + S], noised[:, P:], blocks[:, :P + S], noised,
                                        attention[:, :P + S], backend=backend, model=model)
            step = model(step_ids[:, P:], attention_mask=mask, position_ids=positions[:, P:P + S], cache=cache,
                         use_cache=True, align=False)
            logits[backend] = (first[attention[:, :P + S].bool()], step)
        for got, want in zip(logits["flex"], logits["dense"]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention has no backward on CPU (torch 2.13)")
def test_flex_gradients_equal_dense_on_cuda():
    """Block MDM training gradients through flex_attention equal those through sdpa (with layer checkpointing)."""
    import copy

    from dlm.training.objectives.block_mdm import BlockMDMObjective

    model = tiny_model(64, attention="block_causal", family="masked", label_shift=True, block_size=4,
                       mask_token_id=MASK, eos_token_id=EOS).cuda().train()
    model.enable_activation_checkpointing()
    examples = [Example([5, 6, 7], [10, 11, 12, 13, 14]), Example([8, 9], [20, 21])]
    batch = {k: v.cuda() for k, v in collate(examples, EOS, PAD, block_size=4).items()}
    objective = BlockMDMObjective(MASK, 4, seed=0)
    grads = {}
    for backend in ("dense", "flex"):
        m = copy.deepcopy(model)
        os.environ[BLOCK_ATTENTION_ENV] = backend
        try:
            loss, _, _ = copy.deepcopy(objective).loss(m, batch)
        finally:
            del os.environ[BLOCK_ATTENTION_ENV]
        loss.backward()
        grads[backend] = {n: p.grad for n, p in m.named_parameters()}
    for n, g in grads["dense"].items():
        torch.testing.assert_close(grads["flex"][n], g, atol=1e-4, rtol=1e-3, msg=n)
