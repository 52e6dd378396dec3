"""dlm as an lm-eval model (`dlm.evaluation.lm_eval`) and its likelihoods (`dlm.evaluation.elbo`): the masked ELBO
against exact enumeration over every mask, AR likelihoods against token-by-token scoring, lm-eval tasks over local
data (dlm's packaged tinymath task graded in the sandbox, a multiple-choice and a perplexity task from jsonl) with
identical results at batch sizes 1 and 8, and the three ways in: `dlm eval --task lm-eval:`, `simple_evaluate(
model="dlm")` and `dlm lm-eval`."""

import itertools
import json
import math
import random

import pytest
import torch

from dlm.errors import DlmError, OptionsError
from dlm.evaluation.elbo import ar_loglikelihood, loglikelihood, masked_loglikelihood
from dlm.modeling.blocks import block_forward
from dlm.modeling.carry import CARRY_MODULE
from tests.conftest import perturb, tiny_model

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.usefixtures("one_thread")

MASK = 3
CTX, CONT = [5, 9, 11], [7, 8, 20, 21, 6]


def _with_carry(m):
    norm = getattr(m.backbone, CARRY_MODULE)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # not the zero init: the carry must reach the outputs
        norm.weight.copy_(1 + torch.randn(norm.weight.shape, generator=g))
        norm.bias.copy_(torch.randn(norm.bias.shape, generator=g))
    return m


def _nll(logits, target):
    logits = logits.float()
    return torch.logsumexp(logits, -1) - logits.gather(-1, torch.tensor(target)[:, None]).squeeze(-1)


def _exact_elbo(model, ctx, cont) -> float:
    """E_l E_M [(L/l) Σ_{i∈M} -log p(x_i | x with M masked)] by enumerating every non-empty mask M of every group
    (the whole continuation; for block diffusion each block, seeing the clean blocks before it), l = |M| uniform."""
    P, L = len(ctx), len(cont)
    block = model.spec.block_size
    groups = [list(range(s, min(s + block, L))) for s in range(0, L, block)] if block else [list(range(L))]
    total = 0.0
    with torch.no_grad():
        for group in groups:
            n = len(group)
            for size in range(1, n + 1):
                for M in itertools.combinations(group, size):
                    noised = ctx + [MASK if i in M else t for i, t in enumerate(cont)]
                    if block:  # the block layout: canvas and targets padded to whole blocks with masks
                        pad = [MASK] * (-L % block)
                        canvas, target = torch.tensor([noised + pad]), torch.tensor([ctx + cont + pad])
                        width = torch.tensor([canvas.shape[1]])
                        carry = torch.zeros(1, canvas.shape[1], model.config.hidden_size)
                        logits = block_forward(model, canvas, target, torch.tensor([P]), width, carry=carry)[0]
                    else:
                        logits = model(torch.tensor([noised]))[0]
                    nll = _nll(logits[P : P + L], cont)
                    total += (1 / n) / math.comb(n, size) * (n / size) * float(nll[list(M)].sum())
    return -total


@pytest.mark.parametrize("kind", ["full_canvas", "block_carry"])
def test_masked_elbo_is_unbiased_against_exact_enumeration(kind):
    """The Monte-Carlo ELBO's mean over independent seeds lies within 4 standard errors of the exact expectation."""
    if kind == "full_canvas":
        m = perturb(tiny_model(40, "bidirectional", "masked", label_shift=True, mask_token_id=MASK))
    else:
        m = perturb(_with_carry(tiny_model(40, "block_causal", "masked", label_shift=True, block_size=2, carry=True,
                                           mask_token_id=MASK)))
    exact = _exact_elbo(m, CTX, CONT)
    runs = [masked_loglikelihood(m, [(CTX, CONT)], mc_num=12, seed=s, batch_size=16)[0][0] for s in range(60)]
    mean = sum(runs) / len(runs)
    se = (sum((r - mean) ** 2 for r in runs) / (len(runs) - 1) / len(runs)) ** 0.5
    assert se < 0.02 * abs(exact)  # the test has power: the spread is small against the value
    assert abs(mean - exact) < 4 * se


def test_masked_elbo_is_deterministic_and_independent_of_batching():
    m = perturb(tiny_model(40, "bidirectional", "masked", label_shift=True, mask_token_id=MASK))
    pairs = [(CTX, CONT), ([4, 4], [9]), ([12, 13, 14, 15, 16, 17], [5, 6, 7]), (CTX, CONT[:2])]
    one = masked_loglikelihood(m, pairs, mc_num=16, batch_size=1, seed=3)
    many = masked_loglikelihood(m, pairs, mc_num=16, batch_size=64, seed=3)
    shuffled = masked_loglikelihood(m, pairs[::-1], mc_num=16, batch_size=5, seed=3)[::-1]
    for (a, ga), (b, gb), (c, gc) in zip(one, many, shuffled):
        assert a == pytest.approx(b, rel=1e-5) and a == pytest.approx(c, rel=1e-5) and ga == gb == gc
    assert masked_loglikelihood(m, pairs, mc_num=16, seed=4)[0][0] != pytest.approx(one[0][0], rel=1e-6)


def test_ar_loglikelihood_is_exact_and_greedy_flags_the_argmax_continuation():
    m = perturb(tiny_model(40))
    with torch.no_grad():
        greedy, ids = [], list(CTX)
        for _ in range(4):
            greedy.append(int(m(torch.tensor([ids]))[0, -1].argmax()))
            ids.append(greedy[-1])
        want = sum(float(torch.log_softmax(m(torch.tensor([CTX + CONT[:j]]))[0, -1], -1)[CONT[j]])
                   for j in range(len(CONT)))
    other = greedy[:3] + [(greedy[3] + 1) % 40]
    pairs = [(CTX, CONT), (CTX, greedy), (CTX, other), ([1], [2, 3])]
    one, eight = ar_loglikelihood(m, pairs, batch_size=1), ar_loglikelihood(m, pairs, batch_size=8)
    assert one[0][0] == pytest.approx(want, rel=1e-5)
    assert [g for _, g in one] == [False, True, False, False] == [g for _, g in eight]
    assert [x for x, _ in one] == pytest.approx([x for x, _ in eight], rel=1e-5)


def test_likelihood_refusals():
    from tests.test_simplex import simplex_model

    with pytest.raises(DlmError, match="not supported for simplex"):
        loglikelihood(simplex_model(vocab=40), [(CTX, CONT)])
    m = tiny_model(40)
    with pytest.raises(DlmError, match="empty context"):
        loglikelihood(m, [([], CONT)])
    with pytest.raises(DlmError, match="does not fit"):
        loglikelihood(m, [(CTX, list(range(200)))])


# ---- lm-eval -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tiny_tokenizer, tmp_path_factory):
    """Tiny AR, masked, block-causal carry and simplex models saved as dlm model directories, and tinymath data."""
    from dlm.data.tinymath import generate_splits
    from tests.test_simplex import simplex_model

    root, tok = tmp_path_factory.mktemp("lm_eval"), tiny_tokenizer
    ids = {"mask_token_id": tok.mask_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    models = {
        "ar": perturb(tiny_model(len(tok), **ids)),
        "masked": perturb(tiny_model(len(tok), "bidirectional", "masked", label_shift=True, **ids)),
        "block_carry": perturb(_with_carry(tiny_model(len(tok), "block_causal", "masked", label_shift=True,
                                                      carry=True, **ids))),
        "simplex": simplex_model(vocab=len(tok)),
    }
    models["simplex"].spec = models["simplex"].spec.model_copy(update=ids)
    out = {}
    for name, m in models.items():
        m.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        out[name] = root / name
    data = root / "tinymath.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate_splits(0, 0, 8, "easy", seed=5)["test"]))
    out["data"] = data
    return out


def _lines(path):
    return [json.loads(line) for line in open(path)]


GENERATION_CASES = {
    "ar": ("ar", {}),
    "masked_top_u": ("masked", {}),
    "masked_threshold_dual_cache": ("masked", {"policy": "threshold", "confidence_threshold": 0.6, "block_size": 4,
                                               "cache": "dual"}),
    "block_carry_kv_cache": ("block_carry", {"reveal_count": 1}),
}


@pytest.mark.parametrize("case", GENERATION_CASES)
def test_generate_until_is_batch_invariant_and_matches_dlm_eval(saved, tmp_path, case):
    """dlm's tinymath task through lm-eval: the same generations, NFE and grades at batch 1 and 8, and the same
    generations and NFE as `dlm eval --task tinymath` (the chat template applied by lm-eval)."""
    from dlm.evaluation.lm_eval import run_lm_eval
    from dlm.evaluation.run import evaluate_model
    from dlm.modeling.spec import ModelSpec
    from dlm.sampling import parse_settings

    name, values = GENERATION_CASES[case]
    options = parse_settings(values)
    runs = []
    for batch in (1, 8):
        r = run_lm_eval(saved[name], "dlm_tinymath", options, data=saved["data"], n=6, batch_size=batch, device="cpu",
                        max_new_tokens=10, apply_chat_template=True, samples=tmp_path / f"{batch}.jsonl")
        lines = _lines(tmp_path / f"{batch}.jsonl")
        runs.append(([(s["doc_id"], s["generation"], s["nfe"], s["grade"]) for s in lines],
                     r["results"]["dlm_tinymath"]["accuracy,none"]))
    assert runs[0] == runs[1]
    config = r["config"]["dlm"]
    spec = ModelSpec.load(saved[name])  # the options in effect on this model, no others (kv_cache: block models)
    assert config["sampling"] == {"family": config["family"], **options.sampling_options(spec.family).in_effect(spec)}
    gen = config["tasks"]["dlm_tinymath"]["generate_until"]
    assert gen["requests"] == 6 and gen["mean_nfe"] > 0 and gen["tokens_per_s"] > 0
    ours = evaluate_model(saved[name], data=saved["data"], n=6, options=options, max_new_tokens=10, batch_size=8,
                          truncate_prompts=True, progress=False)
    assert [(s["generation"], s["nfe"]) for s in ours["samples"]] == [(g[0], n) for _, g, n, _ in runs[0][0]]


def test_generate_until_with_a_simplex_model_is_reproducible(saved, tmp_path):
    """Simplex decoding draws its starting noise per batch: reproducible for a seed and batch size (not across batch
    sizes, unlike greedy masked and AR decoding); every request takes the `steps` reverse steps."""
    from dlm.evaluation.lm_eval import run_lm_eval

    got = []
    for run in range(2):
        r = run_lm_eval(saved["simplex"], "dlm_tinymath", {"inference_steps": 3}, data=saved["data"], n=4,
                        batch_size=2, max_new_tokens=6, device="cpu", samples=tmp_path / f"{run}.jsonl")
        got.append([(s["generation"], s["nfe"]) for s in _lines(tmp_path / f"{run}.jsonl")])
    assert got[0] == got[1] and [nfe for _, nfe in got[0]] == [3] * 4
    assert r["config"]["dlm"]["sampling"]["inference_steps"] == 3


def test_tinymath_task_grades_programs_in_the_sandbox(saved):
    """The packaged task's process_results: the reference program scores 1, a corrupted one 0, a hostile one 0."""
    from lm_eval.tasks import TaskManager

    from dlm.data.tinymath import corrupt_program
    from dlm.evaluation.lm_eval import TASKS_DIR

    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata={"data": str(saved["data"])})
    task = manager.load(["dlm_tinymath"])["tasks"]["dlm_tinymath"]
    docs = list(task.test_docs())
    assert len(docs) == 8
    rng = random.Random(0)
    for doc in docs:
        assert task.process_results(doc, [doc["response"]]) == {"accuracy": 1.0}
        assert task.process_results(doc, [corrupt_program(rng, doc)]) == {"accuracy": 0.0}
    hostile = "import os\ndef solution():\n    os.system('touch /tmp/x')\n    return " + docs[0]["answer"]
    assert task.process_results(docs[0], [hostile]) == {"accuracy": 0.0}


@pytest.fixture(scope="module")
def local_tasks(tmp_path_factory):
    """A multiple-choice and a perplexity task over local jsonl (`dataset_path: json`), as users write their own."""
    root = tmp_path_factory.mktemp("tasks")
    mc = [{"question": f"user: Mia has {i} apples. How many?\nassistant:", "choices": [f" {i}", f" {i + 1}", " pears"],
           "label": i % 3} for i in range(5)]
    text = [{"text": f"Mia has {i} apples and {i + 3} pears. " * (1 + i % 3)} for i in range(4)]
    (root / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mc))
    (root / "text.jsonl").write_text("".join(json.dumps(r) + "\n" for r in text))
    common = "dataset_path: json\ntest_split: test\nmetadata:\n  version: 1.0\n"
    (root / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: question\ndoc_to_choice: choices\ndoc_to_target: label\n"
        "metric_list:\n  - metric: acc\n")
    (root / "tiny_ppl.yaml").write_text(
        f"task: tiny_ppl\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'text.jsonl'}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")
    return root


@pytest.mark.parametrize("name", ["ar", "masked", "block_carry"])
def test_likelihood_tasks_from_local_jsonl_are_batch_invariant(saved, local_tasks, tmp_path, name):
    from dlm.evaluation.lm_eval import run_lm_eval

    got = {}
    for task in ("tiny_mc", "tiny_ppl"):
        for batch in (1, 8):
            r = run_lm_eval(saved[name], task, include_path=[local_tasks], batch_size=batch, mc_num=8, device="cpu",
                            samples=tmp_path / f"{task}{batch}.jsonl")
            got[task, batch] = (r["results"][task], _lines(tmp_path / f"{task}{batch}.jsonl"))
        (res1, s1), (res8, s8) = got[task, 1], got[task, 8]
        assert len(s1) == (5 if task == "tiny_mc" else 4)
        for a, b in zip(s1, s8):
            flat_a = [v for resp in a["generation"] for v in (resp if isinstance(resp, list) else [resp])]
            flat_b = [v for resp in b["generation"] for v in (resp if isinstance(resp, list) else [resp])]
            assert flat_a == pytest.approx(flat_b, rel=1e-5)
        if task == "tiny_mc":
            assert res1["acc,none"] == res8["acc,none"]
            per_request = 1 if name == "ar" else 8 + 1
            assert {s["nfe"] for s in s1} == {3 * per_request}
        else:
            assert res1["word_perplexity,none"] == pytest.approx(res8["word_perplexity,none"], rel=1e-5)
    assert "loglikelihood_rolling" in r["config"]["dlm"]["tasks"]["tiny_ppl"]


def test_simple_evaluate_finds_the_registered_model(saved):
    import lm_eval
    from lm_eval.tasks import TaskManager

    import dlm.evaluation.lm_eval as dlm_lm_eval

    results = lm_eval.simple_evaluate(
        model="dlm", model_args=f"pretrained={saved['masked']},policy=top_u_or_threshold,tau=0.6,u=3,mc_num=4",
        batch_size=4, device="cpu", tasks=["dlm_tinymath"], limit=3, confirm_run_unsafe_code=True,
        apply_chat_template=True, gen_kwargs={"max_gen_toks": 8},
        task_manager=TaskManager(include_path=str(dlm_lm_eval.TASKS_DIR), include_defaults=False,
                                 metadata={"data": str(saved["data"])}))
    config = results["config"]["dlm"]
    assert config["sampling"]["policy"] == "top_u_or_threshold" and config["sampling"]["confidence_threshold"] == 0.6
    assert config["sampling"]["reveal_count"] == 3 and config["mc_num"] == 4 and config["batch_size"] == 4
    assert config["tasks"]["dlm_tinymath"]["generate_until"]["requests"] == 3
    assert "accuracy,none" in results["results"]["dlm_tinymath"]


def test_model_args_and_tasks_are_checked(saved):
    from dlm.evaluation.lm_eval import DlmLM, run_lm_eval

    with pytest.raises(DlmError, match="unknown dlm model arg 'temprature'"):
        DlmLM(saved["ar"], temprature=0.5)
    with pytest.raises(OptionsError, match="masked-sampler option"):
        DlmLM(saved["ar"], tau=0.5)
    with pytest.raises(DlmError, match="batch_size='auto'"):
        DlmLM(saved["ar"], batch_size="auto")
    with pytest.raises(DlmError, match="unknown lm-eval task nonesuch_task_xyz; dlm ships dlm_humaneval"):
        run_lm_eval(saved["ar"], "nonesuch_task_xyz")
    lm = DlmLM(saved["simplex"])
    from lm_eval.api.instance import Instance

    with pytest.raises(DlmError, match="not supported for simplex"):
        lm.loglikelihood([Instance("loglikelihood", {}, ("user: hi", " there"), 0)])


def test_model_args_follow_the_policy_rule(saved, capsys):
    """tau alone selects the threshold policy; tau with policy=top_u is refused before the model loads, as one line
    naming both (`dlm lm-eval` exits 2); the recorded sampling options are those in effect."""
    from dlm.cli import main
    from dlm.evaluation.lm_eval import DlmLM

    lm = DlmLM(saved["masked"], tau=0.5)
    assert (lm.options.policy, lm.options.confidence_threshold) == ("threshold", 0.5)
    assert lm.get_model_info()["dlm"]["sampling"] == {"family": "masked", "policy": "threshold",
                                                      "confidence_threshold": 0.5, "block_size": None}
    with pytest.raises(OptionsError, match=r"^tau \(confidence_threshold\) is not used by policy top_u"):
        DlmLM(saved["masked"], policy="top_u", tau=0.5)
    with pytest.raises(OptionsError, match=r"^u \(reveal_count\) is not used by policy threshold"):
        DlmLM(saved["masked"], sampler="threshold", u=2)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["lm-eval", "--model", "dlm", "--model_args", f"pretrained={saved['masked']},policy=top_u,tau=0.5",
              "--tasks", "dlm_tinymath", "--limit", "1", "--device", "cpu"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "dlm lm-eval: tau (confidence_threshold) is not used by policy top_u" in err
    assert "Traceback" not in err
    DlmLM(saved["masked"], kv_cache=False)
    assert "ignores kv_cache (not read with these settings on a bidirectional model)" in capsys.readouterr().err


def test_cli_eval_and_lm_eval(saved, tmp_path, capsys):
    from dlm.cli import main

    out, samples = tmp_path / "r.json", tmp_path / "s.jsonl"
    main(["eval", str(saved["ar"]), "--task", "lm-eval:dlm_tinymath", "--data", str(saved["data"]), "--n", "3",
          "--max-new-tokens", "6", "--apply-chat-template", "--batch-size", "2", "--samples", str(samples),
          "--out", str(out)])
    summary = json.loads(out.read_text())
    assert summary["task"] == "lm-eval:dlm_tinymath" and "accuracy,none" in summary["results"]["dlm_tinymath"]
    assert summary["config"]["dlm"]["family"] == "autoregressive"
    lines = _lines(samples)
    assert len(lines) == 3 and all(s["nfe"] >= 1 and "accuracy" in s["grade"] for s in lines)
    assert all(s["prompt"].startswith("user: ") for s in lines)
    for wrong in (["--task", "lm-eval:dlm_tinymath", "--pass-k", "1"], ["--metric", "intrinsic", "--samples", "x"]):
        with pytest.raises(SystemExit, match="dlm eval: "):  # said before any model loads
            main(["eval", str(saved["ar"]), *wrong])
    capsys.readouterr()
    main(["lm-eval", "--model", "dlm", "--model_args", f"pretrained={saved['masked']},u=4", "--tasks",
          "dlm_tinymath", "--limit", "2", "--confirm_run_unsafe_code", "--device", "cpu", "--gen_kwargs",
          "max_gen_toks=8", "--metadata", json.dumps({"data": str(saved["data"])}),
          "--output_path", str(tmp_path / "lm")])
    assert "dlm_tinymath" in capsys.readouterr().out
    written = json.loads(next((tmp_path / "lm").rglob("results_*.json")).read_text())
    assert written["config"]["dlm"]["sampling"]["reveal_count"] == 4


def test_dlm_eval_samples_file_for_tinymath_leaves_the_summary_unchanged(saved, tmp_path):
    from dlm.cli import main

    base = ["eval", str(saved["masked"]), "--data", str(saved["data"]), "--n", "4", "--max-new-tokens", "6",
            "--truncate-prompts", "--sweep", "u=1,3"]
    main([*base, "--out", str(tmp_path / "plain.json")])
    main([*base, "--out", str(tmp_path / "with.json"), "--samples", str(tmp_path / "s.jsonl")])
    timing = ("wall_s", "ms_per_problem")
    plain, with_samples = (json.loads((tmp_path / f).read_text()) for f in ("plain.json", "with.json"))
    for table in (plain, with_samples):
        table["rows"] = [{k: v for k, v in r.items() if k not in timing} for r in table["rows"]]
    assert plain == with_samples
    lines = _lines(tmp_path / "s.jsonl")
    assert [s["reveal_count"] for s in lines] == [1] * 4 + [3] * 4  # one line per problem and grid value
    assert [s["prompt"] for s in lines[:4]] == [s["prompt"] for s in lines[4:]]
    assert len(lines) == 8 and all({"prompt", "generation", "nfe", "correct", "answer"} <= s.keys() for s in lines)
    rows = plain["rows"]
    assert [r["mean_nfe"] for r in rows] == [sum(s["nfe"] for s in lines[i * 4:(i + 1) * 4]) / 4 for i in range(2)]


def test_mask_counts_are_stratified_and_weighted_by_one_over_t():
    from dlm.evaluation.elbo import sample_masks

    groups = torch.tensor([0] * 8 + [1] * 3)  # a block of 8 continuation positions, then a block of 3
    masked, weight = sample_masks(groups, 4, torch.Generator().manual_seed(0))
    counts = masked[:, :8].sum(-1).tolist()
    assert sorted((c - counts[0]) % 8 for c in counts) == [0, 2, 4, 6]  # spread evenly over 1..8
    assert torch.equal(weight[:, 0], 8 / masked[:, :8].sum(-1).float())
    assert torch.equal(weight[:, 8], 3 / masked[:, 8:].sum(-1).float())
    draws = torch.stack([sample_masks(groups, 1, torch.Generator().manual_seed(s))[0][0, :8].sum() for s in range(800)])
    assert set(draws.tolist()) == set(range(1, 9)) and abs(draws.float().mean() - 4.5) < 0.25  # l ~ U{1..8}
