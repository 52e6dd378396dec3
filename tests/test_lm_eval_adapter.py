"""dlm's lm-eval model (`dlm.evaluation.lm_eval.DlmLM`) piece by piece, without an lm-eval run: model args checked
before the model loads, generation kwargs, lm-eval's context/continuation split, NFE and cost accounting, the
results' config, a logged sample's line and `dlm lm-eval`'s arguments handed to lm-eval's CLI."""

import sys
from types import SimpleNamespace

import pytest
import torch

from dlm.errors import DlmError, OptionsError
from tests.conftest import tiny_model

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.usefixtures("one_thread")

from dlm.evaluation import lm_eval as adapter  # noqa: E402
from dlm.evaluation.elbo import forward_passes  # noqa: E402
from dlm.evaluation.lm_eval import DlmLM, _positive, _sample_line, _sampling_values  # noqa: E402


@pytest.fixture(scope="module")
def saved(tiny_tokenizer, tmp_path_factory):
    root, tok = tmp_path_factory.mktemp("adapter"), tiny_tokenizer
    ids = {"mask_token_id": tok.mask_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    out = {}
    for name, model in (("ar", tiny_model(len(tok), **ids)),
                        ("masked", tiny_model(len(tok), "bidirectional", "masked", label_shift=True, **ids))):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def masked(saved):
    return DlmLM(saved["masked"], mc_num=3, batch_size=2, seed=5)


def test_positive_model_args():
    assert _positive("mc_num", 3) == 3 and _positive("mc_num", "4") == 4 and _positive("mc_num", 2.0) == 2
    assert _positive("batch_size", 1) == 1
    for bad in (0, -1, 2.5, "auto", None, "x"):
        with pytest.raises(DlmError) as err:
            _positive("batch_size", bad)
        assert str(err.value) == (f"dlm model arg batch_size={bad!r}: must be an integer >= 1 (dlm has no automatic "
                                  "batch size)")


def test_sampling_values_from_model_args():
    assert _sampling_values(None, {}) is None
    assert _sampling_values(None, {"tau": 0.5, "reveal_count": 2}) == {"confidence_threshold": 0.5, "reveal_count": 2}
    options = object()
    assert _sampling_values(options, {}) is options
    with pytest.raises(OptionsError, match=r"^give sampling options either as model args or as options=, not both$"):
        _sampling_values(options, {"tau": 0.5})
    with pytest.raises(DlmError) as err:
        _sampling_values(None, {"temprature": 0.5})
    assert str(err.value).startswith("unknown dlm model arg 'temprature'; model args: pretrained, dtype, batch_size")
    assert "(short names: sampler, u, tau, steps" in str(err.value)


def test_model_args_are_kept(saved, masked):
    assert (masked.batch_size, masked.mc_num, masked.seed, masked.max_gen_toks) == (2, 3, 5, 256)
    assert masked.add_bos is False and masked.truncate is True and masked.family == "masked"
    assert masked.pretrained == str(saved["masked"]) and masked.tokenizer_name == str(saved["masked"]).replace("/",
                                                                                                              "__")
    lm = DlmLM(saved["ar"], seed="7", max_gen_toks=9, add_bos_token=1, truncate_prompts=0, dtype=None, device=None)
    assert (lm.seed, lm.max_gen_toks, lm.add_bos, lm.truncate) == (7, 9, True, False)
    assert next(lm.model.parameters()).dtype == torch.float32 and lm.placement["device"] == "cpu"
    assert next(DlmLM(saved["ar"], dtype="bfloat16").model.parameters()).dtype == torch.bfloat16
    tau = DlmLM(saved["masked"], tau=0.4)
    assert (tau.options.policy, tau.options.confidence_threshold) == ("threshold", 0.4)
    with pytest.raises(DlmError, match="'cuda' is not available"):
        if torch.cuda.is_available():
            raise DlmError("'cuda' is not available (skipped: this machine has a GPU)")
        DlmLM(saved["ar"], device="cuda")
    with pytest.raises(DlmError, match="mc_num=0"):
        DlmLM(saved["ar"], mc_num=0)
    with pytest.raises(DlmError, match="max_gen_toks=0"):
        DlmLM(saved["ar"], max_gen_toks=0)


def test_ignored_options_are_said(saved, capsys):
    DlmLM(saved["masked"], kv_cache=False)
    assert capsys.readouterr().err == ("dlm: masked (masked) ignores kv_cache (not read with these settings on a "
                                       "bidirectional model)\n")


def test_generation_kwargs(masked):
    assert masked._generation(None) == ((), 256, 0.0)
    assert masked._generation({"until": "x", "max_gen_toks": 7}) == (("x",), 7, 0.0)
    assert masked._generation({"until": ["a", "b"], "do_sample": True}) == (("a", "b"), 256, 1.0)
    assert masked._generation({"do_sample": True, "temperature": 0.5}) == ((), 256, 0.5)
    assert masked._generation({"do_sample": False, "temperature": 0.5}) == ((), 256, 0.0)
    assert masked._generation({"temperature": 0.3}) == ((), 256, 0.3)
    assert masked._generation({"until": None, "top_k": 5}) == ((), 256, 0.0)
    with pytest.raises(DlmError, match="max_gen_toks=0"):
        masked._generation({"max_gen_toks": 0})


def test_context_and_continuation_split_as_lm_eval_does(masked):
    tok = masked.tok

    def enc(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    assert masked._pair("", "Mia has") == ([tok.eos_token_id], enc("Mia has"))
    ctx, cont = masked._pair("Mia has  ", "apples")
    assert ctx == enc("Mia has") and cont == enc("Mia has  apples")[len(ctx):]
    ctx, cont = masked._pair("Mia has", " apples")
    assert ctx + cont == enc("Mia has apples") and ctx == enc("Mia has")


def request(task="t", doc=0, args=()):
    return SimpleNamespace(task_name=task, doc_id=doc, args=args)


def test_costs_are_counted_per_task_and_kind(saved):
    lm = DlmLM(saved["masked"], mc_num=2)
    a, b = request("t", 0), request(None, 1)
    lm._count(a, "generate_until", nfe=4, tokens=6, seconds=0.5)
    lm._count(a, "generate_until", nfe=2, tokens=2, seconds=0.5, new=False)
    lm._count(b, "loglikelihood", nfe=3, tokens=0, seconds=0.25)
    assert dict(lm.stats) == {("t", "generate_until"): {"requests": 1, "nfe": 6, "tokens": 8, "seconds": 1.0},
                              ("-", "loglikelihood"): {"requests": 1, "nfe": 3, "tokens": 0, "seconds": 0.25}}
    assert dict(lm.request_nfe) == {("t", 0): 6, (None, 1): 3}
    info = lm.get_model_info()["dlm"]
    assert info["tasks"] == {"-": {"loglikelihood": {"requests": 1, "nfe": 3, "tokens": 0, "seconds": 0.25,
                                                     "mean_nfe": 3.0}},
                             "t": {"generate_until": {"requests": 1, "nfe": 6, "tokens": 8, "seconds": 1.0,
                                                      "mean_nfe": 6.0, "tokens_per_s": 8.0,
                                                      "tokens_per_nfe": 8 / 6}}}
    assert {k: info[k] for k in ("pretrained", "family", "seed", "mc_num", "batch_size", "truncated_prompts",
                                 "device")} == {"pretrained": str(saved["masked"]), "family": "masked", "seed": 0,
                                                "mc_num": 2, "batch_size": 8, "truncated_prompts": 0, "device": "cpu"}
    assert info["sampling"] == {"family": "masked", **lm.options.in_effect(lm.model.spec)}
    empty = DlmLM(saved["masked"])
    empty._count(request(), "generate_until", nfe=0, tokens=0, seconds=0.0)
    zero = empty.get_model_info()["dlm"]["tasks"]["t"]["generate_until"]
    assert (zero["mean_nfe"], zero["tokens_per_s"], zero["tokens_per_nfe"]) == (0.0, 0.0, 0.0)


def test_a_scored_request_costs_each_window_and_counts_once(saved):
    lm = DlmLM(saved["masked"], mc_num=2, batch_size=4)
    req = request("t", 3)
    pairs = [([5, 6], [7, 8]), ([9], [10])]
    scores = lm._score([req, req], pairs, "loglikelihood_rolling")
    assert len(scores) == 2 and all(isinstance(s[0], float) for s in scores)
    s = lm.stats[("t", "loglikelihood_rolling")]
    nfe = 2 * forward_passes(lm.model, 1, 2)
    assert s["requests"] == 1 and s["nfe"] == nfe and lm.request_nfe[("t", 3)] == nfe and nfe >= 4


def test_generate_until_cuts_at_until_and_counts(saved):
    lm = DlmLM(saved["ar"], batch_size=2)
    reqs = [request("g", i, (p, {"until": ["\n"], "max_gen_toks": 5})) for i, p in enumerate(["Mia has", "two"])]
    out = lm.generate_until(reqs, disable_tqdm=True)
    assert len(out) == 2 and all("\n" not in o for o in out)
    s = lm.stats[("g", "generate_until")]
    assert s["requests"] == 2 and 2 <= s["nfe"] <= 10 and s["tokens"] >= 2


def test_rolling_loglikelihood_sums_its_windows(saved):
    lm = DlmLM(saved["ar"], batch_size=2)
    text = "Mia has 3 apples and 4 pears."
    (total,) = lm.loglikelihood_rolling([request("r", 0, (text,))], disable_tqdm=True)
    ids = lm.tok(text, add_special_tokens=False)["input_ids"]
    (whole, _), = lm._score([request("x", 0)], [([lm.tok.eos_token_id], ids)], "loglikelihood")
    assert total == pytest.approx(whole, abs=1e-4)


def test_chat_template_and_its_text(masked):
    chat = [{"role": "user", "content": "hi"}]
    assert masked.apply_chat_template(chat) == masked.tok.apply_chat_template(chat, tokenize=False,
                                                                              add_generation_prompt=True)
    assert masked.chat_template() == masked.tok.chat_template
    more = [*chat, {"role": "assistant", "content": "ho"}]
    assert masked.apply_chat_template(more, add_generation_prompt=False).endswith("ho")


def test_a_logged_sample_becomes_one_line():
    s = {"doc_id": 4, "arguments": [("prompt text", {"until": []})], "target": "7", "filtered_resps": ["7"],
         "metrics": ["accuracy", "missing"], "accuracy": 1.0}
    assert _sample_line("m", "task", s, {("task", 4): 9}) == {
        "model": "m", "task": "lm-eval:task", "doc_id": 4, "prompt": "prompt text", "target": "7", "generation": ["7"],
        "nfe": 9, "grade": {"accuracy": 1.0}}
    named = {"doc_id": 1, "arguments": [{"arg_0": "ctx", "arg_1": "cont"}], "filtered_resps": []}
    line = _sample_line("m", "t", named, {})
    assert (line["prompt"], line["nfe"], line["target"], line["grade"]) == ("ctx", 0, None, {})
    assert _sample_line("m", "t", {"doc_id": 1, "arguments": [], "filtered_resps": []}, {})["prompt"] == ""


def test_dlm_lm_eval_hands_lm_evals_cli_its_arguments(monkeypatch, capsys):
    import lm_eval.__main__

    seen = []
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: seen.append(list(sys.argv)))
    monkeypatch.setattr(sys, "argv", ["x"])
    monkeypatch.delenv("DLM_SMOKE", raising=False)
    adapter.main(["--tasks", "t"])
    assert seen[-1] == ["lm-eval", "--tasks", "t", "--include_path", str(adapter.TASKS_DIR), "--device", "auto"]
    adapter.main(["--tasks", "t", "--include_path=here", "--device=cpu"])
    assert seen[-1] == ["lm-eval", "--tasks", "t", "--include_path=here", "--device=cpu"]
    adapter.main(["--help"])
    assert seen[-1] == ["lm-eval", "run", "--help", "--device", "auto"]
    assert "dlm lm-eval: lm-eval's CLI" in capsys.readouterr().out
    adapter.main(["-h"])
    assert seen[-1] == ["lm-eval", "run", "--help", "--device", "auto"]
    adapter.main([])
    assert seen[-1] == ["lm-eval"]
    from dlm.config import SMOKE_ENV, SMOKE_N

    monkeypatch.setenv(SMOKE_ENV, "1")
    adapter.main(["--tasks", "t"])
    assert seen[-1][-2:] == ["--limit", str(SMOKE_N)]
    assert f"{SMOKE_ENV}=1: --limit {SMOKE_N}; not a result" in capsys.readouterr().err
    adapter.main(["--tasks", "t", "--limit=3"])
    assert seen[-1] == ["lm-eval", "--tasks", "t", "--limit=3", "--include_path", str(adapter.TASKS_DIR), "--device",
                        "auto"]
