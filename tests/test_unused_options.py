"""No sampling option silently ignored (issue 49): given without a policy, an option selects the policy that reads it
(tau alone: threshold); given with a policy that does not read it, it is refused with one line naming both; defaults
from a recipe are never refused. Results list only the options in effect (`SamplingOptions.in_effect`). The server's
and lm-eval's share of the rule is tested in test_serve.py and test_lm_eval.py."""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from dlm.errors import OptionsError
from dlm.sampling.options import (
    MaskedOptions,
    SimplexOptions,
    UnusedOptionError,
    ignored,
    parse_options,
    parse_settings,
)
from tests.conftest import perturb, tiny_model

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")


# ---- the rule -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("given, policy", [({"confidence_threshold": 0.5}, "threshold"),
                                           ({"reveal_count": 3}, "top_u"),
                                           ({"reveal_count": 3, "confidence_threshold": 0.5}, "top_u_or_threshold"),
                                           ({"block_size": 4}, "top_u")])
def test_an_option_given_without_a_policy_selects_the_policy_that_reads_it(given, policy):
    for options in (parse_options("masked", given), parse_settings(given).sampling_options("masked"),
                    MaskedOptions(**given), MaskedOptions().replace(**given)):
        assert options.policy == policy
        assert {k: getattr(options, k) for k in given} == given


def test_given_options_select_their_policy_over_a_default_policy():
    """A default policy (a recipe's eval section, a server's flags) yields to the options the user gives."""
    recipe_top_u = MaskedOptions(policy="top_u", reveal_count=4)
    assert recipe_top_u.override({"confidence_threshold": 0.7}).policy == "threshold"
    assert recipe_top_u.override({"reveal_count": 2}).policy == "top_u"
    assert MaskedOptions(policy="threshold").override({"reveal_count": 2}).policy == "top_u"
    both = MaskedOptions(policy="top_u_or_threshold")  # reads tau already: kept
    assert both.override({"confidence_threshold": 0.7}) == MaskedOptions(policy="top_u_or_threshold",
                                                                        confidence_threshold=0.7)
    assert recipe_top_u.override({"policy": "threshold"}).policy == "threshold"


@pytest.mark.parametrize("policy, field, flag", [("top_u", "confidence_threshold", "--tau"),
                                                 ("threshold", "reveal_count", "--u")])
def test_an_option_the_given_policy_does_not_read_is_refused_naming_both(policy, field, flag):
    values = {"policy": policy, field: 0.5 if field == "confidence_threshold" else 3}
    makes = [lambda: parse_settings(values, names={field: flag}), lambda: parse_options("masked", values),
             lambda: MaskedOptions().override(values)]
    for make in makes:
        with pytest.raises(UnusedOptionError, match=f"{field}.* is not used by policy {policy}; leave it out") as e:
            make()
        assert e.value.field == field and "\n" not in str(e.value)
    with pytest.raises(UnusedOptionError, match=f"^{flag} \\({field}\\) is not used by policy {policy}"):
        makes[0]()
    assert parse_options("masked", {**values, "policy": "top_u_or_threshold"}).policy == "top_u_or_threshold"


def test_recipe_values_are_defaults_and_never_refused(tmp_path):
    from dlm.config import dump_recipe, load_recipe

    recipe = load_recipe(ROOT / "recipes/tinymath/mdm.yaml", ["eval.confidence_threshold=0.8"])  # policy: top_u
    assert recipe.eval.sampling_options("masked").policy == "top_u"  # the recipe's choice, not refused
    written = tmp_path / "recipe.yaml"  # as a run writes it back: every field set, tau under top_u included
    written.write_text(dump_recipe(recipe))
    assert load_recipe(written).eval.sampling_options("masked") == recipe.eval.sampling_options("masked")
    assert load_recipe(None, ["eval.confidence_threshold=0.8"]).eval.sampling_options("masked").policy == "threshold"


def test_tau_alone_decodes_with_the_threshold_sampler():
    """Not a label: `generate` with tau alone gives exactly the threshold sampler's tokens and NFE."""
    from dlm.sampling import generate, masked

    m = perturb(tiny_model(40, attention="bidirectional", family="masked", seed=1, mask_token_id=2), 1)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    kw = dict(max_new_tokens=10, eos_id=99, pad_id=0)
    alone = generate(m, prompts, {"confidence_threshold": 0.01}, **kw)  # every confidence is >= 1/40
    direct = masked.generate(m, prompts, 10, 99, 0, 2, policy="threshold", confidence_threshold=0.01)
    top_u = masked.generate(m, prompts, 10, 99, 0, 2, policy="top_u")
    assert (alone.tokens, alone.nfe) == (direct.tokens, direct.nfe)
    assert alone.nfe == [1, 1] and top_u.nfe == [5, 5]


# ---- what is in effect --------------------------------------------------------------------------------------------
FULL = SimpleNamespace(attention="bidirectional", carry=False, block_size=None)
BLOCK = SimpleNamespace(attention="block_causal", carry=False, block_size=8)
CARRY = SimpleNamespace(attention="bidirectional", carry=True, block_size=None)


@pytest.mark.parametrize("options, spec, listed", [
    (MaskedOptions(), FULL, {"policy": "top_u", "reveal_count": 2, "block_size": None}),
    (MaskedOptions(confidence_threshold=0.7), FULL, {"policy": "threshold", "confidence_threshold": 0.7,
                                                     "block_size": None}),
    (MaskedOptions(policy="top_u_or_threshold"), BLOCK, {"policy": "top_u_or_threshold", "reveal_count": 2,
                                                         "confidence_threshold": 0.9, "block_size": 8,
                                                         "kv_cache": True}),
    (MaskedOptions(block_size=4, cache="dual"), FULL, {"policy": "top_u", "reveal_count": 2, "block_size": 4,
                                                       "cache": "dual"}),
    (MaskedOptions(block_size=4, reset_carry_per_block=True), CARRY, {"policy": "top_u", "reveal_count": 2,
                                                                      "block_size": 4, "reset_carry_per_block": True}),
    (SimplexOptions(inference_steps=5), None, {"inference_steps": 5, "top_p": None, "early_stop_patience": None,
                                               "guidance_scale": 0.0}),
    (SimplexOptions(guidance_scale=0.5, reward_model="rm"), None, {**SimplexOptions().model_dump(),
                                                                   "guidance_scale": 0.5, "reward_model": "rm"}),
])
def test_in_effect_lists_what_the_sampler_reads(options, spec, listed):
    assert options.in_effect(spec) == listed


def test_given_options_a_model_does_not_read_are_named():
    settings = parse_settings({"kv_cache": False, "confidence_threshold": 0.5, "inference_steps": 3})
    assert ignored("masked", settings, FULL) == ["inference_steps (simplex sampler)",
                                                 "kv_cache (not read with these settings on a bidirectional model)"]
    assert ignored("masked", settings, BLOCK) == ["inference_steps (simplex sampler)"]


# ---- the CLI ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tiny_tokenizer, tmp_path_factory):
    """A masked model (full canvas), a block-causal one and an AR one, saved; a one-problem tinymath file."""
    root = tmp_path_factory.mktemp("unused")
    out = {}
    for name, kw in (("mdm", dict(attention="bidirectional", family="masked")),
                     ("block", dict(attention="block_causal", family="masked", label_shift=True, block_size=4)),
                     ("ar", {})):
        m = tiny_model(len(tiny_tokenizer), **kw)
        m.spec = m.spec.model_copy(update={"mask_token_id": tiny_tokenizer.mask_token_id,
                                           "eos_token_id": tiny_tokenizer.eos_token_id})
        m.save_pretrained(root / name)
        tiny_tokenizer.save_pretrained(root / name)
        out[name] = root / name
    out["data"] = root / "d.jsonl"
    out["data"].write_text(json.dumps({"prompt": "Ann has 2 cats.", "response": "return 2", "answer": 2}) + "\n")
    return out




@pytest.mark.parametrize("command", ["generate", "eval"])
@pytest.mark.parametrize("flags, message", [
    (["--policy", "top_u", "--tau", "0.8"], r"--tau \(confidence_threshold\) is not used by policy top_u"),
    (["--sampler", "threshold", "--u", "4"], r"--u \(reveal_count\) is not used by policy threshold"),
])
def test_cli_refuses_an_option_the_chosen_policy_does_not_read(saved, capsys, command, flags, message):
    from dlm.cli import main

    extra = ["--prompt", "hi"] if command == "generate" else ["--data", str(saved["data"])]
    with pytest.raises(SystemExit) as e:
        main([command, str(saved["mdm"]), *extra, *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith(f"dlm {command}: ")
    assert re.search(message, err)


def test_cli_tau_alone_decodes_with_threshold_and_rows_list_what_is_in_effect(saved, spy, tmp_path, capsys):
    from dlm.cli import main

    main(["generate", str(saved["mdm"]), "--prompt", "Ann has 2 cats.", "--max-new-tokens", "4", "--tau", "0.5"])
    assert (spy[-1]["policy"], spy[-1]["confidence_threshold"]) == ("threshold", 0.5)
    out = tmp_path / "t.json"
    main(["eval", str(saved["mdm"]), str(saved["block"]), str(saved["ar"]), "--data", str(saved["data"]),
          "--max-new-tokens", "4", "--tau", "0.5", "--no-kv-cache", "--out", str(out), "--samples",
          str(tmp_path / "s.jsonl")])
    assert [c["policy"] for c in spy[1:]] == ["threshold", "threshold"]
    printed = capsys.readouterr().out
    mdm, block, ar = json.loads(out.read_text())["rows"]
    options = {k for k in MaskedOptions.model_fields}
    assert {k: mdm[k] for k in options & set(mdm)} == {"policy": "threshold", "confidence_threshold": 0.5,
                                                       "block_size": None}
    assert {k: block[k] for k in options & set(block)} == {"policy": "threshold", "confidence_threshold": 0.5,
                                                           "block_size": 4, "kv_cache": False}
    assert not options & set(ar)
    assert "mdm (masked) ignores kv_cache (not read with these settings on a bidirectional model)" in printed
    assert "ar (autoregressive) ignores confidence_threshold (masked sampler), kv_cache (masked sampler)" in printed
    assert "mdm [policy=threshold, confidence_threshold=0.5]" in printed and "reveal_count" not in printed
    samples = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert "reveal_count" not in samples[0] and samples[0]["policy"] == "threshold"


def test_cli_generate_names_what_a_model_does_not_read(saved, capsys):
    from dlm.cli import main

    main(["generate", str(saved["ar"]), "--prompt", "hi", "--max-new-tokens", "2", "--tau", "0.5"])
    assert "ar (autoregressive) ignores confidence_threshold (masked sampler)" in capsys.readouterr().err
    main(["generate", str(saved["mdm"]), "--prompt", "hi", "--max-new-tokens", "2", "--no-kv-cache"])
    assert "ignores kv_cache" in capsys.readouterr().err
    main(["generate", str(saved["block"]), "--prompt", "hi", "--max-new-tokens", "2", "--no-kv-cache"])
    assert "ignores" not in capsys.readouterr().err


def test_sweep_counts_as_a_given_option(saved, spy):
    from dlm.evaluation.sweeps import parse_sweep, run_sweep

    with pytest.raises(OptionsError, match=r"--sweep 'tau=0.5,0.9': confidence_threshold is not used by policy "
                                           "top_u"):
        parse_sweep("tau=0.5,0.9", parse_settings({"policy": "top_u"}))
    with pytest.raises(OptionsError, match="reveal_count is not used by policy threshold"):
        parse_sweep("policy=threshold", parse_settings({"reveal_count": 3}))
    assert parse_sweep("policy=top_u,threshold", parse_settings({"reveal_count": 3}))[1] == ["top_u", "threshold"]
    r = run_sweep([saved["mdm"]], saved["data"], parse_settings({"reveal_count": 3}), sweep="tau=0.5,0.9",
                  max_new_tokens=4, progress=False)
    assert [(x["policy"], x["confidence_threshold"], x["reveal_count"]) for x in r["rows"]] == \
        [("top_u_or_threshold", 0.5, 3), ("top_u_or_threshold", 0.9, 3)]
    assert [(c["policy"], c["confidence_threshold"]) for c in spy] == [("top_u_or_threshold", 0.5),
                                                                      ("top_u_or_threshold", 0.9)]
    r = run_sweep([saved["mdm"]], saved["data"], None, sweep="policy=top_u,threshold", max_new_tokens=4,
                  progress=False)
    assert [sorted(set(x) & {"reveal_count", "confidence_threshold"}) for x in r["rows"]] == \
        [["reveal_count"], ["confidence_threshold"]]


def test_mask_discrepancy_refuses_sampling_flags_it_does_not_use(saved, capsys):
    from dlm.cli import main

    with pytest.raises(SystemExit, match="--metric mask-discrepancy measures the top-u sampler with --u alone; "
                                         "--tau would be ignored"):
        main(["eval", str(saved["mdm"]), "--metric", "mask-discrepancy", "--tau", "0.5"])


def test_serve_flags_follow_the_rule(saved, capsys):
    from dlm.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", str(saved["mdm"]), "--policy", "top_u", "--tau", "0.8"])
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("dlm serve: --tau (confidence_threshold) is not used by policy top_u")



def test_the_decoders_rules_are_listed_where_read_and_named_where_not(saved, spy, tmp_path, capsys):
    """Issue 45's rules are CLI flags like every option: a result row lists the ones set (they are read on every masked
    model), refresh_every only on a block-causal model; on a full-canvas model it is named as ignored."""
    from dlm.cli import main

    out = tmp_path / "r.json"
    main(["eval", str(saved["mdm"]), str(saved["block"]), "--data", str(saved["data"]), "--max-new-tokens", "4",
          "--sub-block-size", "2", "--eos-confidence", "0.5", "--nfe-budget", "3", "--refresh-every", "2",
          "--out", str(out)])
    mdm, block = json.loads(out.read_text())["rows"]
    for row in (mdm, block):
        assert (row["sub_block_size"], row["eos_confidence"], row["nfe_budget"]) == (2, 0.5, 3)
    assert "refresh_every" not in mdm and block["refresh_every"] == 2
    assert "mdm (masked) ignores refresh_every (not read with these settings on a bidirectional model)" in \
        capsys.readouterr().out
    assert [c["sub_block_size"] for c in spy] == [2, 2] and spy[1]["refresh_every"] == 2
