
import pytest

from dlm.data.canvas import collate, left_pad, make_example, pack_documents
from dlm.data.sources import DataError, load_records, read_jsonl, read_text
from dlm.data.tokenizer import encode_pair, load_tokenizer, render_prompt, train_bpe_tokenizer


def test_malformed_line_names_file_and_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "a", "resp\n')
    with pytest.raises(DataError, match=r"d.jsonl:2: malformed JSON"):
        read_jsonl(p)


def test_missing_field_is_named(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a", "response": "b"}\n\n{"prompt": "a"}\n')
    with pytest.raises(DataError, match=r"d.jsonl:3: record is missing field 'response'"):
        read_jsonl(p)


def test_wrong_field_type_is_named(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": 3, "response": "b"}\n')
    with pytest.raises(DataError, match=r"d.jsonl:1: field 'prompt' must be a string"):
        read_jsonl(p)


def test_hf_dataset_source(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list([{"prompt": "p1", "response": "r1"}, {"prompt": "p2", "response": "r2"}])
    ds.save_to_disk(str(tmp_path / "ds"))
    assert [r["response"] for r in load_records(tmp_path / "ds")] == ["r1", "r2"]
    bad = datasets.Dataset.from_list([{"prompt": "p1"}])
    bad.save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(DataError, match=r"row 0: record is missing field 'response'"):
        load_records(tmp_path / "bad")


def test_read_text_splits_documents(tmp_path):
    p = tmp_path / "c.txt"
    p.write_text("doc one\nline two\n\n\ndoc two\n")
    assert read_text(p) == ["doc one\nline two", "doc two"]


def test_canvas_reserves_response_and_left_truncates_prompt():
    e = make_example(list(range(10, 30)), [1, 2, 3], max_length=8)
    assert e.response_ids == [1, 2, 3] and e.prompt_ids == list(range(26, 30))  # 4 + 3 + EOS = 8
    long = make_example([7, 8], list(range(100)), max_length=8)
    assert len(long.prompt_ids) + len(long.response_ids) + 1 == 8 and long.prompt_ids == [8]


def test_collate_masks_follow_padding_rules():
    from dlm.data.canvas import Example

    b = collate([Example([5, 6], [7, 8, 9]), Example([5], [7])], eos_id=1, pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9, 1], [5, 7, 1, 0, 0, 0]]
    assert b["attention_mask"].all()  # padding is attended (PUMBA §B.4.1)
    assert b["maskable"].tolist() == [[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]]  # padding maskable, prompt never
    assert b["loss_mask"].tolist() == [[0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0]]  # first EOS in loss, padding not
    assert b["prompt_len"].tolist() == [2, 1]


def test_pack_documents():
    rows = pack_documents([[1, 2, 3], [4, 5], [6]], seq_len=4, eos_id=0)
    assert rows.tolist() == [[1, 2, 3, 0], [4, 5, 0, 6]]


def test_left_pad():
    ids, mask = left_pad([[1, 2, 3], [4]], pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_bpe_is_deterministic_and_has_special_tokens(tmp_path, tiny_tokenizer):
    texts = [f"user: Ann has {i} cats.\nassistant: def solution():\n    return {i}" for i in range(200)]
    a = train_bpe_tokenizer(texts, 280)
    b = train_bpe_tokenizer(texts, 280)
    assert a.get_vocab() == b.get_vocab()
    for t in (a, tiny_tokenizer):
        ids = {t.eos_token_id, t.pad_token_id, t.mask_token_id}
        assert len(ids) == 3 and None not in ids
        assert t.decode(t("def solution():\n    x = 12")["input_ids"]) == "def solution():\n    x = 12"
    cached = train_bpe_tokenizer(texts, 280, cache_dir=tmp_path)
    again = train_bpe_tokenizer(texts, 280, cache_dir=tmp_path)
    assert cached.get_vocab() == again.get_vocab() == a.get_vocab()


def test_chat_template_renders_plain_role_labels(tmp_path, tiny_tokenizer):
    assert render_prompt(tiny_tokenizer, "How many?") == "user: How many?\nassistant: "
    tiny_tokenizer.save_pretrained(tmp_path / "tok")
    reloaded = load_tokenizer(tmp_path / "tok")
    assert render_prompt(reloaded, "How many?") == "user: How many?\nassistant: "
    p, r = encode_pair(reloaded, "Q?", "def solution():\n    return 1")
    assert reloaded.decode(p + r) == "user: Q?\nassistant: def solution():\n    return 1"


def test_foreign_tokenizer_gets_mask_and_pad(tmp_path, tiny_tokenizer):
    """Any HF tokenizer works: one without a mask/pad token is completed, and the vocabulary grows."""
    from transformers import PreTrainedTokenizerFast

    bare = PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer.backend_tokenizer, eos_token="<|eos|>")
    bare.save_pretrained(tmp_path / "bare")
    t = load_tokenizer(tmp_path / "bare")
    assert t.pad_token_id == t.eos_token_id and t.mask_token_id is not None
