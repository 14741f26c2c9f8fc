"""The documents stay true to each other: every citation of a document's heading points to a
heading that exists, and every relative Markdown link to a file (and anchor) that exists.

Citations are written as a path from the repository root with a GitHub anchor, e.g.
`bench/results/lanes.md#media-lanes`. The older form, a path followed by a comma and a quoted
heading, is checked too: some heading of the file must start with the quoted text."""

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIPPED_DIRS = {".git", ".venv", ".gpu", "node_modules", "__pycache__", "out"}
CITING_SUFFIXES = {".py", ".md", ".sh", ".toml"}

CITATION = re.compile(r"(?<![\w/.-])(bench/RESULTS\.md|bench/results/[\w.-]+\.md|docs/[\w.-]+\.md)"
                      r"(?:#([\w-]+))?(?:`?,\s*\"([^\"]+)\")?")
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`(?:[^`\n]|\n(?![ \t]*\n))+?`")
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _files(suffixes: set[str]) -> list[Path]:
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and (not d.startswith(".") or d == ".ci")]
        found.extend(Path(folder) / name for name in files if Path(name).suffix in suffixes)
    return sorted(found)


def _headings(path: Path) -> list[str]:
    """The text of every heading of a Markdown file, outside code blocks."""
    text = FENCE.sub("", path.read_text())
    return [m.group(2).strip().rstrip("#").strip() for m in re.finditer(r"^(#{1,6})[ \t]+(.+)$", text, re.MULTILINE)]


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: its text lower-cased, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for heading in _headings(path):
        anchor = github_anchor(heading)
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        result.add(anchor if count == 0 else f"{anchor}-{count}")
    return result


def test_anchors_are_githubs():
    assert github_anchor("The lone request's hand-offs") == "the-lone-requests-hand-offs"
    assert github_anchor("Engines: our `CTranslate2` engine (run `1Z`)") == "engines-our-ctranslate2-engine-run-1z"


def _citations() -> list[tuple[str, str, str | None, str | None]]:
    found = []
    for path in _files(CITING_SUFFIXES):
        # Comments and docstrings wrap: join a line to the next, dropping comment markers.
        text = re.sub(r"[ \t]*\n[ \t]*(?:#+[ \t]+)?", " ", path.read_text())
        for match in CITATION.finditer(text):
            found.append((str(path.relative_to(ROOT)), match.group(1), match.group(2), match.group(3)))
    return found


CITATIONS = _citations()


def test_the_documents_are_cited():
    assert any(target.startswith("bench/results/") and anchor for _, target, anchor, _ in CITATIONS)


@pytest.mark.parametrize("source, target, anchor, quoted", CITATIONS,
                         ids=[f"{s}->{t}#{a or q or ''}" for s, t, a, q in CITATIONS])
def test_a_citation_names_an_existing_heading(source, target, anchor, quoted):
    path = ROOT / target
    assert path.is_file(), f"{source} cites {target}, which does not exist"
    if anchor:
        assert anchor in anchors(path), f"{source} cites {target}#{anchor}: no such heading"
    elif quoted:
        assert any(heading.replace("`", "").startswith(quoted) for heading in _headings(path)), (
            f"{source} cites {target}, \"{quoted}\": no heading starts so")


def _documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "bench").glob("*.md")),
            *sorted((ROOT / "bench" / "results").glob("*.md"))]


def _links(path: Path) -> list[str]:
    text = INLINE_CODE.sub("", FENCE.sub("", path.read_text()))
    return [m.group(1) for m in LINK.finditer(text)]


LINKS = [(path, link) for path in _documents() for link in _links(path)
         if not re.match(r"[a-z][a-z0-9+.-]*:", link)]


def test_the_documents_link_to_each_other():
    assert len(LINKS) > 50


@pytest.mark.parametrize("path, link", LINKS, ids=[f"{p.relative_to(ROOT)}:{link}" for p, link in LINKS])
def test_a_relative_link_resolves(path, link):
    target, _, anchor = link.partition("#")
    resolved = (path.parent / target).resolve() if target else path
    assert resolved.exists(), f"{path.relative_to(ROOT)} links to {link}: no such file"
    if anchor and resolved.suffix == ".md":
        assert anchor in anchors(resolved), f"{path.relative_to(ROOT)} links to {link}: no such heading"
