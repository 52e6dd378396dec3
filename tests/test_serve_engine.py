"""What `dlm serve`'s Engine makes of a parsed request, without a server: the job it queues (rows, options, batch key,
seed, block size, event queue) or the exact 400/404 a client gets, over tiny saved models of each family."""

import asyncio

import pytest
import torch

pytest.importorskip("fastapi")

from dlm.serve.engine import Engine, Limits  # noqa: E402
from dlm.serve.protocol import ApiError, ChatRequest, CompletionRequest, parse  # noqa: E402
from tests.test_serve import build_models  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
HI = [{"role": "user", "content": "hi"}]
MASKED = ('{"policy":"top_u","reveal_count":2,"confidence_threshold":0.9,"block_size":null,"kv_cache":true,'
          '"cache":null,"reset_carry_per_block":false,"sub_block_size":null,"refresh_every":null,'
          '"remask_threshold":null,"edit_budget":4,"eos_confidence":null,"nfe_budget":null}')


@pytest.fixture(scope="module")
def dirs(tiny_tokenizer, tmp_path_factory):
    return build_models(tiny_tokenizer, tmp_path_factory.mktemp("engine"))


@pytest.fixture(scope="module")
def engines(dirs):
    return {name: Engine(dirs[name]) for name in ("masked", "block", "ar", "simplex")}


def prepare(engine, body, kind=CompletionRequest):
    return engine.prepare(parse(kind, body))


def refusal(engine, body, kind=CompletionRequest) -> tuple:
    with pytest.raises(ApiError) as err:
        prepare(engine, body, kind)
    return err.value.status, err.value.message, err.value.param, err.value.code


def test_a_greedy_request_is_a_batchable_job(engines, tiny_tokenizer):
    engine = engines["masked"]
    ids = tiny_tokenizer("Mia has", add_special_tokens=False)["input_ids"]
    job = prepare(engine, {"prompt": ["Mia has", "Mia has"], "n": 2, "stop": ["x", "yz"], "stream": True})
    assert job.rows == [ids] * 4 and prepare(engine, {"prompt": [[5], [6, 7]]}).rows == [[5], [6, 7]]
    assert (job.max_tokens, job.temperature, job.seed, job.key) == (64, 0.0, None, (MASKED, 64))
    assert (job.stream, job.steps, job.family, job.mask_id, job.eos_id, job.block_size) == (
        True, False, "masked", tiny_tokenizer.mask_token_id, tiny_tokenizer.eos_token_id, None)
    assert job.events.maxsize == 1024 and job.pieces is engine.pieces
    assert len(job.texts) == 4 and len({id(t) for t in job.texts}) == 4
    assert all(t.stops == ["x", "yz"] and t.max_tokens == 64 and t.decode is engine.decode for t in job.texts)
    assert job.options == engine.defaults
    assert prepare(engine, {"prompt": "a", "max_tokens": 5, "model": "masked"}).key == (MASKED, 5)
    assert prepare(engine, {"prompt": "a", "stream": True, "dlm_steps": True}).steps is True
    assert prepare(engine, {"prompt": "a", "temperature": 0.0}).key == (MASKED, 64)


def test_sampled_requests_decode_alone_with_a_seed(engines):
    engine = engines["masked"]
    job = prepare(engine, {"prompt": "a", "temperature": 0.5})
    assert job.key is None and job.temperature == 0.5 and isinstance(job.seed, int) and 0 <= job.seed < 2 ** 63
    assert prepare(engine, {"prompt": "a", "temperature": 0.5}).seed != job.seed
    assert prepare(engine, {"prompt": "a", "temperature": 0.5, "seed": 3}).seed == 3
    assert prepare(engine, {"prompt": "a", "seed": 4}).seed == 4  # greedy, seeded: kept, and still batched
    simplex = prepare(engines["simplex"], {"prompt": "a"})
    assert simplex.key is None and isinstance(simplex.seed, int) and simplex.family == "simplex"


def test_block_size_and_the_event_queue(engines, dirs):
    assert prepare(engines["block"], {"prompt": "a"}).block_size == 4  # the model's
    assert prepare(engines["block"], {"prompt": "a", "block_size": 8}).block_size == 8
    assert prepare(engines["masked"], {"prompt": "a", "block_size": 4}).block_size == 4
    assert prepare(engines["simplex"], {"prompt": "a"}).block_size is None
    small = Limits(max_queued_events=8)
    assert prepare(Engine(dirs["masked"], limits=small), {"prompt": ["a", "b"], "max_tokens": 10}).events.maxsize == 8
    ar = prepare(Engine(dirs["ar"], limits=small), {"prompt": ["a", "b"], "max_tokens": 10})
    assert ar.events.maxsize == 2 * 11 + 2 and ar.key == ("{}", 10)  # room for its token-by-token burst
    assert prepare(engines["ar"], {"prompt": "a", "max_tokens": 10}).events.maxsize == 1024
    assert isinstance(ar.events, asyncio.Queue)


def test_max_tokens_defaults_and_limits(engines, dirs):
    assert prepare(engines["masked"], {"prompt": "a"}).max_tokens == 64
    engine = Engine(dirs["masked"], limits=Limits(default_max_tokens=5, max_tokens=10))
    assert engine.default_max_tokens == 5 and prepare(engine, {"prompt": "a"}).max_tokens == 5
    assert prepare(engine, {"prompt": "a", "max_tokens": 10}).max_tokens == 10
    assert refusal(engine, {"prompt": "a", "max_tokens": 11}) == (
        400, "max_tokens 11 is over this server's limit of 10 (dlm serve --max-tokens)", "max_tokens",
        "max_tokens_exceeded")
    assert prepare(engines["masked"], {"messages": HI, "max_completion_tokens": 7}, ChatRequest).max_tokens == 7


def test_model_temperature_and_stop_refusals(engines, dirs):
    assert refusal(engines["masked"], {"prompt": "a", "model": "x"}) == (
        404, "model 'x' is not served here; this server serves 'masked'", "model", "model_not_found")
    assert refusal(engines["simplex"], {"prompt": "a", "temperature": 0.5}) == (
        400, "simplex models have no temperature: leave it 0 and sample with top_p (e.g. 0.99)", "temperature", None)
    engine = Engine(dirs["masked"], limits=Limits(max_stop_chars=3))
    assert prepare(engine, {"prompt": "a", "stop": ["abc", "d"]}).texts[0].stops == ["abc", "d"]
    assert refusal(engine, {"prompt": "a", "stop": ["d", "abcd"]}) == (
        400, "stop: a stop string of 4 characters is over this server's limit of 3 (dlm serve --max-stop-chars)",
        "stop", "stop_too_long")


def test_prompts_token_ids_and_lengths(engines, dirs, tiny_tokenizer):
    engine = engines["masked"]
    assert prepare(engine, {"prompt": [0, 299]}).rows == [[0, 299]]
    for bad in (300, -1):
        assert refusal(engine, {"prompt": [5, bad, 7]}) == (
            400, f"token id {bad} is outside the model's vocabulary (0..299)", "prompt", None)
    assert refusal(engine, {"prompt": ""}) == (400, "prompt: a prompt is empty (0 tokens); give some text", "prompt",
                                               None)
    assert refusal(engine, {"prompt": ["a", ""]})[1:3] == ("prompt: a prompt is empty (0 tokens); give some text",
                                                           "prompt")
    assert refusal(engine, {"prompt": "a", "max_tokens": 128}) == (
        400, "max_tokens 128 (128 positions to generate) fills the model's context of 128: no room is left for a "
        "prompt; lower max_tokens", "max_tokens", "context_length_exceeded")
    assert prepare(engine, {"prompt": [5], "max_tokens": 127}).rows == [[5]]  # one position left: the prompt fits
    assert refusal(engine, {"prompt": [5, 6], "max_tokens": 127}) == (
        400, "prompt: the prompt is 2 tokens, over the limit of 1 (the model's context 128 minus 127 positions to "
        "generate); shorten it or lower max_tokens", "prompt", "context_length_exceeded")
    assert prepare(engine, {"prompt": [5] * 28, "max_tokens": 100}).rows == [[5] * 28]
    assert refusal(engine, {"prompt": [[5], [5] * 29], "max_tokens": 100})[1].startswith(
        "prompt: the prompt is 29 tokens, over the limit of 28 (the model's context 128 minus 100 positions")
    capped = Engine(dirs["masked"], limits=Limits(max_prompt_tokens=2))
    assert prepare(capped, {"prompt": [5, 6]}).rows == [[5, 6]]
    assert refusal(capped, {"prompt": [5, 6, 7]}) == (
        400, "prompt: the prompt is 3 tokens, over the limit of 2 (dlm serve --max-prompt-tokens); shorten it or "
        "lower max_tokens", "prompt", "context_length_exceeded")
    loose = Engine(dirs["masked"], limits=Limits(max_prompt_tokens=100))  # the context is the tighter limit
    assert refusal(loose, {"prompt": [5] * 29, "max_tokens": 100})[1].startswith("prompt: the prompt is 29 tokens, "
                                                                                 "over the limit of 28 (the model's")
    engine.context, saved = None, engine.context  # a model without a known context: only the flag limits
    try:
        assert prepare(engine, {"prompt": [5] * 100, "max_tokens": 200}).rows == [[5] * 100]
    finally:
        engine.context = saved


def test_chat_prompts_use_the_template(engines, tiny_tokenizer):
    job = prepare(engines["masked"], {"messages": HI}, ChatRequest)
    text = tiny_tokenizer.apply_chat_template(HI, tokenize=False, add_generation_prompt=True)
    assert job.rows == [tiny_tokenizer(text, add_special_tokens=False)["input_ids"]]
    status, message, param, _ = refusal(engines["masked"], {"messages": [{"role": "user", "content": "a"}] * 200,
                                                            "max_tokens": 4}, ChatRequest)
    assert (status, param) == (400, "messages") and message.startswith("messages: the prompt is ")


def test_a_template_that_refuses_the_messages_is_a_400(dirs):
    engine = Engine(dirs["masked"])
    engine.tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    assert refusal(engine, {"messages": HI}, ChatRequest) == (
        400, "the model's chat template refused these messages: roles must alternate", "messages", None)


def test_batch_rows_are_limited(dirs):
    engine = Engine(dirs["masked"], limits=Limits(max_batch_size=8))
    assert len(prepare(engine, {"prompt": ["a", "b"], "n": 4}).rows) == 8
    assert refusal(engine, {"prompt": ["a"] * 3, "n": 3}) == (
        400, "3 prompt(s) x n=3 is 9 rows, more than this server decodes at once (8, dlm serve --max-batch-size)", "n",
        None)


def test_sampling_options_are_checked_for_the_family(engines):
    masked = engines["masked"]
    job = prepare(masked, {"prompt": "a", "u": 2, "tau": 0.4})
    assert (job.options.policy, job.options.reveal_count, job.options.confidence_threshold) == (
        "top_u_or_threshold", 2, 0.4)
    assert prepare(masked, {"prompt": "a", "tau": 0.3}).options.policy == "threshold"
    assert refusal(masked, {"prompt": "a", "tau": 0.5, "confidence_threshold": 0.5}) == (
        400, "confidence_threshold and tau both set confidence_threshold; give one", "confidence_threshold", None)
    for value in (1, 1.0, None):
        assert prepare(masked, {"prompt": "a", "top_p": value}).options == masked.defaults
    for value in (0.9, True, "1"):
        assert refusal(masked, {"prompt": "a", "top_p": value}) == (
            400, "top_p is the simplex sampler's projection; masked models sample with temperature: leave top_p out "
            "(or 1)", "top_p", "unsupported_for_model"), value
    assert refusal(engines["simplex"], {"prompt": "a", "reward_model": "x"}) == (
        400, "reward_model is set by the server (dlm serve --reward-model or the run's recipe), not per request",
        "reward_model", None)
    assert refusal(masked, {"prompt": "a", "steps": 5}) == (
        400, "steps is a simplex-sampler option; masked is a masked model and does not take it: leave it out", "steps",
        "unsupported_for_model")
    assert refusal(masked, {"prompt": "a", "u": "2"}) == (400, "u: reveal_count must be an integer >= 1 (got '2')",
                                                          "u", None)
    status, message, param, code = refusal(masked, {"prompt": "a", "policy": "top_u", "tau": 0.5})
    assert (status, param, code) == (400, "tau", "unused_option") and "tau" in message
    status, message, param, code = refusal(masked, {"prompt": "a", "policy": "nope"})
    assert (status, param) == (400, "policy") and "nope" in message
    assert prepare(engines["simplex"], {"prompt": "a", "top_p": 0.9, "steps": 5}).options.top_p == 0.9
    assert prepare(masked, {"prompt": "a", "cache": "prefix", "block_size": 4}).options.cache == "prefix"
    assert refusal(engines["block"], {"prompt": "a", "cache": "prefix", "block_size": 4}) == (
        400, "cache prefix (Fast-dLLM) is for full-canvas models without a carry; this model decodes with its exact "
        "kv_cache instead: leave cache out", "cache", None)


def test_describe_names_the_model_and_its_defaults(engines, dirs):
    info = engines["block"].describe()
    dlm = info.pop("dlm")
    assert info == {"id": "block", "object": "model", "created": 0, "owned_by": "dlm"}
    assert {k: dlm[k] for k in ("family", "attention", "block_size", "context", "default_max_tokens", "max_tokens",
                                "device", "dtype")} == {
        "family": "masked", "attention": "block_causal", "block_size": 4, "context": 128, "default_max_tokens": 64,
        "max_tokens": 1024, "device": "cpu", "dtype": "float32"}
    assert dlm["sampling_defaults"] == engines["block"].defaults.model_dump()
    assert dlm["policy_uses"]["top_u_or_threshold"] == ["reveal_count", "confidence_threshold"]
    assert "policy_uses" not in engines["ar"].describe()["dlm"]
    named = Engine(dirs["masked"], name="served")
    assert named.name == "served" and named.describe()["id"] == "served"
    flags = Engine(dirs["masked"], defaults={"confidence_threshold": 0.3})
    assert flags.defaults.policy == "threshold" and flags.defaults.confidence_threshold == 0.3
    assert flags.ignored == [] and engines["masked"].ignored == []


def test_the_model_is_loaded_at_the_dtype_and_on_the_device_asked(dirs):
    from dlm.errors import DlmError

    engine = Engine(dirs["masked"], dtype=torch.float64)
    assert next(engine.model.parameters()).dtype == torch.float64 and engine.placement["dtype"] == "float64"
    if not torch.cuda.is_available():
        with pytest.raises(DlmError, match="'cuda' is not available"):
            Engine(dirs["masked"], device="cuda")
    assert engine.pieces([engine.tok.eos_token_id, 5]) == ["", engine.tok.decode([5])]


def test_the_run_recipe_gives_the_default_temperature_and_the_flags_count_over_it(dirs, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(dirs["carry"], run / "model")
    (run / "recipe.yaml").write_text("eval:\n  temperature: 0.7\n  block_size: 4\n  max_new_tokens: 8\n")
    engine = Engine(run, defaults={"reset_carry_per_block": True})
    assert engine.default_temperature == 0.7 and engine.defaults.block_size == 4
    assert engine.ignored == []  # the recipe's block_size puts reset_carry_per_block in effect
    job = prepare(engine, {"prompt": "a"})
    assert job.temperature == 0.7 and job.key is None and isinstance(job.seed, int)
    assert prepare(engine, {"prompt": "a", "temperature": 0}).temperature == 0
    assert Engine(dirs["carry"], defaults={"reset_carry_per_block": True}).ignored == [
        "reset_carry_per_block (not read with these settings on a bidirectional model with a carry)"]


def test_prompts_are_tokenized_without_the_tokenizers_special_tokens(dirs):
    from tokenizers.processors import TemplateProcessing

    engine = Engine(dirs["masked"])
    plain = engine.tok("Mia has", add_special_tokens=False)["input_ids"]
    chat_text = engine.tok.apply_chat_template(HI, tokenize=False, add_generation_prompt=True)
    chat = engine.tok(chat_text, add_special_tokens=False)["input_ids"]
    eos = engine.tok.eos_token
    engine.tok._tokenizer.post_processor = TemplateProcessing(  # a tokenizer that adds a BOS (as Llama's does)
        single=f"{eos} $A", special_tokens=[(eos, engine.tok.eos_token_id)])
    assert engine.tok("Mia has")["input_ids"] == [engine.tok.eos_token_id, *plain]
    assert prepare(engine, {"prompt": "Mia has"}).rows == [plain]
    assert prepare(engine, {"messages": HI}, ChatRequest).rows == [chat]


def test_the_generation_span_of_a_block_model_is_whole_blocks(engines, dirs):
    assert refusal(engines["block"], {"prompt": "a", "max_tokens": 125})[1].startswith(
        "max_tokens 125 (128 positions to generate) fills the model's context of 128")
    assert refusal(engines["block"], {"prompt": [5] * 5, "max_tokens": 121})[1].startswith(
        "prompt: the prompt is 5 tokens, over the limit of 4 (the model's context 128 minus 124 positions")
    same = Engine(dirs["masked"], limits=Limits(max_prompt_tokens=28))  # the flag and the context agree: the flag
    assert refusal(same, {"prompt": [5] * 29, "max_tokens": 100})[1] == (
        "prompt: the prompt is 29 tokens, over the limit of 28 (dlm serve --max-prompt-tokens); shorten it or lower "
        "max_tokens")


def test_more_option_checks(engines):
    masked = engines["masked"]
    assert prepare(masked, {"prompt": "a", "top_p": 1, "u": 3}).options.reveal_count == 3  # top_p 1 skipped, u read
    assert refusal(masked, {"prompt": "a", "cache": "prefix"}) == (
        400, "cache prefix (Fast-dLLM) needs a block_size: the cache is refreshed at each block", "cache", None)
    seeds = [prepare(masked, {"prompt": "a", "temperature": 0.5}).seed for _ in range(64)]
    assert all(0 <= s < 2 ** 63 for s in seeds) and len(set(seeds)) == 64  # a random int64 seed per request
