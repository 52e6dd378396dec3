"""The README and the guides show no path of the machine they were written on (a home, a checkout, a temp dir):
sample outputs and commands use paths relative to the repository. Deliberate placeholders for things a reader
supplies (`/models/LLaDA-8B-Instruct`, `/data/sft/train.jsonl`, `~/models/...`) are allowed."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# An absolute path under a machine's own places: homes (/home, /Users, /root), this checkout's /work, temp dirs
# (/tmp, /var/folders, /private/var), or a Windows user folder. Not inside a URL or after ~ or a word.
MACHINE_PATH = re.compile(r"(?<![\w.:/~-])(?:/(?:work|home|Users|root|tmp|var/folders|private/var)/"
                          r"|[A-Z]:\\Users\\)\S*")


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]


def test_the_pattern_finds_machine_paths_and_leaves_placeholders():
    found = ["/work/main/models/llada-8b-instruct", "/home/alice/dlm/runs/ar", "/tmp/tmpph7xxbzu/before-0.json",
             "/Users/bob/runs", "(/root/.cache/x)", "`/var/folders/x/y`", r"C:\Users\eve\dlm"]
    allowed = ["/models/LLaDA-8B-Instruct", "/data/sft/train.jsonl", "~/models/llada-8b-instruct-hf",
               "http://127.0.0.1:8000/v1", "runs/tmp/x", "recipes/work/x.yaml", "https://github.com/home/x"]
    assert all(MACHINE_PATH.search(text) for text in found)
    assert not any(MACHINE_PATH.search(text) for text in allowed)


@pytest.mark.parametrize("doc", docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_show_no_machine_paths(doc):
    hits = [f"{doc.relative_to(ROOT)}:{n}: {m.group(0)}"
            for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), start=1)
            for m in MACHINE_PATH.finditer(line)]
    assert not hits, "paths of the author's machine (use paths relative to the repository):\n" + "\n".join(hits)
