"""One model directory resolved once (`dlm.modeling.resolve`): the resolved object of each kind says where the model
is, what it is and where its tokenizer comes from; loading a model for generation or for training walks the
directory once and reads its config.json (and dlm.json) once."""

import builtins
import io
from collections import Counter
from pathlib import Path

import pytest

import dlm.modeling.backbone as backbone_module
from dlm.errors import DlmError, ModelNotFoundError
from dlm.modeling import resolve as resolve_module
from dlm.modeling.backbone import build_backbone
from dlm.modeling.formats import DREAM, LLADA
from dlm.modeling.resolve import ResolvedModel, resolve_model
from dlm.modeling.spec import ModelSpec
from dlm.sampling import generate_text
from tests.conftest import tiny_model
from tests.foreign import write_dream, write_llada


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tiny_tokenizer):
    """One directory of each kind: a dlm masked run (model in run/model), a dlm simplex model, a plain HF causal LM
    without a tokenizer, a LLaDA and a Dream release."""
    root, tok = tmp_path_factory.mktemp("resolve"), tiny_tokenizer
    ids = dict(mask_token_id=tok.mask_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    masked = tiny_model(len(tok), "bidirectional", "masked", **ids)
    simplex = tiny_model(len(tok), "bidirectional", "simplex", label_shift=True, simplex_k=5.0,
                         simplex_timesteps=100, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    for model, where in ((masked, root / "run" / "model"), (simplex, root / "simplex")):
        model.save_pretrained(where)
        tok.save_pretrained(where)
    build_backbone("llama", "nano", len(tok)).save_pretrained(root / "hf")
    return {"masked": root / "run", "simplex": root / "simplex", "hf": root / "hf",
            "llada": write_llada(root / "llada"), "dream": write_dream(root / "dream")}


def test_a_dlm_masked_run_resolves_to_its_model_directory(dirs):
    r = resolve_model(dirs["masked"])
    assert r.path == dirs["masked"] / "model" and r.kind == "dlm" and r.release is None
    assert r.spec == ModelSpec.load(r.path) and r.saved_spec is r.spec and r.spec.family == "masked"
    assert r.tokenizer == "directory" and r.config["model_type"] == "llama"
    assert resolve_model(r) is r  # a resolved model is handed on, never resolved again


def test_a_dlm_simplex_model(dirs):
    r = resolve_model(dirs["simplex"])
    assert r.path == dirs["simplex"] and r.kind == "dlm" and r.release is None and r.tokenizer == "directory"
    assert r.spec.family == "simplex" and r.spec.simplex_k == 5.0 and r.spec.label_shift


def test_a_plain_hf_model_is_autoregressive_without_a_spec(dirs):
    r = resolve_model(dirs["hf"])
    assert r.kind == "hf" and r.spec is None and r.saved_spec is None and r.release is None and r.tokenizer is None
    config = r.hf_config()
    assert type(config).__name__ == "LlamaConfig" and config.vocab_size == r.config["vocab_size"]
    assert r.hf_config() is not config  # fresh each time: a model may change its own config
    with pytest.raises(TypeError):
        r.config["vocab_size"] = 1  # read once, read-only


@pytest.mark.parametrize("name, fmt", [("llada", LLADA), ("dream", DREAM)])
def test_a_release_gets_the_spec_its_format_implies(dirs, name, fmt):
    r = resolve_model(dirs[name])
    assert r.kind == "release" and r.release is fmt and r.tokenizer == "release" and r.saved_spec is None
    assert r.spec == ModelSpec(family="masked", attention="bidirectional", label_shift=fmt.label_shift,
                               mask_token_id=r.config["mask_token_id"], eos_token_id=r.config["eos_token_id"],
                               pad_token_id=r.config["pad_token_id"])
    assert r.spec.label_shift == (name == "dream")


def test_missing_and_empty_directories_and_unknown_architectures_are_one_line_errors(tmp_path):
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model(tmp_path / "nowhere")
    assert str(err.value) == f"{tmp_path / 'nowhere'}: no such file or directory"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="no model here"):
        resolve_model(tmp_path / "empty")
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text('{"model_type": "no_such_arch"}')
    odd = resolve_model(tmp_path / "odd")
    assert odd.kind == "hf"
    with pytest.raises(DlmError, match=r"config.json: model_type 'no_such_arch' is neither a Hugging Face"):
        odd.hf_config()


@pytest.fixture
def reads(monkeypatch):
    """Count, by file name, the files opened (Python-level, transformers' reads included) and the directory walks."""
    counts = Counter()

    def counting(real):
        def opened(file, *args, **kwargs):
            if isinstance(file, (str, Path)):
                counts[Path(file).name] += 1
            return real(file, *args, **kwargs)
        return opened

    real_walk = resolve_module.resolve_model_dir

    def walk(path):
        counts["walks"] += 1
        return real_walk(path)

    monkeypatch.setattr(builtins, "open", counting(builtins.open))
    monkeypatch.setattr(io, "open", counting(io.open))  # pathlib's read_text
    monkeypatch.setattr(resolve_module, "resolve_model_dir", walk)
    monkeypatch.setattr(backbone_module, "resolve_model_dir", walk)
    return counts


@pytest.mark.parametrize("name", ["masked", "llada", "dream"])
def test_generation_reads_config_once_and_walks_the_directory_once(dirs, reads, name):
    results = generate_text(dirs[name], ["Mia has 3 apples."], max_new_tokens=2, device="cpu", dtype="float32")
    assert len(results) == 1 and results[0]["nfe"] > 0
    assert reads["walks"] == 1 and reads["config.json"] == 1
    assert reads["dlm.json"] == (1 if name == "masked" else 0)


@pytest.mark.parametrize("name", ["masked", "llada"])
def test_training_assembly_reads_the_init_model_once(dirs, reads, tmp_path, name):
    from dlm.config import load_recipe
    from dlm.training.assembly import build_model, init_source, resolve_tokenizer

    recipe = load_recipe(None, [f"model.init_from={dirs[name]}", "model.attention=bidirectional",
                                "train.objective=mdm", "model.max_length=32"])
    reads.clear()
    source = init_source(recipe)
    tok = resolve_tokenizer(recipe, [], tmp_path, source)
    model = build_model(recipe, tok, source)
    assert isinstance(source, ResolvedModel) and model.spec.family == "masked"
    assert tok.mask_token_id == model.spec.mask_token_id == source.spec.mask_token_id
    assert reads["walks"] == 1 and reads["config.json"] == 1


def test_release_token_ids_default_to_the_published_ones_and_a_list_counts_as_its_first():
    from dlm.modeling.resolve import first_id, release_spec

    assert (first_id([5, 6]), first_id(7), first_id(None), first_id([])) == (5, 7, None, [])
    for fmt in (LLADA, DREAM):
        spec = release_spec(fmt, {})
        assert (spec.mask_token_id, spec.eos_token_id, spec.pad_token_id) == (
            fmt.mask_token_id, fmt.eos_token_id, fmt.pad_token_id)
        assert (spec.family, spec.attention, spec.label_shift) == ("masked", "bidirectional", fmt.label_shift)
    given = release_spec(LLADA, {"mask_token_id": 3, "eos_token_id": [4, 9], "pad_token_id": None})
    assert (given.mask_token_id, given.eos_token_id, given.pad_token_id) == (3, 4, LLADA.pad_token_id)


def test_config_errors_name_the_file(tmp_path, dirs):
    from dlm.modeling.resolve import read_config

    with pytest.raises(ModelNotFoundError) as err:
        read_config(tmp_path)
    assert str(err.value) == f"{tmp_path / 'config.json'}: no such file; a checkpoint directory holds its config.json"
    (tmp_path / "config.json").write_text('{"a": 1,\n oops}')
    with pytest.raises(DlmError) as err:
        read_config(tmp_path)
    assert str(err.value) == f"{tmp_path / 'config.json'}:2: malformed JSON (Expecting property name enclosed in " \
                             "double quotes)"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model(tmp_path / "empty")
    assert str(err.value) == (f"{tmp_path / 'empty'}: no model here (expected config.json in it or in "
                              f"{tmp_path / 'empty' / 'model'})")
    r = resolve_model(dirs["hf"])
    assert r.hf_config().name_or_path == str(r.path)
