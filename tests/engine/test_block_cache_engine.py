"""The engine with the hash-block cache (prefix_cache="block"): greedy outputs equal the radix cache's (and no
cache's) over tree-shaped prompts, through eviction and retraction, at page sizes 1 and 16; hits are whole
blocks; KV accounting is clean at teardown (make_engine checks it)."""

from __future__ import annotations

import pytest

from prefixrt.cache.block import BlockCache
from tests.engine.test_engine import GREEDY, _tree_workload


@pytest.mark.parametrize("page_size", [1, 16])
def test_block_cache_outputs_equal_the_radix_cache(page_size, make_engine, underestimated_decode):
    prompts = _tree_workload(200, seed=page_size)
    params = {"max_new_tokens": 24, **GREEDY}
    radix = make_engine("llama", page_size=page_size, kv_cache_tokens=8192, chunked_prefill_tokens=16)
    want = [c.token_ids for c in radix.generate(prompts, params)]
    block = make_engine("llama", page_size=page_size, prefix_cache="block", kv_cache_tokens=320,
                        chunked_prefill_tokens=16)
    assert isinstance(block.core.kv.cache, BlockCache)
    got = block.generate(prompts, params)
    assert [c.token_ids for c in got] == want
    assert all(c.cached_tokens % 16 == 0 for c in got), "hits are whole blocks of 16 tokens"
    s = block.stats()
    assert s.cached_tokens_total > 0
    assert s.evicted_tokens_total > 0, "the pool was meant to be small enough to evict"
    assert s.retracted_requests_total > 0, "the pool was meant to be small enough to retract"
    # One by one, where each request can reuse the blocks of those before it.
    seq = [block.generate(p, params) for p in prompts[:30]]
    assert [c.token_ids for c in seq] == want[:30]
    assert sum(c.cached_tokens for c in seq) > 0


def test_block_cache_reuses_whole_blocks_only(make_engine):
    eng = make_engine("llama", prefix_cache="block")
    base = list(range(3, 60))
    eng.generate(base, {"max_new_tokens": 1, **GREEDY})
    again = eng.generate(base + [7, 8], {"max_new_tokens": 1, **GREEDY})
    assert again.cached_tokens == 48  # 57 prompt tokens published: three whole blocks
    off = make_engine("llama", radix_cache=False)
    assert again.token_ids == off.generate(base + [7, 8], {"max_new_tokens": 1, **GREEDY}).token_ids
