"""The mutation list (tests/mutations.py, docs/mutations.md) stays runnable: every mutation's search text occurs
exactly once in its file (a change to that code must bring its mutation along), its tests exist, and the doc
lists each mutation with those tests."""

from __future__ import annotations

import pytest

from tests.mutations import MUTATIONS, REPO, apply

DOC = (REPO / "docs" / "mutations.md").read_text()


@pytest.mark.parametrize("m", MUTATIONS, ids=lambda m: m.name)
def test_the_mutation_applies_and_names_existing_tests(m, tmp_path):
    (tmp_path / m.path).parent.mkdir(parents=True)
    (tmp_path / m.path).write_text((REPO / m.path).read_text())
    apply(m, tmp_path)
    assert (tmp_path / m.path).read_text() != (REPO / m.path).read_text()
    for test in m.tests:
        path, _, name = test.partition("::")
        assert (REPO / path).is_file(), test
        assert not name or f"def {name}(" in (REPO / path).read_text(), test


@pytest.mark.parametrize("m", MUTATIONS, ids=lambda m: m.name)
def test_the_doc_lists_the_mutation_with_its_tests(m):
    row = next((line for line in DOC.splitlines() if f"`{m.name}`" in line), None)
    assert row is not None, m.name
    for test in m.tests:
        assert test in row, (m.name, test)


def test_names_are_unique():
    assert len({m.name for m in MUTATIONS}) == len(MUTATIONS) == 18
