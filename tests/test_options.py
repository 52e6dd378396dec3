"""Typed sampling options (`dlm.sampling.options`): one check per value wherever it comes from (Python, recipe, CLI
flag, sweep), flags generated from the fields, and `generate(model, prompts, options)` equal to the family samplers."""

import ast
import inspect
import json
import re
import shlex
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from dlm.errors import OptionsError
from dlm.sampling.options import (
    ALIASES,
    OPTIONS,
    AutoregressiveOptions,
    MaskedOptions,
    SamplingSettings,
    SimplexOptions,
    ignored,
    parse_options,
    parse_settings,
    resolve_options,
)
from tests.conftest import perturb, tiny_model

ROOT = Path(__file__).resolve().parents[1]
PAD, EOS, MASK, VOCAB = 0, 1, 2, 40
NEVER = 99  # an EOS id outside the vocabulary: never produced

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- one check per value ------------------------------------------------------------------------------------------
BAD = [("masked", "confidence_threshold", 0, r"\(0, 1\]"), ("masked", "confidence_threshold", 1.5, r"\(0, 1\]"),
       ("masked", "reveal_count", 0, ">= 1"), ("simplex", "inference_steps", 0, ">= 1"),
       ("masked", "block_size", 0, ">= 1"), ("masked", "policy", "top_k", "one of top_u, threshold"),
       ("masked", "reveal_count", "1.5", "an integer"), ("simplex", "top_p", 0, r"\(0, 1\]"),
       ("simplex", "early_stop_patience", 0, ">= 1"), ("simplex", "guidance_temperature", 0, "> 0")]


@pytest.mark.parametrize("family, field, value, domain", BAD)
def test_each_range_check_names_the_field_and_the_range(family, field, value, domain):
    for make in (lambda: parse_options(family, {field: value}), lambda: parse_settings({field: value}),
                 lambda: OPTIONS[family]().replace(**{field: value})):
        with pytest.raises(OptionsError, match=f"^{field} must be .*{domain}.*, got {re.escape(repr(value))}$"):
            make()
    with pytest.raises(ValidationError, match=f"{field}\n  must be .*{domain}"):  # constructed in Python
        OPTIONS[family](**{field: value})
    with pytest.raises(OptionsError, match=rf"^--x {re.escape(str(value))}: {field} must be .*{domain}"):
        parse_options(family, {field: value}, names={field: "--x"})


def test_unknown_and_wrong_family_keys():
    with pytest.raises(OptionsError, match="unknown sampling option 'confidence'.*did you mean"):
        parse_options("masked", {"confidence": 0.5})
    with pytest.raises(OptionsError, match="unknown sampling option 'confidence'"):
        parse_options("masked", {"confidence": 0.5}, strict=False)  # a typo is never silently dropped
    with pytest.raises(ValidationError, match="confidence\n  Extra inputs are not permitted"):
        MaskedOptions(confidence=0.5)
    with pytest.raises(OptionsError, match="'tau' is a short name; the option is 'confidence_threshold'"):
        parse_options("masked", {"tau": 0.5})
    with pytest.raises(OptionsError,
                       match="^--tau: confidence_threshold is a masked-sampler option; autoregressive models"):
        parse_options("autoregressive", {"confidence_threshold": 0.5}, names={"confidence_threshold": "--tau"})
    # not strict: the AR model simply gets its (empty) options, and `ignored` says what it left out and why
    assert parse_options("autoregressive", {"confidence_threshold": 0.5, "block_size": None}, strict=False) \
        == AutoregressiveOptions()
    assert ignored("autoregressive", {"confidence_threshold": 0.5, "block_size": None}) \
        == ["confidence_threshold (masked sampler)"]


def test_cross_field_checks():
    with pytest.raises(OptionsError, match="cache dual .*needs a block_size"):
        parse_options("masked", {"cache": "dual"})
    with pytest.raises(OptionsError, match="guidance_scale 0.5 needs a reward_model"):
        parse_settings({"guidance_scale": 0.5})
    assert SimplexOptions(guidance_scale=0.5, reward_model=Path("runs/rm")).reward_model == "runs/rm"


def test_settings_give_each_family_its_share():
    """`dlm eval runs/mdm runs/ar --tau 0.9`: the masked model gets tau, the AR model its (empty) options."""
    s = parse_settings({"confidence_threshold": 0.5, "inference_steps": 7, "policy": None})
    assert s.sampling_options("masked") == MaskedOptions(confidence_threshold=0.5)
    assert s.sampling_options("simplex") == SimplexOptions(inference_steps=7)
    assert s.sampling_options("autoregressive") == AutoregressiveOptions()
    assert ignored("autoregressive", s) == ["confidence_threshold (masked sampler)",
                                            "inference_steps (simplex sampler)"]
    assert ignored("masked", MaskedOptions(reveal_count=4)) == []
    assert resolve_options("masked", None) == MaskedOptions()
    assert resolve_options("masked", {"reveal_count": 4}).reveal_count == 4
    with pytest.raises(OptionsError, match="MaskedOptions are for masked models; this is a simplex model"):
        resolve_options("simplex", MaskedOptions())
    assert resolve_options("simplex", MaskedOptions(), strict=False) == SimplexOptions()
    assert MaskedOptions(block_size=4).replace(confidence_threshold="0.5") == MaskedOptions(block_size=4,
                                                                                            confidence_threshold=0.5)


def test_defaults_are_the_family_samplers_own():
    """The options change no result: every default is the one the sampler function had (and still has)."""
    from dlm.sampling import masked, simplex

    for cls, fn in ((MaskedOptions, masked.generate), (SimplexOptions, simplex.generate)):
        params = inspect.signature(fn).parameters
        assert {k: params[k].default for k in cls.model_fields} == cls().model_dump()


# ---- recipe -------------------------------------------------------------------------------------------------------
def test_recipe_eval_section_is_the_same_fields():
    from dlm.config import EvalConfig, RecipeError, load_recipe

    assert {k: EvalConfig.model_fields[k].description for k in SamplingSettings.model_fields} == \
        {k: f.description for cls in OPTIONS.values() for k, f in cls.model_fields.items()}
    with pytest.raises(RecipeError, match=r"mdm.yaml: eval.confidence_threshold: must be a number in \(0, 1\]"):
        load_recipe(ROOT / "recipes/tinymath/mdm.yaml", ["eval.confidence_threshold=1.5"])
    with pytest.raises(RecipeError, match="eval: cache prefix .*needs a block_size"):
        load_recipe(None, ["eval.cache=prefix"])
    recipe = load_recipe(ROOT / "recipes/tinymath/block.yaml", ["eval.reset_carry_per_block=true"])
    assert recipe.eval.sampling_options("masked") == MaskedOptions(policy="threshold", confidence_threshold=0.9,
                                                                   reset_carry_per_block=True)
    for path in sorted((ROOT / "recipes").rglob("*.yaml")):  # every shipped recipe still loads
        if path.parent.name != "accelerate":  # accelerate launch configs, not recipes
            load_recipe(path)


# ---- CLI ----------------------------------------------------------------------------------------------------------
def _actions(command: str) -> dict:
    from dlm.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    return {a.dest: a for a in sub._actions}


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_flags_are_generated_from_the_fields(command):
    actions = _actions(command)
    for cls in OPTIONS.values():
        for name, field in cls.model_fields.items():
            action = actions[name]
            assert action.help.startswith(field.description) and action.default is None
            assert f"--{name.replace('_', '-')}" in action.option_strings
    assert actions["policy"].choices == ("top_u", "threshold", "top_u_or_threshold")
    assert actions["cache"].choices == ("prefix", "dual") and actions["block_size"].type is int
    assert {"--kv-cache", "--no-kv-cache"} <= set(actions["kv_cache"].option_strings)
    for alias, name in ALIASES.items():
        assert f"--{alias.replace('_', '-')}" in actions[name].option_strings


# What each flag the docs use meant before the options were typed (the old argparse defaults were these defaults).
DOCUMENTED = [(["--sampler", "threshold"], "masked", {"policy": "threshold"}),
              (["--policy", "top_u"], "masked", {"policy": "top_u"}),
              (["--u", "4"], "masked", {"reveal_count": 4}),
              (["--tau", "0.95"], "masked", {"confidence_threshold": 0.95}),
              (["--block-size", "32"], "masked", {"block_size": 32}),
              (["--no-kv-cache"], "masked", {"kv_cache": False}),
              (["--block-size", "8", "--cache", "dual"], "masked", {"block_size": 8, "cache": "dual"}),
              (["--steps", "25"], "simplex", {"inference_steps": 25}),
              (["--top-p", "0.99"], "simplex", {"top_p": 0.99}),
              (["--early-stop", "1"], "simplex", {"early_stop_patience": 1}),
              (["--reward-model", "runs/reward", "--eta", "0.25", "--guidance-steps", "2"], "simplex",
               {"reward_model": "runs/reward", "guidance_scale": 0.25, "guidance_steps": 2}),
              ([], "masked", {}), ([], "simplex", {})]


@pytest.mark.parametrize("flags, family, changed", DOCUMENTED)
def test_documented_flags_parse_to_the_same_values(flags, family, changed):
    from dlm.cli import build_parser
    from dlm.cli.flags import sampling_settings as _sampling_settings

    for command in (["generate", "runs/x"], ["eval", "runs/x"]):
        options = _sampling_settings(build_parser().parse_args(command + flags)).sampling_options(family)
        assert options == OPTIONS[family](**changed)


def _documented_commands():
    """Every `dlm generate` / `dlm eval` line in README.md and docs/ (continuation lines joined, comments dropped)."""
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = re.sub(r"\\\n\s*", " ", path.read_text())
        for line in text.splitlines():
            line = line.strip()
            if re.match(r"dlm (generate|eval) \S", line):
                yield path.name, shlex.split(line.split("  #")[0])[1:]


def test_every_documented_command_parses_and_validates():
    from dlm.cli import build_parser
    from dlm.cli.flags import sampling_settings as _sampling_settings
    from dlm.evaluation.sweeps import parse_sweep

    commands = list(_documented_commands())
    assert len(commands) >= 15
    for _where, argv in commands:
        args = build_parser().parse_args(argv)
        settings = _sampling_settings(args)
        if argv[0] == "eval":
            parse_sweep(args.sweep, settings)


def test_cli_errors_name_the_flag(tmp_path, capsys):
    from dlm.cli import build_parser, main
    from dlm.cli.flags import sampling_settings as _sampling_settings

    with pytest.raises(OptionsError, match=r"^--tau 1.5: confidence_threshold must be a number in \(0, 1\]$"):
        _sampling_settings(build_parser().parse_args(["eval", "runs/x", "--tau", "1.5"]))
    for flags, message in ((["--u", "0"], "--u 0: reveal_count must be an integer >= 1"),
                           (["--sweep", "eta=0,0.5"], "--sweep 'eta=0,0.5': guidance_scale 0.5 needs a reward_model")):
        with pytest.raises(SystemExit) as e:
            main(["eval", "runs/x", "--data", str(tmp_path / "d.jsonl"), *flags])
        assert e.value.code == 2 and capsys.readouterr().err.startswith(f"dlm eval: {message}")


# ---- sweeps -------------------------------------------------------------------------------------------------------
def test_sweep_values_are_checked_by_the_options():
    from dlm.evaluation.sweeps import parse_sweep

    assert parse_sweep("block_size=4,8") == ("block_size", [4, 8])
    assert parse_sweep("sampler=top_u,threshold") == ("policy", ["top_u", "threshold"])
    assert parse_sweep("eta=0,0.5", SimplexOptions(reward_model="rm")) == ("guidance_scale", [0.0, 0.5])
    for bad, msg in (("tau=0.7,1.5", r"confidence_threshold must be a number in \(0, 1\]"),
                     ("steps=0", "inference_steps must be an integer >= 1"), ("policy=nope", "one of top_u"),
                     ("cache=dual", "needs a block_size"), ("taux=1", "did you mean tau")):
        with pytest.raises(OptionsError, match=f"--sweep '{re.escape(bad)}': .*{msg}"):
            parse_sweep(bad)


# ---- generate: typed options give exactly the family samplers' results -------------------------------------------
def _prompts(lengths=(3, 7, 5)):
    g = torch.Generator().manual_seed(4)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _masked(attention="bidirectional", block_size=None, carry=False):
    from dlm.modeling.carry import CARRY_MODULE

    m = tiny_model(VOCAB, attention=attention, family="masked", seed=1, mask_token_id=MASK, carry=carry,
                   **({"block_size": block_size} if block_size else {}))
    if carry:
        norm = getattr(m.backbone, CARRY_MODULE)
        with torch.no_grad():  # not the zero init: the carry must change the outputs
            norm.weight.copy_(1 + torch.randn(norm.weight.shape, generator=torch.Generator().manual_seed(7)))
    return perturb(m, 1)


CASES = [("full", MaskedOptions(policy="threshold", confidence_threshold=0.6, block_size=4)),
         ("full", MaskedOptions(reveal_count=3, block_size=4, cache="dual")),
         ("block", MaskedOptions(policy="top_u_or_threshold", reveal_count=1, confidence_threshold=0.7)),
         ("block", MaskedOptions(kv_cache=False)), ("carry", MaskedOptions(block_size=4, reset_carry_per_block=True)),
         ("simplex", SimplexOptions(inference_steps=5, top_p=0.9, early_stop_patience=2)), ("simplex", None)]


@pytest.mark.parametrize("kind, options", CASES)
def test_generate_with_options_equals_the_family_sampler(kind, options):
    from dlm.sampling import generate, masked, simplex
    from tests.test_simplex import simplex_model

    if kind == "simplex":
        m, fn, extra = simplex_model(vocab=VOCAB), simplex.generate, ()
    else:
        m = _masked(**{"full": {}, "block": dict(attention="block_causal", block_size=4),
                       "carry": dict(carry=True)}[kind])
        fn, extra = masked.generate, (MASK,)
    kwargs = {} if options is None else options.model_dump(exclude_defaults=True)
    direct = fn(m, _prompts(), 10, NEVER, PAD, *extra, generator=torch.Generator().manual_seed(0), **kwargs)
    typed = generate(m, _prompts(), options, max_new_tokens=10, eos_id=NEVER, pad_id=PAD,
                     generator=torch.Generator().manual_seed(0))
    assert (typed.tokens, typed.nfe) == (direct.tokens, direct.nfe)


def test_reset_carry_per_block_changes_a_carry_model():
    """The option is not a no-op where it applies: a full-canvas carry model decoded in blocks."""
    from dlm.sampling import generate

    m, kw = _masked(carry=True), dict(max_new_tokens=12, eos_id=NEVER, pad_id=PAD)
    kept = generate(m, _prompts(), MaskedOptions(block_size=4, reveal_count=1), **kw)
    reset = generate(m, _prompts(), MaskedOptions(block_size=4, reveal_count=1, reset_carry_per_block=True), **kw)
    assert kept.tokens != reset.tokens




@pytest.fixture
def saved_masked(tmp_path, tiny_tokenizer):
    m = tiny_model(len(tiny_tokenizer), attention="bidirectional", family="masked")
    m.spec.mask_token_id, m.spec.eos_token_id = tiny_tokenizer.mask_token_id, tiny_tokenizer.eos_token_id
    m.save_pretrained(tmp_path / "mdm")
    tiny_tokenizer.save_pretrained(tmp_path / "mdm")
    return tmp_path / "mdm"


def test_reset_carry_per_block_reaches_the_sampler_from_the_cli(spy, saved_masked, tmp_path, capsys):
    from dlm.cli import main

    main(["generate", str(saved_masked), "--prompt", "Ann has 2 cats.", "--max-new-tokens", "4", "--block-size", "2",
          "--reset-carry-per-block"])
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "Ann has 2 cats.", "response": "return 2", "answer": 2}) + "\n")
    main(["eval", str(saved_masked), "--data", str(data), "--max-new-tokens", "4", "--block-size", "2",
          "--reset-carry-per-block", "--sweep", "u=1,2"])
    assert [(c["reset_carry_per_block"], c["block_size"], c["reveal_count"]) for c in spy] == \
        [(True, 2, 2), (True, 2, 1), (True, 2, 2)]
    main(["generate", str(saved_masked), "--prompt", "Ann has 2 cats.", "--max-new-tokens", "4"])
    assert spy[-1]["reset_carry_per_block"] is False


def test_reset_carry_per_block_reaches_the_sampler_from_a_recipe(spy, saved_masked, tiny_tokenizer):
    """The in-run evaluation path (`Trainer.evaluate` passes the recipe's eval section to `evaluate`)."""
    from dlm.config import load_recipe
    from dlm.evaluation.tasks import evaluate
    from dlm.sampling import load_for_inference

    recipe = load_recipe(ROOT / "recipes/tinymath/mdm.yaml", ["eval.reset_carry_per_block=true", "eval.block_size=2"])
    model, tok = load_for_inference(saved_masked)
    evaluate(model, tok, [{"prompt": "Ann has 2 cats.", "answer": 2}], recipe.eval, max_new_tokens=4)
    assert (spy[-1]["reset_carry_per_block"], spy[-1]["block_size"], spy[-1]["policy"]) == (True, 2, "top_u")


# ---- the step vocabulary ------------------------------------------------------------------------------------------
def test_masked_and_block_cache_form_no_import_circle():
    def imports(module):
        tree = ast.parse((ROOT / "src/dlm/sampling" / f"{module}.py").read_text())
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | \
            {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}

    assert not {"dlm.sampling.masked"} & imports("block_cache") and "dlm.sampling.steps" in imports("block_cache")
    assert not {"dlm.sampling.masked", "dlm.sampling.block_cache"} & imports("steps")
