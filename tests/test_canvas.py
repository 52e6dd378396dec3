"""Canvases laid out by hand (PUMBA §B.4, §B.4.1): truncation, block rounding, the masks every objective reads, and
their dtypes (a float mask or prompt length is a silent bug downstream: masks multiply, ids index)."""

import pytest
import torch

from dlm.data.canvas import (
    Example,
    collate,
    collate_packed,
    collate_pairs,
    left_pad,
    make_example,
    pack_documents,
    response_span,
)

EOS, PAD = 1, 0


def test_response_span_rounds_response_and_eos_up_to_blocks():
    assert [response_span(n) for n in (0, 3, 7)] == [1, 4, 8]  # the response and its EOS
    assert [response_span(n, 4) for n in (0, 2, 3, 4, 7, 8)] == [4, 4, 4, 8, 8, 12]
    assert response_span(5, 1) == 6 and response_span(5, 3) == 6 and response_span(6, 3) == 9


def test_make_example_reserves_the_response_then_left_truncates_the_prompt():
    e = make_example(list(range(10, 20)), [1, 2, 3], max_length=8)
    assert e == Example(list(range(16, 20)), [1, 2, 3])  # 3 + EOS reserved, the last 4 prompt tokens kept
    e = make_example([7, 8], list(range(30, 40)), max_length=6)  # min_prompt 1: response cut to 6 - 1 - 1
    assert e == Example([8], list(range(30, 34)))
    e = make_example([1, 2, 3], list(range(30, 40)), max_length=5, min_prompt=0)  # no room left for a prompt
    assert e == Example([], [30, 31, 32, 33])


def test_make_example_under_blocks():
    # 2 + EOS round up to one block of 4: the prompt gets the other 6 positions
    assert make_example(list(range(20)), [5, 6], 10, block_size=4) == Example(list(range(14, 20)), [5, 6])
    # a long response: (10 - 1) // 4 = 2 blocks of room, response cut to 2*4 - 1 (its EOS closes the last block)
    e = make_example([9, 9, 9], list(range(30, 50)), 10, block_size=4)
    assert e.response_ids == list(range(30, 37)) and e.prompt_ids == [9, 9]
    # exactly one block of room is enough
    assert make_example([9], list(range(30, 40)), 5, block_size=4) == Example([9], [30, 31, 32])
    with pytest.raises(ValueError, match="max_length 4 leaves no room for one block of 4"):
        make_example([9], [1], 4, block_size=4)


def test_collate_layout_and_dtypes():
    b = collate([Example([5, 6, 7], [10, 11]), Example([8], [20])], EOS, PAD, pad_to=8)
    assert b["input_ids"].tolist() == [[5, 6, 7, 10, 11, EOS, PAD, PAD], [8, 20, EOS, PAD, PAD, PAD, PAD, PAD]]
    assert b["attention_mask"].tolist() == [[1] * 8] * 2  # padding is attended (§B.4.1)
    assert b["maskable"].tolist() == [[False] * 3 + [True] * 5, [False] + [True] * 7]
    assert b["loss_mask"].tolist() == [[False] * 3 + [True] * 3 + [False] * 2, [False, True, True] + [False] * 5]
    assert b["prompt_len"].tolist() == [3, 1]
    expected = {"input_ids": torch.long, "attention_mask": torch.long, "maskable": torch.bool,
                "loss_mask": torch.bool, "prompt_len": torch.long}
    assert {k: v.dtype for k, v in b.items()} == expected
    assert collate([Example([5], [6])], EOS, PAD)["input_ids"].shape == (1, 3)  # no pad_to: the longest row


def test_collate_blocks_layout_and_dtypes():
    b = collate([Example([5, 6, 7], [10, 11, 12, 13]), Example([8], [20])], EOS, PAD, pad_to=12, block_size=4)
    assert b["input_ids"].tolist() == [[5, 6, 7, 10, 11, 12, 13, EOS, EOS, EOS, EOS, PAD],
                                       [8, 20, EOS, EOS, EOS, PAD, PAD, PAD, PAD, PAD, PAD, PAD]]
    assert b["attention_mask"].tolist() == [[1] * 11 + [0], [1] * 5 + [0] * 7]  # padding beyond the blocks: not
    assert b["maskable"].tolist() == [[False] * 3 + [True] * 8 + [False], [False] + [True] * 4 + [False] * 7]
    assert torch.equal(b["loss_mask"], b["maskable"]) and b["loss_mask"] is not b["maskable"]
    assert b["prompt_len"].tolist() == [3, 1]
    assert [b[k].dtype for k in ("input_ids", "attention_mask", "maskable", "loss_mask", "prompt_len")] == \
        [torch.long, torch.long, torch.bool, torch.bool, torch.long]
    assert collate([Example([5], [6])], EOS, PAD, block_size=4)["input_ids"].shape == (1, 5)


def test_collate_packed_and_pairs():
    rows = pack_documents([[5, 6, 7], [8, 9]], 3, EOS)
    assert rows.dtype == torch.long and rows.tolist() == [[5, 6, 7], [EOS, 8, 9]]  # tail EOS dropped
    assert pack_documents([[5, 6]], 3, EOS).tolist() == [[5, 6, EOS]]  # exactly one row
    with pytest.raises(ValueError, match="corpus too short to pack: 3 tokens < seq_len 4"):
        pack_documents([[5, 6]], 4, EOS)
    b = collate_packed(list(rows))
    assert torch.equal(b["input_ids"], rows) and b["attention_mask"].dtype == torch.long
    assert b["maskable"].shape == b["loss_mask"].shape == (2, 3)
    assert b["maskable"].all() and b["loss_mask"].all() and b["maskable"].dtype == torch.bool
    assert b["loss_mask"] is not b["maskable"] and b["attention_mask"].tolist() == [[1] * 3] * 2
    assert b["prompt_len"].tolist() == [0, 0] and b["prompt_len"].dtype == torch.long
    pairs = [(Example([5], [6]), Example([5], [7, 7])), (Example([8], [9]), Example([8], [3]))]
    b = collate_pairs(pairs, EOS, PAD)
    assert b["input_ids"].tolist() == [[5, 6, EOS, PAD], [8, 9, EOS, PAD], [5, 7, 7, EOS], [8, 3, EOS, PAD]]


def test_left_pad():
    ids, mask = left_pad([[5, 6, 7], [8], []], PAD)
    assert ids.tolist() == [[5, 6, 7], [PAD, PAD, 8], [PAD, PAD, PAD]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    assert ids.dtype == torch.long and mask.dtype == torch.long
