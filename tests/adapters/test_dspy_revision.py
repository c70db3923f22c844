"""`prefixrt.LM(base_url=...)`: the DSPy model string carries the served weights' revision (from /v1/models),
so DSPy's response cache tells weights apart."""

from __future__ import annotations

import pytest

dspy = pytest.importorskip("dspy")

import prefixrt  # noqa: E402


def test_remote_lm_model_includes_the_revision(tiny_server):
    lm = prefixrt.LM(base_url=tiny_server)
    rev = prefixrt.RemoteEngine(tiny_server).model_revision
    assert rev and lm.model.endswith(rev) and "@" in lm.model
