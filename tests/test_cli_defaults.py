"""Every subcommand's --help runs, and the defaults the flags use and show are the library's (defined once)."""

import argparse
import dataclasses
import inspect

import pytest

from dlm.cli import build_parser, main
from dlm.evaluation.plan import EvalRequest, EvalRequestError, run_eval, smoke_capped


def _subparsers(parser, path=()):
    """(command path, parser) for every subcommand, nested ones (data tinymath) included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from _subparsers(sub, (*path, name))


def _parser(*path):
    return dict(_subparsers(build_parser()))[path]


def _action(parser, flag):
    return next(a for a in parser._actions if flag in a.option_strings)


def _help(parser, flag):
    return " ".join(_action(parser, flag).help.split())


def test_every_subcommand_help_runs(capsys):
    paths = [path for path, sub in _subparsers(build_parser()) if sub.add_help]  # lm-eval passes --help to lm-eval
    assert {("data", "shakespeare"), ("serve",), ("export",)} <= set(paths)
    for path in paths:
        with pytest.raises(SystemExit) as exit:
            main([*path, "--help"])
        assert exit.value.code == 0
        assert f"usage: dlm {' '.join(path)}" in capsys.readouterr().out


def test_serve_limit_flags_show_the_library_defaults():
    from dlm.serve import serve
    from dlm.serve.limits import FALLBACK_MAX_TOKENS, Limits

    v = _parser("serve")
    flags = {"max_tokens": "--max-tokens", "max_batch_size": "--max-batch-size", "batch_window_ms": "--batch-window-ms",
             "max_concurrent": "--max-concurrent", "max_body_bytes": "--max-body-bytes", "timeout_s": "--timeout",
             "body_timeout_s": "--body-timeout", "send_timeout_s": "--send-timeout",
             "max_stop_chars": "--max-stop-chars", "default_max_tokens": "--default-max-tokens",
             "max_prompt_tokens": "--max-prompt-tokens", "max_nfe": "--max-nfe"}
    for field in dataclasses.fields(Limits):
        if field.name in flags:
            assert _action(v, flags[field.name]).default == field.default, field.name
            if field.default is not None:
                shown = f"{field.default:g}" if isinstance(field.default, float) else str(field.default)
                assert f"(default: {shown})" in _help(v, flags[field.name]), field.name
    assert _action(v, "--static-batching").default is (not Limits.continuous)
    assert f"else {FALLBACK_MAX_TOKENS})" in _help(v, "--default-max-tokens")
    for name in ("host", "port"):
        default = inspect.signature(serve).parameters[name].default
        assert _action(v, f"--{name}").default == default and f"(default: {default}" in _help(v, f"--{name}")


@pytest.mark.parametrize("path, writer, renamed", [
    (("data", "shakespeare"), "dlm.data.shakespeare:write_shakespeare", {}),
    (("data", "tinymath"), "dlm.data.tinymath:write_tinymath", {"n_val": "n_validation"}),
])
def test_data_flags_show_the_writers_defaults(path, writer, renamed):
    import importlib

    module, name = writer.split(":")
    parameters = inspect.signature(getattr(importlib.import_module(module), name)).parameters
    parser = _parser(*path)
    dests = {a.dest: a for a in parser._actions}
    checked = 0
    for param in parameters.values():
        dest = renamed.get(param.name, param.name)
        if dest in dests and dests[dest].option_strings and param.default is not inspect.Parameter.empty:
            assert dests[dest].default == param.default, dest
            text = dests[dest].help or "" if param.default is not None else ""
            assert "(default" not in text or f"(default: {param.default}" in " ".join(text.split()), dest
            checked += 1
    assert checked >= 5


def test_eval_flags_are_the_request_fields_with_its_defaults():
    e = _parser("eval")
    dests = {a.dest: a for a in e._actions}
    for field in dataclasses.fields(EvalRequest):
        assert field.name in dests, f"EvalRequest.{field.name} has no dlm eval flag"
        if field.default is not dataclasses.MISSING:
            assert dests[field.name].default == field.default, field.name


@pytest.mark.parametrize("changes, message", [
    (dict(metric="intrinsic"), "--metric intrinsic needs --reference-model"),
    (dict(metric="intrinsic", reference_model="runs/ref", sweep="tau=0.5,0.9"), "--sweep would be ignored"),
    (dict(task="lm-eval:dlm_tinymath", pass_k="1,10"), "are for dlm's own tasks"),
    (dict(metric="mask-discrepancy", device="cuda"), "runs on the CPU in float32"),
    (dict(metric="intrinsic", samples="s.jsonl"), "--samples writes graded problems"),
])
def test_run_eval_refuses_contradictions_before_any_work(changes, message):
    with pytest.raises(EvalRequestError, match=message):
        run_eval(EvalRequest(models=["runs/does-not-exist"], **changes))


def test_mask_discrepancy_names_the_option_as_the_caller_spells_it():
    from dlm.sampling.options import parse_settings

    request = EvalRequest(models=["runs/x"], metric="mask-discrepancy")
    settings = parse_settings({"confidence_threshold": 0.8})
    with pytest.raises(EvalRequestError, match="--tau would be ignored"):
        run_eval(request, settings, names={"confidence_threshold": "--tau"})
    with pytest.raises(EvalRequestError, match="confidence_threshold would be ignored"):
        run_eval(request, settings)


def test_smoke_caps_an_eval_request(monkeypatch, capsys):
    from dlm.config import SMOKE_ENV, SMOKE_N, SMOKE_TOKENS

    request = EvalRequest(models=["runs/x"], n=SMOKE_N * 10, max_new_tokens=None)
    monkeypatch.setenv(SMOKE_ENV, "0")
    assert smoke_capped(request) == request
    monkeypatch.setenv(SMOKE_ENV, "1")
    capped = smoke_capped(request)
    assert (capped.n, capped.max_new_tokens) == (SMOKE_N, SMOKE_TOKENS)
    assert smoke_capped(dataclasses.replace(request, n=2)).n == 2
    assert "not a result" in capsys.readouterr().err


def test_generation_length_is_the_eval_sections_default(tmp_path):
    from dlm.config import GENERATION_LENGTH, EvalConfig, run_generation_length

    assert EvalConfig().max_new_tokens == GENERATION_LENGTH
    assert run_generation_length(tmp_path) == GENERATION_LENGTH  # no run recipe here
    assert f"else {GENERATION_LENGTH})" in _help(_parser("generate"), "--max-new-tokens")
