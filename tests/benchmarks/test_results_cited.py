"""benchmarks/results/ keeps a result file only where a doc (docs/*.md, README.md) cites it: by name, by a glob
(`h200-serve-intake-*.json`) or by a brace list (`h200-server-cold-11{a,c,d}.json`). A run nobody quotes is not
kept. (tests/test_docs_paths.py checks the other direction: what the docs cite exists.)
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
CITATION = re.compile(r"[A-Za-z0-9_.{},*-]+\.(?:json|txt)")


def expand(pattern: str) -> list[str]:
    """A citation's brace lists expanded: x-{a,b}.json -> [x-a.json, x-b.json]."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [p for alt in m.group(1).split(",") for p in expand(pattern[: m.start()] + alt + pattern[m.end():])]


def cited_patterns() -> list[str]:
    docs = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
    return [p for doc in docs for token in CITATION.findall(doc.read_text()) for p in expand(token)]


def test_expand_and_match():
    assert expand("h200-server-cold-11{a,c,d}.json") == ["h200-server-cold-11a.json", "h200-server-cold-11c.json",
                                                         "h200-server-cold-11d.json"]
    assert fnmatch.fnmatch("h200-serve-intake-http-1.json", "h200-serve-intake-*.json")


def test_every_result_file_is_cited_by_a_doc():
    patterns = cited_patterns()
    files = sorted(p.name for p in RESULTS.iterdir() if p.name != "README.md")
    assert files, "no result files"
    uncited = [f for f in files if not any(fnmatch.fnmatch(f, p) for p in patterns)]
    assert not uncited, f"cite these in a doc or remove them: {uncited}"
