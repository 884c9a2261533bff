"""The benchmarks page is the code's reference for its figures: every citation of
docs/benchmarks.md names a section the page has (and of notes/benchmarks-notebook.md, a
heading the notebook has), and every table on the page says the day it was measured."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "benchmarks.md"
NOTEBOOK = ROOT / "notes" / "benchmarks-notebook.md"
CITING = ["qrl", "benchmarks", "tests", "lint", "examples", ".ci"]
SUFFIXES = {".py", ".sh", ".toml", ""}

# a citation, joined across the lines of a comment or a string: the document, then the
# section's name in double or single quotes (the page's, or the notebook's heading it begins)
CITATION = re.compile(
    r"(docs/benchmarks\.md|notes/benchmarks-notebook\.md),? \(?(?:\"([^\"]+)\"|'([^']+)')"
)


def headings(path: Path) -> list[str]:
    return [
        line.lstrip("#").strip().replace("`", "")
        for line in path.read_text().splitlines()
        if line.startswith("#")
    ]


def joined(text: str) -> str:
    """The text as one line: comment markers and indents between lines dropped, adjacent
    string literals ("a " "b") and escaped quotes undone."""
    text = re.sub(r"\n\s*(?:#\s*)?", " ", text)
    return text.replace('" "', "").replace("' '", "").replace('\\"', '"')


def citations() -> list[tuple[str, str, str]]:
    """(file, document, section) of every citation that names a section."""
    found = []
    paths = [ROOT / "docs" / "ARCHITECTURE.md"]
    for folder in CITING:
        paths += [p for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix in SUFFIXES]
    for path in paths:
        for m in CITATION.finditer(joined(path.read_text(errors="replace"))):
            found.append((str(path.relative_to(ROOT)), m[1], (m[2] or m[3]).strip()))
    return found


def test_every_citation_names_a_section_the_document_has():
    page, notebook = headings(PAGE), headings(NOTEBOOK)
    cited = citations()
    wrong = [
        (where, doc, section)
        for where, doc, section in cited
        if (
            section not in page
            if doc.startswith("docs/")
            else not any(h.startswith(section) for h in notebook)
        )
    ]
    assert cited, "no citation of the benchmarks page found: the pattern broke"
    assert not wrong, f"citations of sections that do not exist: {wrong}"


def test_every_table_on_the_page_says_when_it_was_measured():
    """A table's figures are current, not timeless: one "measured on: YYYY-MM-DD" line
    follows it, before the next table."""
    lines = PAGE.read_text().splitlines()
    starts = [
        i
        for i, line in enumerate(lines)
        if line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|"))
    ]
    undated = []
    for k, start in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(lines)
        dates = [x for x in lines[start:end] if re.match(r"measured on: \d{4}-\d{2}-\d{2}", x)]
        if len(dates) != 1:
            undated.append(lines[start])
    assert starts
    assert not undated, f"tables without exactly one 'measured on' line: {undated}"
