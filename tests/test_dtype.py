"""Decoding at bfloat16 (`load_for_inference(dtype=...)`, `dlm generate/eval --dtype`): the whole loaded model is in
the dtype, dlm's own modules (carry LayerNorm, timestep embedding, reward head) included, and every sampler runs on it
with the usual shapes, NFE and EOS handling. Outputs are not compared across dtypes: bf16 may change greedy choices."""

import json
import math

import pytest
import torch

from dlm.errors import DlmError
from dlm.modeling.build import cast_model
from dlm.modeling.carry import CARRY_MODULE
from dlm.modeling.simplex import TIMESTEP_EMBEDDING
from dlm.sampling import generate, load_for_inference
from tests.conftest import perturb, tiny_model
from tests.test_simplex import simplex_model

BF16 = torch.bfloat16
NEVER = 10**6  # an EOS id outside the vocabulary: never produced

pytestmark = pytest.mark.usefixtures("one_thread")


def _spec_tokens(m, tok):
    m.spec = m.spec.model_copy(update={"mask_token_id": tok.mask_token_id, "eos_token_id": tok.eos_token_id,
                                       "pad_token_id": tok.pad_token_id})
    return m


def _ar(tok):
    return perturb(tiny_model(len(tok)))


def _masked(tok):
    return perturb(_spec_tokens(tiny_model(len(tok), attention="bidirectional", family="masked"), tok))


def _block_carry(tok, block_size=4):
    m = _spec_tokens(tiny_model(len(tok), attention="block_causal", family="masked", label_shift=True,
                                block_size=block_size, carry=True), tok)
    norm = getattr(m.backbone, CARRY_MODULE)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # not the zero init: the carry must reach the outputs
        norm.weight.copy_(1 + torch.randn(norm.weight.shape, generator=g))
        norm.bias.copy_(torch.randn(norm.bias.shape, generator=g))
    return perturb(m)


def _simplex(tok):
    return _spec_tokens(simplex_model(vocab=len(tok)), tok)


def _save(m, tok, directory):
    m.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def _prompts(tok, lengths=(3, 7, 5)):
    g = torch.Generator().manual_seed(4)
    special = {tok.eos_token_id, tok.pad_token_id, tok.mask_token_id}
    ordinary = [i for i in range(len(tok)) if i not in special]
    return [[ordinary[j] for j in torch.randint(0, len(ordinary), (n,), generator=g).tolist()] for n in lengths]


def assert_in_dtype(model, dtype=BF16):
    """Every parameter and saved buffer in `dtype`; RoPE's inverse frequencies in float32 (as transformers keeps
    them: rounded to bf16 they would shift rotary angles by up to ~0.2 rad at 512 positions for head dim 64)."""
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert {v.dtype for v in model.state_dict().values() if v.is_floating_point()} == {dtype}
    derived = {n: b.dtype for n, b in model.named_buffers() if n.endswith("inv_freq")}
    assert derived and set(derived.values()) == {torch.float32}


@pytest.fixture(scope="module")
def saved(tiny_tokenizer, tmp_path_factory):
    """The four generating families plus a reward model, saved as dlm model directories (float32 on disk)."""
    root = tmp_path_factory.mktemp("dtype")
    tok = tiny_tokenizer
    reward = tiny_model(len(tok), family="reward", eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    models = {"ar": _ar(tok), "masked": _masked(tok), "block_carry": _block_carry(tok), "simplex": _simplex(tok),
              "reward": reward}
    return {name: (m, _save(m, tok, root / name)) for name, m in models.items()}


# ---- loading ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["ar", "masked", "block_carry", "simplex", "reward"])
def test_load_puts_the_whole_model_in_bf16(saved, name):
    original, path = saved[name]
    model, _ = load_for_inference(path, dtype=BF16)
    assert_in_dtype(model)
    assert not model.training
    # the weights are the saved ones, rounded: dlm's own modules were restored, not re-initialised
    want = {k: v.to(BF16) for k, v in original.state_dict().items() if v.is_floating_point()}
    got = model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(got[k], v) for k, v in want.items())
    extra = {"block_carry": CARRY_MODULE, "simplex": TIMESTEP_EMBEDDING, "reward": "dlm_reward_head"}.get(name)
    if extra:
        assert getattr(model.backbone, extra).weight.dtype == BF16


def test_dtype_by_name_default_and_errors(saved):
    path = saved["block_carry"][1]
    assert_in_dtype(load_for_inference(path, dtype="bfloat16")[0])
    default, _ = load_for_inference(path)
    assert {p.dtype for p in default.parameters()} == {torch.float32}
    with pytest.raises(DlmError, match="unknown dtype 'half'; choose one of auto, float32, bfloat16, float16"):
        load_for_inference(path, dtype="half")


def test_cast_model_reaches_attached_modules_and_keeps_ties():
    m = tiny_model(40, attention="block_causal", family="masked", carry=True)  # built in float32
    cast_model(m, BF16)
    assert_in_dtype(m)
    assert m.backbone.get_input_embeddings().weight is m.backbone.get_output_embeddings().weight
    assert getattr(m.backbone, CARRY_MODULE).bias.dtype == BF16


def test_forward_runs_in_bf16(saved, tiny_tokenizer):
    model, _ = load_for_inference(saved["block_carry"][1], dtype=BF16)
    ids = torch.tensor(_prompts(tiny_tokenizer, (6,)))
    logits, hidden = model(ids, carry=torch.randn(1, 6, model.config.hidden_size), return_hidden=True)
    assert logits.dtype == hidden.dtype == BF16  # a float32 carry enters through the bf16 LayerNorm


# ---- sampling -----------------------------------------------------------------------------------------------------
def _check_eos(model, prompt, G, tok, free_tokens, **options):
    """Rerun one prompt with a token the free run produced as EOS: the output is the free run's prefix before it."""
    eos = free_tokens[min(2, len(free_tokens) - 1)]
    out = generate(model, [prompt], options, max_new_tokens=G, eos_id=eos, pad_id=tok.pad_token_id,
                   generator=torch.Generator().manual_seed(0))
    assert out.tokens[0] == free_tokens[: free_tokens.index(eos)] and eos not in out.tokens[0]
    return out, eos


def test_ar_decodes_in_bf16(saved, tiny_tokenizer):
    tok, G = tiny_tokenizer, 6
    model, _ = load_for_inference(saved["ar"][1], dtype=BF16)
    prompts = _prompts(tok)
    free = generate(model, prompts, max_new_tokens=G, eos_id=NEVER, pad_id=tok.pad_token_id)
    assert [len(t) for t in free.tokens] == [G] * 3 and free.nfe == [G] * 3
    out, eos = _check_eos(model, prompts[0], G, tok, free.tokens[0])
    assert out.nfe == [free.tokens[0].index(eos) + 1]  # one pass per token, the EOS included
    sampled = generate(model, prompts, max_new_tokens=G, eos_id=NEVER, pad_id=tok.pad_token_id, temperature=1.0,
                       generator=torch.Generator().manual_seed(0))
    assert [len(t) for t in sampled.tokens] == [G] * 3


@pytest.mark.parametrize("name, options", [("masked", {}), ("masked", {"block_size": 4, "cache": "dual"}),
                                           ("block_carry", {}), ("block_carry", {"kv_cache": False})])
def test_masked_decodes_in_bf16(saved, tiny_tokenizer, name, options):
    tok, G = tiny_tokenizer, 8
    model, _ = load_for_inference(saved[name][1], dtype=BF16)
    prompts = _prompts(tok)
    free = generate(model, prompts, {"reveal_count": 2, **options}, max_new_tokens=G, eos_id=NEVER,
                    pad_id=tok.pad_token_id)
    # top-2 reveals two positions per step: G / 2 steps on the full canvas, two per block of 4
    assert [len(t) for t in free.tokens] == [G] * 3 and free.nfe == [math.ceil(G / 2)] * 3
    assert all(tok.mask_token_id not in t for t in free.tokens)
    out, _ = _check_eos(model, prompts[1], G, tok, free.tokens[1], reveal_count=2, **options)
    assert out.nfe[0] <= free.nfe[1]


def test_simplex_decodes_in_bf16(saved, tiny_tokenizer):
    tok, G = tiny_tokenizer, 6
    model, _ = load_for_inference(saved["simplex"][1], dtype=BF16)
    prompts = _prompts(tok)
    free = generate(model, prompts, {"inference_steps": 3}, max_new_tokens=G, eos_id=NEVER, pad_id=tok.pad_token_id,
                    generator=torch.Generator().manual_seed(0))
    assert [len(t) for t in free.tokens] == [G] * 3 and free.nfe == [3] * 3
    single = generate(model, prompts[:1], {"inference_steps": 3}, max_new_tokens=G, eos_id=NEVER,
                      pad_id=tok.pad_token_id, generator=torch.Generator().manual_seed(0))
    out, _ = _check_eos(model, prompts[0], G, tok, single.tokens[0], inference_steps=3)
    assert out.nfe == [3]


# ---- Python API and CLI -------------------------------------------------------------------------------------------
def _data(tmp_path, n=3):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Ann has {i} cats.", "response": f"return {i}", "answer": i}) + "\n"
                            for i in range(n)))
    return data


def test_evaluate_model_and_generate_text_take_a_dtype(saved, tmp_path):
    from dlm.evaluation.run import evaluate_model
    from dlm.sampling import generate_text

    r = evaluate_model(saved["masked"][1], data=_data(tmp_path), max_new_tokens=6, progress=False, dtype="bfloat16")
    assert r["dtype"] == "bfloat16" and r["n"] == 3 and r["mean_nfe"] == 3
    (g,) = generate_text(saved["ar"][1], ["Ann has 2 cats."], max_new_tokens=4, dtype=BF16)
    assert g["nfe"] <= 4 and isinstance(g["response"], str)


def test_cli_eval_and_generate_with_dtype(saved, tmp_path, capsys):
    from dlm.cli import main

    out = tmp_path / "sweep.json"
    main(["eval", str(saved["block_carry"][1]), str(saved["ar"][1]), "--data", str(_data(tmp_path)),
          "--max-new-tokens", "8", "--dtype", "bfloat16", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["dtype"] == "bfloat16" and result["n"] == 3
    assert [(r["family"], r["n"]) for r in result["rows"]] == [("masked", 3), ("autoregressive", 3)]
    assert result["rows"][0]["mean_nfe"] == 4  # two blocks of 4, top-2: two steps each
    capsys.readouterr()
    main(["generate", str(saved["masked"][1]), "--prompt", "Ann has 2 cats.", "--max-new-tokens", "4",
          "--dtype", "bfloat16", "--show-steps"])
    assert "(2 NFE)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="mask-discrepancy runs on the CPU in float32"):
        main(["eval", str(saved["masked"][1]), "--data", str(_data(tmp_path)), "--metric", "mask-discrepancy",
              "--dtype", "bfloat16"])
    with pytest.raises(SystemExit):
        main(["eval", str(saved["ar"][1]), "--data", str(_data(tmp_path)), "--dtype", "float64"])
    assert "invalid choice: 'float64'" in capsys.readouterr().err
