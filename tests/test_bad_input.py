"""Bad input through the CLI: each case ends with a non-zero exit and one line that names the file, line or field,
never a traceback (issue 12, item 6). Bugs keep their traceback."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlm.cli import main
from tests.conftest import tiny_model

LONG_LINE = "Mia has 3 apples and buys 4 more. " * 150_000  # 5.1 MB: ~4 M tokens, hours of attention on 2 cores


def one_line_error(capsys, *argv) -> str:
    """Run `dlm argv...`; assert it exits non-zero with exactly one line of message; return that line."""
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    err = capsys.readouterr().err
    if isinstance(e.value.code, str):  # `sys.exit(message)` (dlm eval's own wrappers): status 1, message printed
        err = e.value.code + "\n"
    else:
        assert e.value.code == 2
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def ar_model(tmp_path, tiny_tokenizer):
    """A tiny untrained AR model (context: 128 positions) saved as a dlm model directory."""
    m = tiny_model(len(tiny_tokenizer))
    m.spec.eos_token_id, m.spec.pad_token_id = tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id
    m.save_pretrained(tmp_path / "ar")
    tiny_tokenizer.save_pretrained(tmp_path / "ar")
    assert m.config.max_position_embeddings == 128
    return tmp_path / "ar"


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tiny_train_recipe(tmp_path, *lines):
    data = write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"p {i}", "response": f"r {i}"} for i in range(8)])
    recipe = tmp_path / "r.yaml"
    recipe.write_text("\n".join(["model:", "  preset: nano", "data:", "  source: jsonl", f"  train: {data}",
                                 "train:", "  steps: 1", "  batch_size: 2", *lines]) + "\n")
    return recipe


# ---- models that are not there ----------------------------------------------------------------------------------
def test_missing_model_directory(tmp_path, capsys):
    assert one_line_error(capsys, "eval", "/no/such/dir") == "dlm eval: /no/such/dir: no such file or directory"
    assert one_line_error(capsys, "generate", "/no/such/dir", "--prompt", "hi") == (
        "dlm generate: /no/such/dir: no such file or directory")
    (tmp_path / "empty").mkdir()
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "response": "b", "answer": 1}])
    assert one_line_error(capsys, "eval", tmp_path / "empty", "--data", data) == (
        f"dlm eval: {tmp_path / 'empty'}: no model here (expected config.json in it or in {tmp_path / 'empty/model'})")


def test_train_from_a_missing_init_checkpoint(tmp_path, capsys):
    recipe = tiny_train_recipe(tmp_path, "out_dir: " + str(tmp_path / "run"))
    line = one_line_error(capsys, "train", recipe, "--set", "model.init_from=/nowhere/model")
    assert line == "dlm train: /nowhere/model: no such file or directory"


# ---- files that cannot be read ----------------------------------------------------------------------------------
def test_non_utf8_files_are_named_with_their_line(tmp_path, capsys, ar_model):
    recipe = tmp_path / "latin1.yaml"
    recipe.write_bytes("train:\n  # caf\xe9\n  steps: 1\n".encode("latin-1"))
    assert one_line_error(capsys, "train", recipe) == (
        f"dlm train: {recipe}:2: not UTF-8 text (byte 0xe9 at column 8); save the file as UTF-8")

    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"prompt": "a", "response": "b", "answer": 1}\n{"prompt": "caf\xe9", "response": "b"}\n')
    assert one_line_error(capsys, "eval", ar_model, "--data", data).endswith(f"{data}:2: not UTF-8 text (byte 0xe9 "
                                                                             f"at column 16); save the file as UTF-8")
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"hello\n\n\xff\xfe\n")
    assert one_line_error(capsys, "generate", ar_model, "--file", prompts) == (
        f"dlm generate: {prompts}:3: not UTF-8 text (byte 0xff at column 1); save the file as UTF-8")

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"one document\n\nanother \x80\n")
    recipe = tiny_train_recipe(tmp_path, f"out_dir: {tmp_path / 'run'}")
    line = one_line_error(capsys, "train", recipe, "--set", "data.source=text", "--set", f"data.train={corpus}")
    assert line == f"dlm train: {corpus}:3: not UTF-8 text (byte 0x80 at column 9); save the file as UTF-8"


def test_unreadable_and_missing_files(tmp_path, capsys, ar_model):
    assert one_line_error(capsys, "train", tmp_path) == f"dlm train: {tmp_path}: is a directory, not a file"
    assert one_line_error(capsys, "generate", ar_model, "--file", tmp_path / "none.txt") == (
        f"dlm generate: {tmp_path / 'none.txt'}: no such file")
    secret = tmp_path / "secret.yaml"
    secret.write_text("train:\n  steps: 1\n")
    secret.chmod(0)
    if os.access(secret, os.R_OK):  # root reads anything
        pytest.skip("running as root: a mode-000 file is still readable")
    assert one_line_error(capsys, "train", secret) == f"dlm train: {secret}: cannot read it (Permission denied)"


# ---- recipes that are not recipes -------------------------------------------------------------------------------
@pytest.mark.parametrize("text, message", [
    ("train:\n  steps: 10\n   lr: 3\n", "r.yaml:3:6: invalid YAML (mapping values are not allowed here)"),
    ("model:\n  preset: [nano\ntrain:\n  steps: 1\n", "r.yaml:3:6: invalid YAML (expected ',' or ']', but got ':')"),
    ("", "r.yaml: the recipe is empty; give at least the sections that differ from the defaults (e.g. "
         "train.objective), see recipes/"),
    ("# only a comment\n\n", "r.yaml: the recipe is empty"),
    ("- train\n- model\n", "r.yaml: a recipe must be a mapping of sections (model:, data:, train:, ...), got a list"),
    ("ar\n", "r.yaml: a recipe must be a mapping of sections (model:, data:, train:, ...), got a str"),
    ("train:\n  steps: 0\n  stpes: 3\n", "r.yaml: train.steps: Input should be greater than 0; train.stpes: "
                                         "unknown key"),
])
def test_bad_recipe_files(tmp_path, capsys, text, message):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    line = one_line_error(capsys, "train", recipe, "--out-dir", tmp_path / "never")
    assert line.startswith(f"dlm train: {tmp_path}/{message}")
    assert not (tmp_path / "never").exists()  # refused before any work (an empty recipe used to train 1,000 steps)


# ---- prompts longer than the model's context --------------------------------------------------------------------
def test_a_5mb_prompt_line_is_refused_at_once_or_cut_on_request(tmp_path, capsys, ar_model, monkeypatch):
    import dlm.data.prompts as prompts_module

    tokenized = []
    real = prompts_module.encode_pair
    monkeypatch.setattr(prompts_module, "encode_pair", lambda tok, p, r: tokenized.append(len(p)) or real(tok, p, r))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"Ann has 2 cats.\n{LONG_LINE}\n")
    t0 = time.perf_counter()
    line = one_line_error(capsys, "generate", ar_model, "--file", prompts, "--max-new-tokens", "8")
    assert line.startswith(f"dlm generate: {prompts}:2: prompt is over ") and line.endswith(
        f" tokens (its last 2,080 of {len(LONG_LINE.strip()):,} characters alone), more than the model's context of "
        "128 (max_position_embeddings); shorten it, or keep its last 120 tokens (128 minus 8 to generate) with "
        "--truncate-prompts")

    # dlm eval refuses it naming file:line, and with --truncate-prompts keeps the end of the prompt, as training
    # canvases do, and says so
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Ann has 2 cats.", "response": "x", "answer": 2},
                                               {"prompt": LONG_LINE, "response": "x", "answer": 1}])
    line = one_line_error(capsys, "eval", ar_model, "--data", data, "--max-new-tokens", "8")
    assert line.startswith(f"dlm eval: {data}:2: prompt is over ") and line.endswith("with --truncate-prompts")
    main(["eval", str(ar_model), "--data", str(data), "--max-new-tokens", "8", "--truncate-prompts"])
    captured = capsys.readouterr()
    assert "trivial baseline" in captured.out
    assert (f"dlm: 1 of 2 prompts were longer than the model's context of 128 and kept their last 120 tokens (128 "
            f"minus 8 to generate); the first: {data}:2, over ") in captured.err
    assert time.perf_counter() - t0 < 60  # it ran for hours without output, or asked for 17 TB
    assert max(tokenized) < 10_000  # the 5 MB line itself was never tokenized


def test_generate_refuses_or_truncates_a_long_prompt(tmp_path, capsys, ar_model):
    from dlm.data.prompts import encode_prompts
    from dlm.data.tokenizer import encode_pair
    from dlm.errors import OptionsError
    from dlm.sampling import load_for_inference

    model, tok = load_for_inference(ar_model)
    prompt = "Mia has 3 apples. " * 40
    n = len(encode_pair(tok, prompt, "")[0])
    assert 128 < n < 16 * 130  # longer than the context, tokenized whole
    assert one_line_error(capsys, "generate", ar_model, "--prompt", "hi", "--prompt", prompt, "--max-new-tokens",
                          "8") == (f"dlm generate: prompt 2: prompt is {n} tokens, more than the model's context of "
                                   f"128 (max_position_embeddings); shorten it, or keep its last 120 tokens (128 minus "
                                   f"8 to generate) with --truncate-prompts")
    main(["generate", str(ar_model), "--prompt", prompt, "--max-new-tokens", "8", "--truncate-prompts"])
    captured = capsys.readouterr()
    assert "(8 NFE)" in captured.out and f"the first: prompt 1, {n} tokens" in captured.err

    for text in (prompt, prompt * 7500):  # whole, and from a slice of a 5 MB prompt: the same last 120 tokens
        (ids,) = encode_prompts(tok, [text], model, 8, truncate=True)
        assert ids == encode_pair(tok, prompt, "")[0][-120:]
    fits = prompt[: max(i for i in range(len(prompt)) if len(encode_pair(tok, prompt[:i], "")[0]) <= 128)]
    assert len(encode_pair(tok, fits, "")[0]) > 120  # fits the context, not with the generation: left as it is
    for truncate in (False, True):
        assert encode_prompts(tok, [fits], model, 8, truncate=truncate) == [encode_pair(tok, fits, "")[0]]
    with pytest.raises(OptionsError, match="max_new_tokens 128 fills the model's whole context"):
        encode_prompts(tok, [prompt], model, 128, truncate=True)


# ---- no traceback, and bugs keep theirs -------------------------------------------------------------------------
def test_no_traceback_from_the_console(tmp_path):
    import dlm

    src = str(Path(dlm.__file__).parents[1])  # the sources this test process runs
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    (tmp_path / "empty.yaml").write_text("")
    for argv, expected in ((["generate", "/no/such/dir", "--prompt", "hi"], "dlm generate: /no/such/dir: no such file"),
                           (["train", str(tmp_path / "empty.yaml")], "dlm train: ")):
        proc = subprocess.run([sys.executable, "-m", "dlm.cli", *argv], capture_output=True, text=True, timeout=120,
                              env=env, cwd=tmp_path)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.startswith(expected) and len(proc.stderr.splitlines()) == 1, proc.stderr


def test_bugs_keep_their_traceback(tmp_path, monkeypatch):
    import functools

    import dlm.data.tinymath

    @functools.wraps(dlm.data.tinymath.write_tinymath)  # its signature kept: the flags read their defaults from it
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(dlm.data.tinymath, "write_tinymath", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["data", "tinymath", "--out", str(tmp_path)])
