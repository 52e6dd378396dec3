"""Saved study starts (benchmarks/studies/starts.py): a run saved into the store comes back at its path with the same
weights and regenerated data, a second restore changes nothing, and a mismatch is one clear error."""

import json
import shutil
from pathlib import Path

import pytest

from dlm.errors import DlmError
from studies.plans import fingerprint

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from dlm.config import load_recipe
    from dlm.training import loop

    root = tmp_path_factory.mktemp("starts")
    run = root / "runs" / "tiny-ar"
    loop.train(load_recipe(ROOT / "recipes" / "tinymath" / "ar.yaml", [
        "data.level=easy", "data.n_train=48", "data.n_validation=4", "data.n_test=6", "model.preset=tiny",
        "model.vocab_size=300", "model.max_length=160", "train.batch_size=4", "train.steps=2",
        "train.eval_every=null", "eval.test_n=1", "eval.n=1", f"data.dir={run / 'data'}", f"out_dir={run}"]),
        progress=False)
    return root, run


def test_save_then_restore_brings_back_the_same_weights_and_data(trained):
    from studies import starts

    root, run = trained
    store = root / "store"
    entry = starts.save(Path("runs") / "tiny-ar", store=store, root=root)
    assert entry["fingerprint"] == fingerprint(run / "model")
    assert set(entry["data"]) == {"dir", "train.jsonl", "validation.jsonl", "test.jsonl", "test_unseen.jsonl"}
    assert entry["data"]["dir"] == "runs/tiny-ar/data"  # relative to the repository, though the recipe's is absolute
    assert not (store / "tiny-ar" / "data").exists()  # data are regenerated, not stored
    want = {f: (run / "data" / f).read_bytes() for f in ("test.jsonl", "test_unseen.jsonl")}
    shutil.rmtree(run)
    assert starts.restore(store=store, root=root) == ["tiny-ar"]
    assert fingerprint(run / "model") == entry["fingerprint"]
    assert all((run / "data" / f).read_bytes() == b for f, b in want.items())
    assert (run / "metrics.jsonl").is_file() and (run / "recipe.yaml").is_file()
    assert starts.restore(store=store, root=root) == []  # already in place: nothing copied

    manifest = json.loads((store / "starts.json").read_text())
    manifest["tiny-ar"]["data"]["test.jsonl"] = "0" * 16  # data that no longer regenerate alike
    (store / "starts.json").write_text(json.dumps(manifest))
    with pytest.raises(DlmError, match="regenerated data differ"):
        starts.restore(store=store, root=root)
    manifest["tiny-ar"]["fingerprint"] = "f" * 16  # another model sits at the path
    (store / "starts.json").write_text(json.dumps(manifest))
    with pytest.raises(DlmError, match="holds another model"):
        starts.restore(store=store, root=root)
    with pytest.raises(DlmError, match="no saved start"):
        starts.restore(store=store, root=root, names=["nope"])
    with pytest.raises(DlmError, match="not a finished run"):
        starts.save(root / "runs" / "missing", store=store, root=root)


def test_committed_starts_match_their_manifest():
    """Every start whose weights are on this machine under benchmarks/starts/ has the weights its manifest (and the
    tables) name."""
    from studies import starts

    manifest = starts.manifest(starts.STORE)
    assert manifest, "benchmarks/starts/starts.json lists no start"
    present = [n for n in manifest if (starts.STORE / n / "model" / "model.safetensors").is_file()]
    if not present:  # weights are not in git: only a machine that built or copied them has them
        pytest.skip("no start's weights on this machine (benchmarks/starts/*/model is not tracked)")
    for name in present:
        assert fingerprint(starts.STORE / name / "model") == manifest[name]["fingerprint"], name
