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


def test_help_names_the_packaged_tasks_and_help_first_runs_lm_evals_own(monkeypatch, capsys):
    """`dlm lm-eval --help` says what it adds (naming each packaged task) before lm-eval's `run --help`; ARGS that
    begin with -h / --help go to lm-eval as they are: no --device, and under smoke no --limit."""
    import lm_eval.__main__

    from dlm.config import SMOKE_ENV, SMOKE_N

    seen = []
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: seen.append(list(sys.argv)))
    monkeypatch.setattr(sys, "argv", ["x"])
    monkeypatch.delenv(SMOKE_ENV, raising=False)
    adapter.main(["--help"])
    assert capsys.readouterr().out == (
        "dlm lm-eval: lm-eval's CLI with model `dlm` registered and dlm's packaged tasks (dlm_tinymath, "
        "dlm_humaneval, dlm_humaneval_sampled) on --include_path; its flags:\n\n")
    assert sorted(p.stem for p in adapter.TASKS_DIR.glob("*.yaml")) == ["dlm_humaneval", "dlm_humaneval_sampled",
                                                                         "dlm_tinymath"]
    for flag in ("-h", "--help"):
        adapter.main([flag, "run"])
        assert seen[-1] == ["lm-eval", flag, "run", "--include_path", str(adapter.TASKS_DIR)]
    monkeypatch.setenv(SMOKE_ENV, "1")
    for flag in ("-h", "--help"):
        adapter.main([flag, "run"])
        assert seen[-1] == ["lm-eval", flag, "run", "--include_path", str(adapter.TASKS_DIR)]
    assert capsys.readouterr().err == ""
    adapter.main(["--tasks", "t"])
    assert seen[-1] == ["lm-eval", "--tasks", "t", "--include_path", str(adapter.TASKS_DIR), "--device", "auto",
                        "--limit", str(SMOKE_N)]
    assert capsys.readouterr().err == f"{SMOKE_ENV}=1: --limit {SMOKE_N}; not a result\n"


def test_pair_puts_bos_before_both_texts_when_asked(saved, monkeypatch):
    """With add_bos_token, the context and the whole text are both encoded with BOS first, so the continuation is
    exactly the tokens after the context's (no BOS in it, none of the context's tokens)."""
    import copy

    lm = DlmLM(saved["ar"], add_bos_token=True)
    tok = copy.deepcopy(lm.tok)
    tok.add_special_tokens({"bos_token": "<|bos|>"})
    monkeypatch.setattr(lm, "tok", tok)
    bos = tok.bos_token_id
    assert bos is not None and bos not in (tok.eos_token_id, tok.pad_token_id)

    def enc(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    ctx, cont = lm._pair("Mia has", " 3 apples")
    assert ctx == [bos, *enc("Mia has")]
    assert cont == enc("Mia has 3 apples")[len(enc("Mia has")):] and len(cont) >= 1 and bos not in cont
    assert lm._pair("", "Mia has") == ([tok.eos_token_id], enc("Mia has"))  # an empty context: EOS, no BOS


def test_score_hands_the_model_args_to_the_scorer_and_times_per_pair(masked, monkeypatch):
    """_score's likelihoods are dlm.evaluation.elbo.loglikelihood's with the model args (mc_num, batch_size, seed,
    the pad id, common masks), in the order of the pairs; each pair costs an even share of the wall time and no
    tokens."""
    from dlm.evaluation import elbo

    calls = []

    def spy(model, pairs, **kwargs):
        calls.append(kwargs)
        return elbo.loglikelihood(model, pairs, **kwargs)

    lm = masked
    monkeypatch.setattr(adapter, "loglikelihood", spy)
    clock = iter([100.0, 106.0, 200.0, 203.0])
    monkeypatch.setattr(adapter, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    monkeypatch.setattr(lm, "stats", type(lm.stats)(lm.stats.default_factory))
    monkeypatch.setattr(lm, "request_nfe", type(lm.request_nfe)(int))
    pairs = [([5, 6], [7, 8]), ([9], [10, 11, 12]), ([13, 14, 15], [16])]
    reqs = [request("s", i) for i in range(3)]
    scores = lm._score(reqs, pairs, "loglikelihood")
    assert calls == [{"mc_num": 3, "batch_size": 2, "seed": 5, "pad_id": lm.tok.pad_token_id, "common_masks": True}]
    assert scores == elbo.masked_loglikelihood(lm.model, pairs, mc_num=3, batch_size=2, seed=5,
                                               pad_id=lm.tok.pad_token_id)
    assert scores != elbo.masked_loglikelihood(lm.model, pairs, mc_num=128, batch_size=2, seed=5,
                                               pad_id=lm.tok.pad_token_id)
    assert scores != elbo.masked_loglikelihood(lm.model, pairs, mc_num=3, batch_size=2, seed=0,
                                               pad_id=lm.tok.pad_token_id)
    nfe = forward_passes(lm.model, 1, 3)
    assert dict(lm.stats) == {("s", "loglikelihood"): {"requests": 3, "nfe": 3 * nfe, "tokens": 0, "seconds": 6.0}}
    assert dict(lm.request_nfe) == {("s", i): nfe for i in range(3)}
    lm._score([request("one", 0)], pairs[:1], "loglikelihood")  # one pair: the whole 3 s
    assert lm.stats[("one", "loglikelihood")] == {"requests": 1, "nfe": nfe, "tokens": 0, "seconds": 3.0}


def test_loglikelihood_scores_the_split_pairs_under_its_own_kind(saved):
    lm = DlmLM(saved["ar"], batch_size=2)
    reqs = [request("c", i, args) for i, args in enumerate([("Mia has", " 3 apples"), ("", "two pears"),
                                                            ("Mia has  ", "4")])]
    out = lm.loglikelihood(reqs)
    assert out == lm._score([request("x", 0)] * 3, [lm._pair(*r.args) for r in reqs], "other")
    assert set(lm.stats) == {("c", "loglikelihood"), ("x", "other")}
    assert lm.stats[("c", "loglikelihood")]["requests"] == 3


def _windows(ids, eos, limit):
    """lm-eval's rolling windows by hand for a context of `limit` tokens: the text in chunks of limit - 1 tokens,
    the first after EOS, each other one after the limit - len(chunk) tokens before it (limit tokens in all)."""
    step, out = limit - 1, []
    for start in range(0, len(ids), step):
        end = min(start + step, len(ids))
        out.append(([eos] if start == 0 else ids[end - limit : start], ids[start:end]))
    return out


@pytest.mark.parametrize("limit", [16, 23, None, "missing"])
def test_rolling_windows_and_their_sums(saved, monkeypatch, limit):
    """loglikelihood_rolling's windows are lm-eval's over the model's context (max_position_embeddings; 2048 when the
    config has none) and each request's total is the sum of its windows' scores."""
    lm = DlmLM(saved["ar"])
    config = SimpleNamespace() if limit == "missing" else SimpleNamespace(max_position_embeddings=limit)
    monkeypatch.setattr(lm, "model", SimpleNamespace(config=config))  # _score is faked: only the config is read
    seen = []

    def fake(requests, pairs, kind):
        seen.append((list(requests), list(pairs), kind))
        return [(-float(sum(cont)) - len(ctx) / 8, False) for ctx, cont in pairs]

    monkeypatch.setattr(lm, "_score", fake)
    context = limit if isinstance(limit, int) else 2048
    texts = ["Mia has 3 apples and 4 pears. " * (6 if isinstance(limit, int) else 350), "two", "Mia has 7 apples."]
    reqs = [request("r", i, (t,)) for i, t in enumerate(texts)]
    totals = lm.loglikelihood_rolling(reqs)
    expected, owners = [], []
    for i, t in enumerate(texts):
        ids = lm.tok(t, add_special_tokens=False)["input_ids"]
        windows = _windows(ids, lm.tok.eos_token_id, context)
        assert [tok for _, cont in windows for tok in cont] == ids and all(len(a) + len(b) <= context
                                                                           for a, b in windows)
        expected += windows
        owners += [reqs[i]] * len(windows)
    ((requests, pairs, kind),) = seen
    assert kind == "loglikelihood_rolling" and pairs == expected and requests == owners
    assert len(_windows(lm.tok(texts[0], add_special_tokens=False)["input_ids"], 0, context)) >= 3
    assert totals == [sum(-float(sum(cont)) - len(ctx) / 8 for (ctx, cont), r in zip(pairs, owners) if r is req)
                      for req in reqs]


def test_rolling_loglikelihood_over_several_windows_is_the_sum_of_their_likelihoods(saved, monkeypatch):
    lm = DlmLM(saved["ar"], batch_size=3)
    monkeypatch.setattr(lm.model.config, "max_position_embeddings", 8)
    text = "Mia has 3 apples and 4 pears. Mia has 5 apples."
    (total,) = lm.loglikelihood_rolling([request("r", 0, (text,))])
    ids = lm.tok(text, add_special_tokens=False)["input_ids"]
    windows = _windows(ids, lm.tok.eos_token_id, 8)
    assert len(windows) >= 3
    from dlm.evaluation.elbo import ar_loglikelihood

    assert total == pytest.approx(sum(s for s, _ in ar_loglikelihood(lm.model, windows, batch_size=1)), abs=1e-4)


def test_the_decoders_rules_are_model_args(saved, spy):
    """`dlm lm-eval --model_args ...,sub_block_size=2,eos_confidence=0.5,nfe_budget=3,remask_threshold=0.3` reach the
    masked sampler of generate_until (issue 45's decoders are sampling options, parsed like any other)."""
    lm = DlmLM(saved["masked"], batch_size=2, block_size=4, sub_block_size="2", eos_confidence="0.5", nfe_budget=3,
               remask_threshold=0.3, edit_budget=2, tau=0.5)
    assert (lm.options.sub_block_size, lm.options.eos_confidence, lm.options.nfe_budget) == (2, 0.5, 3)
    out = lm.generate_until([request("g", i, (p, {"max_gen_toks": 8})) for i, p in enumerate(["Mia has", "two"])],
                            disable_tqdm=True)
    assert len(out) == 2 and spy
    assert all((c["sub_block_size"], c["eos_confidence"], c["nfe_budget"], c["remask_threshold"], c["edit_budget"])
               == (2, 0.5, 3, 0.3, 2) for c in spy)
    # the budget: 3 passes per row, plus one per later sub-block (2 blocks of 2 sub-blocks)
    assert lm.stats[("g", "generate_until")]["nfe"] <= 2 * (3 + 3)
    with pytest.raises(DlmError, match="sub_block_size must be an integer >= 1"):
        DlmLM(saved["masked"], sub_block_size=0)
