"""The markdown writer of the results docs: a study's generated numbers go between a doc's study markers, and the
hand-written reading around them stays as written."""

from __future__ import annotations

from pathlib import Path

from dlm.errors import DlmError

STUDY_BEGIN, STUDY_END = "<!-- study:begin -->", "<!-- study:end -->"


def study_markers(name: str | None = None) -> tuple[str, str]:
    """The begin/end comments around a doc's generated numbers; a doc with several generated blocks names them
    (`<!-- study:begin steps -->` … `<!-- study:end steps -->`)."""
    return (f"<!-- study:begin {name} -->", f"<!-- study:end {name} -->") if name else (STUDY_BEGIN, STUDY_END)


def write_study_section(doc: str | Path, lines: list[str], title: str | None = None, name: str | None = None) -> None:
    """Write `lines` between the doc's `<!-- study:begin -->` and `<!-- study:end -->` markers (those of block `name`,
    see `study_markers`), keeping everything outside them (the hand-written reading) as written. A doc without the
    markers is a one-line error naming it, unless `title` is given: then the section is appended under
    "## Numbers (3-seed study)", and a missing doc is created as "# title"."""
    begin, end = study_markers(name)
    doc = Path(doc)
    text = doc.read_text() if doc.is_file() else ""
    section = begin + "\n" + "\n".join(lines).strip("\n") + "\n" + end
    if begin in text and end in text and text.index(begin) < text.index(end):
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
    elif title is None:
        raise DlmError(f"{doc}: no '{begin}' ... '{end}' markers; add them where the numbers go")
    elif text:
        text = text.rstrip("\n") + "\n\n## Numbers (3-seed study)\n\n" + section + "\n"
    else:
        doc.parent.mkdir(parents=True, exist_ok=True)
        text = f"# {title}\n\n## Numbers\n\n{section}\n"
    doc.write_text(text)
