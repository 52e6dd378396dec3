"""Device bugs seen on a CPU-only machine (issue 43): every inference path runs its model on a fake accelerator
(`tests.fake_device`) and must give what it gives on the CPU, where a tensor made without `device=` or a generator of
the wrong device fails as it would on a GPU. The last tests plant such bugs in the real source and see the check
fail; a static rule over the inference modules' factory calls is the cheap complement."""

import __future__

import ast
import asyncio
import inspect
import os
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import dlm.modeling.device as device_module
from dlm.evaluation.elbo import loglikelihood
from dlm.modeling.carry import CARRY_MODULE
from dlm.sampling import generate
from tests.conftest import perturb, tiny_model
from tests.fake_device import fake_accelerator, to_accelerator

pytestmark = pytest.mark.usefixtures("one_thread")
PAD, MASK, VOCAB = 0, 2, 40
NEVER = 99  # an EOS outside the vocabulary: every row runs to its last token
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
SRC = Path(__file__).resolve().parents[1] / "src" / "dlm"
# the tests that read dlm's source: under mutmut it holds trampolines and every mutant (whose own plants they are)
reads_source = pytest.mark.skipif("MUTANT_UNDER_TEST" in os.environ, reason="mutmut's copy of the source")


def _with_carry(m):
    """A carry norm away from its zero init, so the carry reaches the outputs."""
    norm = getattr(m.backbone, CARRY_MODULE)
    with torch.no_grad():
        norm.weight.normal_(1, 1, generator=torch.Generator().manual_seed(7))
    return m


def masked(attention="bidirectional", carry=False, label_shift=False):
    m = tiny_model(VOCAB, attention, "masked", label_shift=label_shift, carry=carry, mask_token_id=MASK, seed=1)
    return perturb(_with_carry(m) if carry else m)


def simplex():
    from tests.test_simplex import simplex_model

    return perturb(simplex_model(vocab=VOCAB))


MODELS = {
    "ar": lambda: perturb(tiny_model(VOCAB)),
    "masked": masked,
    "block": lambda: masked("block_causal", label_shift=True),
    "carry": lambda: masked(carry=True, label_shift=True),
    "block_carry": lambda: masked("block_causal", carry=True, label_shift=True),
    "simplex": simplex,
}


def on_both(build, call):
    """call(*models) on CPU models, then under the check on the same models on the fake accelerator: the same result
    (the check changes no numbers, it only refuses what a GPU refuses). `build` gives a model or a tuple of them.
    Returns the check."""
    models = [build() for _ in range(2)]
    cpu, placed = (m if isinstance(m, tuple) else (m,) for m in models)
    expected, placed = call(*cpu), [to_accelerator(m) for m in placed]
    with fake_accelerator() as check:
        assert call(*placed) == expected
    return check


def assert_draws_on_the_accelerator(check):
    assert not check.cpu_draws, f"a CPU generator drew for a model on the accelerator: {check.cpu_draws}"


def sample(options=None, temperature=0.0, eos=NEVER, **kwargs):
    """`dlm.sampling.generate` on PROMPTS with a generator made by `make_generator(seed, model)` (the simplex
    sampler's noise draws from it too): (tokens, NFE). An `eos` the model produces stops rows at different steps:
    the samplers then index the rows still working."""
    def call(model):
        out = generate(model, PROMPTS, options, max_new_tokens=8, eos_id=eos, pad_id=PAD, temperature=temperature,
                       generator=device_module.make_generator(3, model), **kwargs)
        return out.tokens, out.nfe
    return call


GENERATE = {
    "masked_top_u_traced": ("masked", sample({"policy": "top_u", "reveal_count": 2}, eos=28, return_trace=True)),
    "masked_threshold": ("masked", sample({"policy": "threshold", "confidence_threshold": 0.6})),
    "masked_sampled": ("masked", sample({"block_size": 4}, temperature=1.0, eos=31)),
    "block_kv_cache_sampled": ("block", sample({"kv_cache": True}, temperature=1.0, eos=4)),
    "block_uncached": ("block", sample({"kv_cache": False}, eos=4)),
    "carry_per_block": ("carry", sample({"block_size": 4, "reset_carry_per_block": True}, eos=9)),
    "block_carry_kv_cache": ("block_carry", sample({"reveal_count": 1}, eos=4)),
    "fast_dllm_dual": ("masked", sample({"policy": "threshold", "confidence_threshold": 0.6, "block_size": 4,
                                         "cache": "dual"})),
    "fast_dllm_prefix_sampled": ("masked", sample({"block_size": 4, "cache": "prefix"}, temperature=1.0, eos=9)),
    "ar_greedy": ("ar", sample(eos=4)),
    "ar_sampled": ("ar", sample(temperature=1.0, eos=39)),
    "simplex_traced": ("simplex", sample({"inference_steps": 20, "early_stop_patience": 1}, eos=9, return_trace=True)),
    "simplex_top_p": ("simplex", sample({"inference_steps": 6, "top_p": 0.9}, return_trace=True)),
}


@pytest.mark.parametrize("case", GENERATE)
def test_generate_on_the_accelerator(case):
    name, call = GENERATE[case]
    assert_draws_on_the_accelerator(on_both(MODELS[name], call))


def test_rows_stop_at_different_steps():
    """The cases do exercise the samplers' row indexing (a batch whose rows all finish together would not)."""
    for case, (name, call) in GENERATE.items():
        if case != "simplex_top_p":
            _, nfe = call(MODELS[name]())
            assert len(set(nfe)) > 1, f"{case}: every row took {nfe[0]} steps; pick an EOS the model produces"


def test_simplex_reward_guidance_on_the_accelerator():
    """TESS 2 reward guidance: the reward model's gradient is taken on the accelerator too."""
    from dlm.sampling.simplex import generate as simplex_generate
    from tests.test_guidance import reward_model

    def call(model, rm):
        out = simplex_generate(model, PROMPTS, 6, NEVER, PAD, inference_steps=4, reward_model=rm, guidance_scale=0.5,
                               top_p=0.9, generator=device_module.make_generator(5, model))
        return out.tokens, out.nfe
    assert_draws_on_the_accelerator(on_both(lambda: (simplex(), reward_model(VOCAB)), call))


PAIRS = [([5, 6, 7], [8, 9, 10, 11, 12]), ([13], [14, 15]), ([16, 17, 18, 19], [20, 21, 22])]


@pytest.mark.parametrize("name", ["ar", "masked", "block_carry"])
def test_loglikelihood_on_the_accelerator(name):
    def call(model):
        return [(round(s, 4), g) for s, g in loglikelihood(model, PAIRS, mc_num=3, batch_size=4, pad_id=PAD)]
    on_both(MODELS[name], call)  # the ELBO's masks are drawn on the CPU by design (seeded per request), then moved


# ---- the lm-eval model and the server: their own generators ------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tiny_tokenizer, tmp_path_factory):
    """A tiny masked and a tiny simplex model saved as dlm model directories with the tokenizer."""
    tok, root = tiny_tokenizer, tmp_path_factory.mktemp("device_check")
    ids = {"mask_token_id": tok.mask_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    out = {}
    for name, m in {"masked": tiny_model(len(tok), "bidirectional", "masked", **ids),
                    "simplex": tiny_model(len(tok), "bidirectional", "simplex", label_shift=True, simplex_k=5.0,
                                          simplex_timesteps=100, **ids)}.items():
        perturb(m).save_pretrained(root / name)
        tok.save_pretrained(root / name)
        out[name] = root / name
    return out


def test_generate_text_samples_on_the_accelerator(saved, monkeypatch):
    """`dlm generate`'s library call (sampled, its denoising shown) with the loaded model on the fake accelerator."""
    import io

    from rich.console import Console

    import dlm.sampling as sampling

    load = sampling.load_for_inference

    def load_on_the_accelerator(*args, **kwargs):
        model, tok = load(*args, **kwargs)
        return to_accelerator(model), tok

    monkeypatch.setattr(sampling, "load_for_inference", load_on_the_accelerator)
    with fake_accelerator() as check:
        out = sampling.generate_text(saved["masked"], ["Mia has 3 apples."], max_new_tokens=6, temperature=1.0,
                                     show_steps=True, console=Console(file=io.StringIO()))
    assert len(out) == 1 and out[0]["nfe"] > 0
    assert_draws_on_the_accelerator(check)


def lm_eval_sampled(path):
    """DlmLM.generate_until with do_sample on its model moved to the fake accelerator; returns the check."""
    pytest.importorskip("lm_eval")
    from dlm.evaluation.lm_eval import DlmLM

    lm = DlmLM(str(path), batch_size=2, max_gen_toks=6)
    to_accelerator(lm.model)
    gen_kwargs = {"until": ["\n"], "do_sample": True, "temperature": 1.0}
    requests = [SimpleNamespace(args=(text, gen_kwargs), task_name="t", doc_id=i)
                for i, text in enumerate(["Mia has 3 apples", "Mia has 4 pears and"])]
    with fake_accelerator() as check:
        assert len(lm.generate_until(requests, disable_tqdm=True)) == 2
    return check


def test_lm_eval_sampled_generation_draws_on_the_accelerator(saved):
    assert_draws_on_the_accelerator(lm_eval_sampled(saved["masked"]))


def serve(path, body: dict):
    """The server's decoding of one request (Engine.prepare, then the Batcher's scheduling and decoding in this
    thread: continuous rows for the masked model, a whole batch for the simplex one) on the fake accelerator;
    returns (results, check). A decoding error the Batcher hands to the client is raised here."""
    from dlm.serve.batching import Batcher
    from dlm.serve.engine import Engine
    from dlm.serve.protocol import CompletionRequest, parse

    engine = Engine(path)
    to_accelerator(engine.model)
    batcher, loop = Batcher(engine.model, engine.tok), asyncio.new_event_loop()
    try:
        with fake_accelerator() as check:
            job = engine.prepare(parse(CompletionRequest, body))
            job.loop = loop
            batcher.decode_now([job])
        loop.run_until_complete(asyncio.sleep(0))  # deliver the events the decoding thread posted
        kind, payload = job.events.get_nowait()
    finally:
        batcher._pool.shutdown()
        loop.close()
    if kind == "error":
        raise payload
    return payload, check


@pytest.mark.parametrize("name,body", [("masked", {"prompt": "Mia has", "max_tokens": 6, "temperature": 1.0,
                                                   "seed": 3, "n": 2}),
                                       ("simplex", {"prompt": "Mia has", "max_tokens": 6, "top_p": 0.9, "seed": 3})])
def test_serve_decodes_a_sampled_request_on_the_accelerator(saved, name, body):
    results, check = serve(saved[name], body)
    assert len(results) == body.get("n", 1) and all(r["nfe"] > 0 for r in results)
    assert_draws_on_the_accelerator(check)


# ---- planted bugs: the check must fail on them -------------------------------------------------------------------
def without_device(fn, call: str):
    """`fn` recompiled from its own source with the device dropped from the one call whose source starts with
    `call`: its `device=` keyword, or make_generator's device argument (the CPU default then)."""
    fn = inspect.unwrap(fn)  # @torch.no_grad(): its source, file and lines are the function's own
    lines, first = inspect.getsourcelines(fn)
    source = textwrap.dedent("".join(lines))
    tree = ast.parse(source)
    found = [n for n in ast.walk(tree)
             if isinstance(n, ast.Call) and ast.get_source_segment(source, n).startswith(call)]
    assert len(found) == 1, f"{len(found)} calls start with {call!r} in {fn.__qualname__}"
    node, before = found[0], len(found[0].keywords)
    node.keywords = [k for k in node.keywords if k.arg != "device"]
    if len(node.keywords) == before:
        assert ast.unparse(node.func) == "make_generator", f"no device argument in {call!r}"
        node.args = node.args[:1]
    ast.increment_lineno(tree, first - 1)  # tracebacks point at the real file's lines
    namespace = dict(vars(sys.modules[fn.__module__]))
    exec(compile(tree, inspect.getsourcefile(fn), "exec", flags=__future__.annotations.compiler_flag,
                 dont_inherit=True), namespace)
    return namespace[fn.__name__]


def elbo(name):
    """(model, the ELBO path), as GENERATE's cases."""
    return name, lambda m: loglikelihood(m, PAIRS, mc_num=2)


def _plants():
    from dlm.evaluation import elbo as elbo_module
    from dlm.sampling import block_cache, masked, steps

    return {  # (object holding the function, its name, the call to break, (model, the path that must now fail))
        "masked_canvas": (masked, "_canvas", "torch.full((B, gen_length)", GENERATE["masked_threshold"]),
        "steps_nfe": (steps.Progress, "__init__", "torch.zeros(canvas.shape[0]", GENERATE["masked_top_u_traced"]),
        "step_trace": (steps, "record_step", "torch.zeros(canvas.shape, dtype=torch.bool",
                       GENERATE["masked_top_u_traced"]),
        "block_cache_noised": (block_cache, "decode_block_causal", "torch.arange(e",
                               GENERATE["block_kv_cache_sampled"]),
        "fast_dllm_padding": (block_cache, "_padding_mask", "torch.zeros(", GENERATE["fast_dllm_dual"]),
        "elbo_ar_target": (elbo_module, "ar_loglikelihood", "torch.tensor(cont", elbo("ar")),
        "elbo_block_carry": (elbo_module, "masked_logits", "torch.zeros(*canvas.shape", elbo("block_carry")),
        "elbo_offsets": (elbo_module, "_score_chunk", "torch.arange(width", elbo("masked")),
    }


@reads_source
@pytest.mark.parametrize("plant", ["masked_canvas", "steps_nfe", "step_trace", "block_cache_noised",
                                   "fast_dllm_padding", "elbo_ar_target", "elbo_block_carry", "elbo_offsets"])
def test_a_dropped_device_fails_the_check(plant, monkeypatch):
    """One `device=` removed from the real source of a sampler or the ELBO: invisible on the CPU, refused here."""
    owner, name, call, (model, run) = _plants()[plant]
    monkeypatch.setattr(owner, name, without_device(getattr(owner, name), call))
    build = MODELS[model]
    run(build())  # on the CPU the bug is invisible
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        on_both(build, run)


@reads_source
def test_a_serve_generator_on_the_cpu_fails_the_check(saved, monkeypatch):
    """The server's sampled requests draw from make_generator(seed, model); with the model left out the generator is
    the CPU's, which a GPU's sampler refuses (or, through `categorical`, draws on the CPU and copies every step)."""
    from dlm.serve.batching import Batcher

    monkeypatch.setattr(Batcher, "_generator", without_device(Batcher._generator, "make_generator("))
    _, check = serve(saved["masked"], {"prompt": "Mia has", "max_tokens": 6, "temperature": 1.0, "seed": 3})
    with pytest.raises(AssertionError, match="a CPU generator drew .*sampling/steps.py"):
        assert_draws_on_the_accelerator(check)


def test_a_cpu_generator_for_accelerator_tensors_raises():
    """A draw on the accelerator's tensors from a CPU generator (and the reverse) raises, as CUDA's samplers do."""
    probs = torch.softmax(torch.randn(2, 5), -1)
    with fake_accelerator():
        on_device = probs.to("lazy")
        with pytest.raises(RuntimeError, match="Expected a 'lazy' device type for generator"):
            torch.multinomial(on_device, 1, generator=torch.Generator().manual_seed(0))
        with pytest.raises(RuntimeError, match="Expected a 'cpu' device type for generator"):
            torch.multinomial(probs, 1, generator=device_module.make_generator(0, "lazy"))
        with pytest.raises(RuntimeError, match="same device"):
            torch.where(on_device > 0.5, on_device, torch.zeros(2, 5))
        assert torch.where(on_device < 2, on_device, torch.tensor(0.0)).tolist() == probs.tolist()  # a CPU scalar
        assert bool((on_device.cpu() == probs).all()) and on_device.sum().item() == pytest.approx(2.0)


# ---- the static complement ---------------------------------------------------------------------------------------
FACTORIES = {"zeros", "ones", "full", "empty", "arange", "rand", "randn", "randint", "randperm", "tensor", "eye",
             "linspace", "as_tensor", "Generator"}
CPU_BY_DESIGN = {  # functions whose tensors are made on the CPU on purpose (and moved before they meet the model's)
    "evaluation/elbo.py": {"right_pad", "request_generator", "sample_masks", "_groups", "_elbo_jobs", "_score_chunk"},
    "sampling/trace.py": {"render_steps"},  # draws a trace, whose steps are on the CPU
}


@reads_source
def test_inference_factories_name_their_device():
    """Every torch factory call in the samplers, the ELBO and the server passes `device=` (or sits in a function
    that works on the CPU by design): the same rule as the fake accelerator's, for paths no test runs."""
    missing = []
    for path in [*SRC.glob("sampling/*.py"), *SRC.glob("serve/*.py"), SRC / "evaluation/elbo.py"]:
        rel = path.relative_to(SRC).as_posix()
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef) or fn.name in CPU_BY_DESIGN.get(rel, ()):
                continue
            for node in ast.walk(fn):
                if (isinstance(node, ast.Call) and ast.unparse(node.func) in {f"torch.{f}" for f in FACTORIES}
                        and not any(k.arg == "device" for k in node.keywords)):
                    missing.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    assert not missing, "factory calls without device= (pass device=, or make it from an existing tensor):\n" + \
        "\n".join(missing)
