"""PUMBA's local-overfitting measurement (App. D.1): the pool's insertion hook, the MDM batch swap, the completion
loss and the relative loss, and a tiny end-to-end run of benchmarks/local_overfitting.py."""

import math
from functools import partial
from pathlib import Path

import pytest
import torch

import local_overfitting as lo
from dlm.data.canvas import collate, make_example
from dlm.training.trajectories import TrajectoryPool

from .conftest import tiny_model

ROOT = Path(__file__).resolve().parents[1]

EOS, PAD, MASK = 1, 2, 3


def _example(i: int, prompt: int = 4, response: int = 9):
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(10, 50, (prompt + response,), generator=g).tolist()
    return make_example(ids[:prompt], ids[prompt:], 64)


class _Stream:
    def __init__(self):
        self.drawn = 0

    def take(self, n):
        out = [_example(self.drawn + k) for k in range(n)]
        self.drawn += n
        return out


def _pool(K: int, size: int = 4, length: int = 24, seed: int = 0):
    stream = _Stream()
    coll = partial(collate, eos_id=EOS, pad_id=PAD)
    pool = TrajectoryPool(size, length, stream.take, coll, MASK, lo.exact_stages(K),
                          torch.Generator().manual_seed(seed))
    return pool, stream


def _update(pool, g):
    """One update of every row (W=1): a step with random confidences, then the retired rows are refilled."""
    rows = torch.arange(pool.size)
    pool.advance(rows, torch.rand(pool.size, pool.length, generator=g))
    pool.refill(rows[pool.done[rows]])


def test_inserted_example_enters_at_stage_zero_and_stays_exactly_J_updates():  # noqa: N802 (J: the paper's)
    K = 6  # 20 maskable positions (24 - 4 prompt): about u = 3 per step
    pool, stream = _pool(K)
    plain, _ = _pool(K)
    g, g_plain = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for _ in range(3):  # the hook unused: nothing changes
        _update(pool, g), _update(plain, g_plain)
    for key, value in plain.state_dict().items():
        other = pool.state_dict()[key]
        assert (other is None) if value is None else torch.equal(torch.as_tensor(value), torch.as_tensor(other)), key
    guest = _example(999, response=11)
    pool.insert([guest], [7])
    entered, stay = None, 0
    for _ in range(3 * K):
        was_in = bool((pool.origin == 7).any())
        drawn, started = stream.drawn, pool.samples_started
        _update(pool, g)
        row = (pool.origin == 7).nonzero().flatten()
        if was_in:
            stay += 1
        if entered is None and len(row):
            entered = int(row[0])
            assert pool.stage[entered] == 0 and pool.steps[entered] == 0  # a fresh trajectory, stage 0
            assert pool.revealed[entered].sum() < 20 / K  # r ~ U[0, 1/K) revealed at the start
            expected = collate([guest], EOS, PAD, pad_to=24)["input_ids"][0]
            assert torch.equal(pool.target[entered], expected)
            assert stream.drawn - drawn == pool.samples_started - started - 1  # it took a stream sample's place
        if entered is not None and not len(row):
            break
    assert entered is not None and stay == K  # exactly J = K updates in the pool
    assert (pool.origin == -1).all() and pool.queue == []
    with pytest.raises(ValueError, match="one tag >= 0 per example"):
        pool.insert([guest], [-1])


def test_exact_stages_advance_one_stage_per_step_even_where_rounding_would_skip():
    """L/K = 2 (the paper's u = 2): every trajectory lasts exactly K steps and reveals L-1 positions."""
    K, L, n = 10, 20, 200
    c, g = lo.exact_stages(K), torch.Generator().manual_seed(0)
    maskable = torch.ones(n, L, dtype=torch.bool)
    revealed, stage = c.start(maskable, g)
    done, steps = torch.zeros(n, dtype=torch.bool), torch.zeros(n, dtype=torch.long)
    for _ in range(K + 2):
        masked = maskable & ~revealed
        reveal, retire, new_stage = c.step(torch.rand(n, L, generator=g), masked, maskable, revealed, stage, maskable,
                                           g)
        active = ~done
        revealed |= reveal & masked & active[:, None]
        assert torch.equal(c.stage_of(revealed, maskable)[active], new_stage[active])  # the count is in its stage
        stage = torch.where(active, new_stage, stage)
        steps += active.long()
        done |= retire & active
    assert (steps == K).all() and (revealed.sum(-1) == L - 1).all()


def test_swap_rows_touches_one_row_of_the_batch():
    coll = partial(collate, eos_id=EOS, pad_id=PAD)
    batch = coll([_example(i) for i in range(4)])
    batch["example_id"] = torch.arange(10, 14)
    for guest in (_example(50, response=5), _example(51, response=20)):  # narrower, and wider than the batch
        out = lo.swap_rows(batch, [guest], coll, PAD)
        width = out["input_ids"].shape[1]
        own = coll([guest], pad_to=width)
        for key in ("input_ids", "attention_mask", "maskable", "loss_mask"):
            assert torch.equal(out[key][0], own[key][0]), key
            w = batch[key].shape[1]
            assert torch.equal(out[key][1:, :w], batch[key][1:]), key  # the other rows unchanged ...
            assert torch.equal(out[key][1:, w:], coll([_example(i) for i in range(1, 4)], pad_to=width)[key][:, w:])
        assert torch.equal(out["example_id"], batch["example_id"])  # ... and their masks' keys too
    stream = lo._SwapStream(type("S", (), {"next_batches": lambda self, c: [dict(batch), dict(batch)]})(), coll, PAD)
    stream.pending = [_example(50)]
    first = stream.next_batches(2)
    assert not torch.equal(first[0]["input_ids"][0], batch["input_ids"][0])
    assert torch.equal(first[1]["input_ids"], batch["input_ids"])  # one batch only
    assert torch.equal(stream.next_batches(2)[0]["input_ids"], batch["input_ids"])  # one update only


def test_completion_loss_reveals_prompt_and_half_the_answer_and_scores_the_rest_through_eos(one_thread):
    model = tiny_model(64, attention="bidirectional", family="masked", seed=3)
    coll = partial(collate, eos_id=EOS, pad_id=PAD)
    examples = [_example(i, prompt=3 + i, response=5 + 2 * i) for i in range(4)]
    cb = lo.completion_batch(examples, coll, MASK, 24)
    got = lo.completion_losses(model, cb, chunk=3)
    for i, e in enumerate(examples):  # slow reference: one canvas at a time, built by hand
        p, r = len(e.prompt_ids), len(e.response_ids)
        full = e.prompt_ids + e.response_ids + [EOS] + [PAD] * (24 - p - r - 1)
        keep = p + r // 2
        canvas = torch.tensor([full[:keep] + [MASK] * (24 - keep)])
        assert torch.equal(cb["input_ids"][i], canvas[0])
        scored = list(range(keep, p + r + 1))  # the rest of the answer and its EOS, no padding
        assert cb["in_loss"][i].nonzero().flatten().tolist() == scored
        with torch.no_grad():
            logp = torch.log_softmax(model(canvas).float()[0], -1)
        want = -sum(float(logp[j, full[j]]) for j in scored) / len(scored)
        assert math.isclose(float(got[i]), want, rel_tol=1e-5)


def test_relative_loss_removes_the_drift_shared_with_validation():
    n, e = 60, 30
    val = [2.0 + 0.01 * s for s in range(n)]  # drift shared by all sequences
    seq = [3.0 * v if s < e else 1.5 * v for s, v in enumerate(val)]  # halved from the first update that trains it
    rel = lo.relative_loss(seq, val, e)
    assert all(math.isclose(x, 1.0) for x in rel[:e])
    assert all(math.isclose(x, 0.5) for x in rel[e:])
    # a hand computation at one point, with a sequence that is not proportional to validation
    seq2 = [1.0 + (s % 3) for s in range(n)]
    rel2 = lo.relative_loss(seq2, val, e)
    base_seq, base_val = sum(seq2[10:30]) / 20, sum(val[10:30]) / 20
    assert math.isclose(rel2[45], (seq2[45] / base_seq) / (val[45] / base_val))
    with pytest.raises(ValueError, match="fewer than 20 updates"):
        lo.relative_loss(seq, val, 19)


def test_tiny_run_of_the_benchmark_core(tmp_path, one_thread):
    from dlm.config import load_recipe
    from dlm.training import loop

    data = tmp_path / "data"
    common = [f"data.dir={data}", "data.level=easy", "data.n_train=48", "data.n_validation=24", "data.n_test=4"]
    warm = loop.train(load_recipe(ROOT / "recipes/tinymath/mdm.yaml", [
        *common, "model.init_from=null", "model.preset=nano", "model.vocab_size=300", "model.max_length=128",
        "train.batch_size=4", "train.steps=1", "train.eval_every=null", "eval.n=1",
        "eval.test_n=1", "eval.max_new_tokens=16", f"out_dir={tmp_path / 'warm'}"]), progress=False)
    kw = dict(start=str(warm), data=str(data), batch_size=4, insert_at=[21], val_every=5, val_n=8, seed=0, lr=1e-2,
              warmup=1, canvas=128, recipe_overrides=common)
    pu = lo.run_arm("pu-u2", updates=56, workdir=str(tmp_path / "pu"), **kw)
    mdm = lo.run_arm("mdm", updates=22, workdir=str(tmp_path / "mdm"), **kw)
    K = pu["K"]
    assert K == max(2, round(pu["maskable_mean"] / 2)) and pu["J"] == K and mdm["J"] == 1
    for run, n in ((pu, 56), (mdm, 22)):
        assert len(run["completion_loss"]) == 16 and all(len(c) == n + 1 for c in run["completion_loss"])
        assert run["validation"]["updates"] == [*range(0, n, 5), n] and len(run["train_loss"]) == n
        assert sorted(run["inserted"]) == ["0", "1", "2", "3"]
    assert mdm["distinct_sequences"] == 88 and all(v["entered"] == v["last_update"] == 21
                                                   for v in mdm["inserted"].values())
    first = pu["inserted"]["0"]
    e, last = first["entered"], first["last_update"]
    assert e >= 22 and last - e + 1 == K  # enters at the next refill, stays exactly J = K updates
    # While in the pool its completion loss falls (tiny model, high lr): at its lowest it is well below its value
    # before entering, while the never-inserted sequences' losses drift up over the same span.
    seq = pu["completion_loss"][0]
    low = min(range(e, last + 1), key=lambda s: seq[s])
    others = [pu["completion_loss"][j][low] / pu["completion_loss"][j][e - 1] for j in range(12, 16)]
    assert seq[low] / seq[e - 1] < 0.9 and seq[low] / seq[e - 1] < min(others) - 0.15, (seq[e - 1], seq[low], others)
    row = lo.summarize(pu, later=0, tail=10)
    assert row["n_inserted"] == 1 and row["minimum"] < 0.85 and row["distinct"] == pu["distinct_sequences"]


def test_study_driver_runs_resumes_pairs_by_sequence_and_reports(tmp_path, one_thread):
    """benchmarks/local_overfitting_study.py end to end on a nano model: cells hold each held-out sequence's tail
    completion loss (their mean is the run's Table-9 validation loss), a rerun adds nothing, seeds differ, the report
    pairs arms by sequence, and a bad plan is one line naming its field."""
    import yaml

    import local_overfitting_study as los
    import mask_discrepancy_study as mds
    from dlm.config import load_recipe
    from dlm.training import loop
    from studies.plans import Plan, StudyError
    from studies.tables import StudyTable

    data = tmp_path / "data"
    common = [f"data.dir={data}", "data.level=easy", "data.n_train=48", "data.n_validation=24", "data.n_test=4"]
    warm = loop.train(load_recipe(ROOT / "recipes/tinymath/mdm.yaml", [
        *common, "model.init_from=null", "model.preset=nano", "model.vocab_size=300", "model.max_length=128",
        "train.batch_size=4", "train.steps=1", "train.eval_every=null", "eval.n=1",
        "eval.test_n=1", "eval.max_new_tokens=16", f"out_dir={tmp_path / 'warm'}"]), progress=False)
    settings = {"start": str(warm), "data": str(data), "updates": 24, "batch_size": 4, "insert_at": [21, 22, 23],
                "val_every": 5, "val_n": 8, "tail": 10, "later": 0, "lr": 1e-2, "warmup": 1, "canvas": 128,
                "overrides": common,
                "comparisons": [{"a": "mdm", "b": "pu-u8", "eval": "val", "expect": "lower", "claim": "c"}]}
    plan_path = tmp_path / "plan.yaml"
    plan_path.write_text(yaml.safe_dump({"name": "tiny-overfit", "arms": ["mdm", "pu-u8"], "seeds": [0, 1],
                                         "evals": ["val"], "settings": settings}))
    table_path = tmp_path / "table.json"
    runs = tmp_path / "runs"
    assert los.run(plan_path, table_path, runs, max_minutes=0) == 0  # no run fits in no time
    assert los.run(plan_path, table_path, runs) == 4
    assert los.run(plan_path, table_path, runs) == 0  # complete: nothing trains again
    plan = Plan.load(plan_path)
    table = StudyTable(table_path, plan)
    for arm in ("mdm", "pu-u8"):
        cells = [table.cell(arm, s, "val") for s in (0, 1)]
        for c in cells:
            assert c["n"] == 8 and len(c["values"]) == 8
            assert sum(c["values"]) / 8 == pytest.approx(c["summary"]["validation"], abs=2e-4)
            assert len(c["run"]["completion_loss"]) == 16 and len(c["run"]["completion_loss"][0]) == 25
        assert cells[0]["values"] != cells[1]["values"]  # the seed changes the run
    assert table.pins["warm_start"]
    r = mds.compare(table, settings["comparisons"][0])
    mdm = [table.cell("mdm", s, "val")["values"] for s in (0, 1)]
    pu = [table.cell("pu-u8", s, "val")["values"] for s in (0, 1)]
    expected = sum(sum(a) - sum(b) for a, b in zip(mdm, pu)) / 16
    assert r["n"] == 8 and r["n_seeds"] == 2 and r["per_ratio"] == {}
    assert r["difference"] == pytest.approx(expected, abs=1e-6)
    doc, plot = tmp_path / "doc.md", tmp_path / "doc.png"
    los.main(["report", "--plan", str(plan_path), "--json", str(table_path), "--doc", str(doc)])
    text = doc.read_text()
    assert "| mdm | 1 |" in text and "| pu-u8 |" in text and "mdm lower than pu-u8 at val" in text
    assert "2 seeds" in text and "Missing cells: none" in text and plot.is_file()
    bad = yaml.safe_load(plan_path.read_text())
    bad["settings"]["insert_at"] = [10, 22, 23]
    plan_path.write_text(yaml.safe_dump(bad))
    with pytest.raises(StudyError, match="settings.insert_at"):
        los.run(plan_path, table_path, runs)


def test_report_keeps_a_hand_written_status_box_and_is_idempotent(tmp_path):
    import shutil

    src = ROOT / "docs/results/pumba-local-overfitting.json"
    js, md, png = tmp_path / "r.json", tmp_path / "r.md", tmp_path / "r.png"
    shutil.copy(src, js)
    first = lo.report(js, md, png)
    assert "> **Status" not in first
    title, rest = first.split("\n", 1)
    md.write_text(f"{title}\n\n> **Status:** one seed.\n> More.\n{rest}")
    again = lo.report(js, md, png)
    assert again.startswith(f"{title}\n\n> **Status:** one seed.\n> More.\n\nGenerated by")
    assert lo.report(js, md, png) == again and again.replace("\n> **Status:** one seed.\n> More.\n", "") == first
