"""The one model-assembly path (`dlm.modeling.build`): every extra the spec names is attached, saved, restored from a
source that holds it and freshly initialised from one that does not; a model whose dlm.json names an extra it does
not hold is an error, never a silent re-initialisation."""

import pytest
import torch

from dlm.errors import DlmError, ModelNotFoundError
from dlm.modeling.backbone import build_backbone
from dlm.modeling.build import EXTRAS, build, load_model
from dlm.modeling.carry import CARRY_MODULE
from dlm.modeling.reward import REWARD_HEAD
from dlm.modeling.simplex import TIMESTEP_EMBEDDING
from dlm.modeling.spec import ModelSpec

VOCAB = 48
SPECS = {
    "ar": ModelSpec(),
    "masked": ModelSpec(family="masked", attention="bidirectional", label_shift=True, mask_token_id=3),
    "carry": ModelSpec(family="masked", attention="bidirectional", mask_token_id=3, carry=True),
    "block_carry": ModelSpec(family="masked", attention="block_causal", block_size=4, mask_token_id=3, carry=True),
    "simplex": ModelSpec(family="simplex", attention="bidirectional", label_shift=True, simplex_k=5.0,
                         simplex_timesteps=100, self_conditioning=True),
    "reward": ModelSpec(family="reward", eos_token_id=1, pad_token_id=0),
}
EXTRA_OF = {"carry": CARRY_MODULE, "block_carry": CARRY_MODULE, "simplex": TIMESTEP_EMBEDDING, "reward": REWARD_HEAD}


def _fresh(spec, seed=0):
    torch.manual_seed(seed)
    return build(spec, arch="llama", preset="nano", vocab_size=VOCAB, max_positions=64)


def _randomise_extras(model, seed=5):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for extra in EXTRAS:
            if hasattr(model.backbone, extra.name):
                for p in getattr(model.backbone, extra.name).parameters():
                    p.copy_(torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("name", list(SPECS))
def test_each_spec_gets_exactly_its_extras(name):
    model = _fresh(SPECS[name])
    attached = {e.name for e in EXTRAS if hasattr(model.backbone, e.name)}
    assert attached == ({EXTRA_OF[name]} if name in EXTRA_OF else set())
    assert model.backbone.config.is_causal == (SPECS[name].attention == "causal")
    if name in ("carry", "block_carry", "simplex"):  # zero-initialised: an AR start computes what it computed
        assert not any(p.any() for p in getattr(model.backbone, EXTRA_OF[name]).parameters())


@pytest.mark.parametrize("name", list(SPECS))
def test_save_and_load_restore_every_weight(tmp_path, name):
    model = _fresh(SPECS[name])
    _randomise_extras(model)
    model.save_pretrained(tmp_path / "m")
    back = load_model(tmp_path / "m")
    assert back.spec == model.spec and not back.training
    want, got = model.state_dict(), back.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_a_source_without_the_extra_starts_it_fresh_and_keeps_the_backbone(tmp_path):
    parent = _fresh(SPECS["masked"], seed=1)
    parent.save_pretrained(tmp_path / "mdm")
    child = build(SPECS["carry"], tmp_path / "mdm")  # PUMBA: a carry model continued from an MDM
    norm = getattr(child.backbone, CARRY_MODULE)
    assert not norm.weight.any() and not norm.bias.any()
    parent_state = parent.backbone.state_dict()
    for k, v in child.backbone.state_dict().items():
        if not k.startswith(CARRY_MODULE):
            assert torch.equal(v, parent_state[k]), k
    # and a source that holds the extra restores it (a carry model continued with a carry)
    _randomise_extras(child)
    child.save_pretrained(tmp_path / "pu")
    again = build(SPECS["carry"], tmp_path / "pu")
    assert torch.equal(getattr(again.backbone, CARRY_MODULE).weight, norm.weight)


def test_a_model_missing_an_extra_its_spec_names_is_an_error(tmp_path):
    model = _fresh(SPECS["reward"])
    model.backbone.save_pretrained(tmp_path / "m", state_dict={k: v for k, v in model.backbone.state_dict().items()
                                                              if not k.startswith(REWARD_HEAD)})
    model.spec.save(tmp_path / "m")
    with pytest.raises(ModelNotFoundError, match="reward head.*dlm_reward_head"):
        load_model(tmp_path / "m")


def test_an_extra_of_the_wrong_shape_is_an_error(tmp_path):
    model = _fresh(SPECS["carry"])
    state = model.backbone.state_dict()
    state[f"{CARRY_MODULE}.weight"] = torch.ones(3)
    model.backbone.save_pretrained(tmp_path / "m", state_dict=state)
    model.spec.save(tmp_path / "m")
    with pytest.raises(DlmError, match=r"dlm_carry_norm.weight has shape \(3,\)"):
        load_model(tmp_path / "m")


def test_plain_hf_checkpoint_is_an_ar_model_and_grows_for_new_tokens(tmp_path):
    torch.manual_seed(0)
    build_backbone("qwen2", "nano", VOCAB, 64, "causal").save_pretrained(tmp_path / "hf")
    assert load_model(tmp_path / "hf").spec == ModelSpec()
    grown = build(SPECS["masked"], tmp_path / "hf", vocab_size=VOCAB + 2)  # e.g. an added mask token
    assert grown.backbone.get_input_embeddings().weight.shape[0] == VOCAB + 2
    assert grown.config.model_type == "qwen2" and grown.backbone.config.is_causal is False


def test_missing_paths_and_inconsistent_specs_are_user_errors(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such file or directory"):
        load_model(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="no model here"):
        load_model(tmp_path / "empty")
    with pytest.raises(ValueError, match="simplex_k and simplex_timesteps"):
        ModelSpec(family="simplex")
    with pytest.raises(ValueError, match="carry is for masked models"):
        ModelSpec(carry=True)
    with pytest.raises(ValueError, match="block_size is required"):
        ModelSpec(family="masked", attention="block_causal")


def test_dtype_reaches_the_extras(tmp_path):
    model = _fresh(SPECS["block_carry"])
    _randomise_extras(model)
    model.save_pretrained(tmp_path / "m")
    back = load_model(tmp_path / "m", dtype=torch.bfloat16)
    assert {p.dtype for p in back.parameters()} == {torch.bfloat16}
    assert torch.equal(getattr(back.backbone, CARRY_MODULE).weight,
                       getattr(model.backbone, CARRY_MODULE).weight.to(torch.bfloat16))
