"""Relative links in README.md, SECURITY.md and docs/*.md point at files that exist, and their
#anchors at headings that exist, slugged the way GitHub renders them. No network: links with a
scheme (https:, mailto:) are not followed."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "SECURITY.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# [text](target) and ![alt](target); the text may hold one level of brackets ([`x`][y] is not used).
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _prose(text: str):
    """(line number, line) outside fenced code blocks, inline code removed."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            yield n, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lowercased, punctuation other than '-'
    and '_' dropped, each space a '-' (runs are not collapsed)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link shows its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "").strip().lower()
    keep = (c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return "".join("-" if c == " " else c for c in keep)


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, line in _prose(path.read_text()):
        out.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", line))
        m = HEADING.match(line)
        if m:
            s = slug(m.group(2))
            k = seen.get(s, 0)
            out.add(s if k == 0 else f"{s}-{k}")  # GitHub numbers repeated headings
            seen[s] = k + 1
    return out


def links(path: Path):
    for n, line in _prose(path.read_text()):
        for m in LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            target = m.group(1)
            if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):
                yield n, target


def test_slug_matches_github():
    assert slug("Direct I/O") == "direct-io"
    assert slug("Nothing copied in the call: `stage_in_background=True`") == (
        "nothing-copied-in-the-call-stage_in_backgroundtrue")
    assert slug("On this 2-core machine (CPU training)") == "on-this-2-core-machine-cpu-training"
    assert slug("`tg.DalyInterval`: keep a run at the optimum") == "tgdalyinterval-keep-a-run-at-the-optimum"
    assert slug("Scaling down and back up (`--nnodes MIN:MAX`)") == "scaling-down-and-back-up---nnodes-minmax"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(doc):
    problems = []
    for n, target in links(doc):
        file, _, frag = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        where = f"{doc.relative_to(ROOT)}:{n}: {target}"
        if not dest.exists():
            problems.append(f"{where}: no such file")
        elif frag and dest.suffix == ".md" and frag not in anchors(dest):
            problems.append(f"{where}: no heading with the anchor #{frag} in {dest.name}")
    assert not problems, "\n".join(problems)


def test_the_checker_sees_the_links():
    found = {t for d in DOCS for _, t in links(d)}
    assert "docs/benchmarks.md#the-async-runs" in found and "checkpoints.md#direct-io" in found
    assert "data.md#randomness-in-the-data-pipeline" in found
    assert "#benchmarks" in found and "../SECURITY.md" in found
