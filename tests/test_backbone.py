import torch

from dlm.modeling.backbone import align_logits, build_backbone, load_backbone
from dlm.modeling.build import load_model
from tests.conftest import tiny_model


def _changes_first_position(model, vocab=100):
    x = torch.randint(3, vocab, (1, 12), generator=torch.Generator().manual_seed(0))
    y = x.clone()
    y[0, -1] = (y[0, -1] + 1) % vocab
    with torch.no_grad():
        return (model(x)[0, 0] - model(y)[0, 0]).abs().max().item() > 1e-6


def test_bidirectional_really_is(tmp_path):
    for arch in ("llama", "mistral", "qwen2"):
        for impl in ("sdpa", "eager"):
            m = tiny_model(100, attention="bidirectional", family="masked", arch=arch)
            m.backbone.config._attn_implementation = impl
            assert _changes_first_position(m), f"{arch}/{impl}: later token did not change position 0"
    causal = tiny_model(100, attention="causal")
    assert not _changes_first_position(causal)
    # survives save / reload
    m = tiny_model(100, attention="bidirectional", family="masked")
    m.save_pretrained(tmp_path / "m")
    assert _changes_first_position(load_model(tmp_path / "m"))


def test_architectures_build():
    for arch in ("llama", "mistral", "qwen2"):
        b = build_backbone(arch, "nano", 50, 64, "bidirectional")
        assert b.config.model_type == arch and b.config.is_causal is False


def test_label_shift_alignment():
    logits = torch.arange(2 * 4 * 3, dtype=torch.float).view(2, 4, 3)
    shifted = align_logits(logits, label_shift=True)
    assert torch.equal(shifted[:, 1:], logits[:, :-1])  # index i holds the output of position i-1
    assert torch.equal(align_logits(logits, label_shift=False), logits)
    m = tiny_model(60, attention="bidirectional", family="masked", label_shift=True)
    x = torch.randint(0, 60, (1, 6))
    with torch.no_grad():
        raw = m.backbone(input_ids=x).logits
        assert torch.equal(m(x)[:, 1:], raw[:, :-1])


def test_save_load_round_trip(tmp_path):
    m = tiny_model(70, attention="bidirectional", family="masked", label_shift=True)
    m.spec.mask_token_id = 2
    m.save_pretrained(tmp_path / "m")
    assert (tmp_path / "m" / "dlm.json").is_file()
    r = load_model(tmp_path / "m")
    assert r.spec == m.spec
    x = torch.randint(0, 70, (2, 9))
    with torch.no_grad():
        assert torch.equal(m(x), r(x))


def test_plain_hf_checkpoint_loads_with_attention_override(tmp_path):
    hf = build_backbone("qwen2", "nano", 40, 64, "causal")
    hf.save_pretrained(tmp_path / "hf")  # no dlm.json: any local HF causal LM
    b = load_backbone(tmp_path / "hf", attention="bidirectional")
    assert b.config.is_causal is False
    m = load_model(tmp_path / "hf")
    assert m.spec.family == "autoregressive"
