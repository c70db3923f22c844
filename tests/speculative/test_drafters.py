"""The drafters: the n-gram index agrees with its reference scan, the radix tree's cached continuation, the
fixed-rate test drafter's rate, and spec parsing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixrt.cache.allocator import PageAllocator
from prefixrt.cache.radix import RadixCache
from prefixrt.params import SamplingParams
from prefixrt.request import Req
from prefixrt.speculative.fixed_rate import FixedRateDrafter
from prefixrt.speculative.ngram import NgramDrafter, NgramIndex, ngram_lookup_reference
from prefixrt.speculative.spec import make_drafter, parse_spec


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 4), min_size=0, max_size=60), st.lists(st.integers(1, 12), min_size=1, max_size=8),
       st.integers(1, 6))
def test_ngram_index_equals_reference_as_the_sequence_grows(ids, cuts, k):
    """Looked up at growing lengths (as a request decodes), the incremental index answers what the scan does."""
    idx = NgramIndex()
    n = 0
    for c in cuts + [len(ids)]:
        n = min(len(ids), n + c)
        assert idx.lookup(ids[:n], k) == ngram_lookup_reference(ids[:n], k), (ids[:n], k)


def test_ngram_reference_prefers_longest_and_latest():
    ids = [7, 1, 2, 9, 1, 2, 3, 4, 5, 1, 2, 3]
    # suffix (1, 2, 3) matched at the earlier "1 2 3", followed by 4 5
    assert ngram_lookup_reference(ids, 3) == [4, 5, 1]
    # a bigram only: (5, 9) never seen -> nothing; (x, 2) latest occurrence wins
    assert ngram_lookup_reference([1, 2, 8, 1, 2, 6, 1, 2], 1, sizes=(2,)) == [6]
    assert ngram_lookup_reference([1, 2, 3], 2) == []


def _tree(ps: int = 1):
    alloc = PageAllocator(256, ps)
    return RadixCache(alloc), alloc


@pytest.mark.parametrize("ps", [1, 4])
def test_radix_continuation(ps):
    cache, alloc = _tree(ps)
    a = list(range(10, 42))  # 32 tokens
    b = a[:16] + [99] * 16
    for seq in (a, b):
        cache.insert(seq, list(range(len(seq))))
    # b was inserted last, but only a was read since: the most recently used branch is followed
    cache.match_prefix(a)
    assert cache.continuation(a[:10], None, 4) == a[10:14]
    assert cache.continuation(a[:16], None, 20) == a[16:32]
    assert cache.continuation(b[:17], None, 3) == b[17:20]  # inside b's branch
    assert cache.continuation(a[:10] + [5], None, 3) == []  # diverges: the tree does not hold it
    assert cache.continuation(a, None, 3) == []  # nothing after it
    assert cache.continuation(a[:3], "other-salt", 3) == []
    # From a locked node (a running request's cache_handle and cached_len): the same answer
    m = cache.match_prefix(a, max_len=8)
    h = cache.lock(m)
    assert cache.continuation(a[:13], None, 4, h, 8) == a[13:17]
    cache.unlock(h)


def _req(prompt, out=(), temperature=0.0):
    r = Req(rid="r", prompt_ids=list(prompt), params=SamplingParams(temperature=temperature), sink=None)
    r.output_ids = list(out)
    r.all_ids = list(prompt) + list(out)
    return r


def test_ngram_drafter_tree_first_then_own_context():
    cache, _ = _tree()
    d = NgramDrafter()
    r = _req([1, 2, 3, 4, 9, 1, 2, 3])
    assert d.propose(r, 3, None) == [4, 9, 1]
    cache.insert([1, 2, 3, 4, 9, 1, 2, 3, 50, 51, 52], list(range(11)))
    assert d.propose(r, 3, cache) == [50, 51, 52]
    assert d.propose(r, 0, cache) == []


def test_fixed_rate_drafter_rate_and_records():
    d = FixedRateDrafter(0.7, vocab_size=50, seed=1)
    out = list(range(3, 43))
    r = _req([1, 2], [])
    assert d.propose(r, 4) == []  # nothing recorded yet
    done = _req([1, 2], out)
    done.finish_reason = "length"
    d.on_finished(done)
    right = total = 0
    for i in range(len(out) - 4):
        r = _req([1, 2], out[:i])
        drafts = d.propose(r, 4)
        assert len(drafts) == 4 and all(0 <= t < 50 for t in drafts)
        right += sum(a == b for a, b in zip(drafts, out[i:i + 4]))
        total += 4
    assert 0.55 < right / total < 0.85
    assert d.propose(_req([1, 2], [0]), 4) == []  # its output left the record
    assert FixedRateDrafter(1.0, 50).propose(r, 2) == []  # records are per drafter


def test_parse_spec():
    assert parse_spec("ngram") == ("ngram", {})
    assert parse_spec("fixed:0.7") == ("fixed", {"p": 0.7, "seed": 0})
    assert parse_spec("fixed:1:5") == ("fixed", {"p": 1.0, "seed": 5})
    for bad in ("fixed", "fixed:2", "fixed:x", "draft", "ngram:3"):
        with pytest.raises(ValueError):
            parse_spec(bad)
    assert isinstance(make_drafter("ngram", 10), NgramDrafter)


def test_adaptive_draft_length():
    from prefixrt.speculative.draft_length import AdaptiveDraftLength

    lengths = AdaptiveDraftLength(8, max_batch=4, min_acceptance=0.2, probe_every=4)
    r = _req([1, 2, 3])
    assert lengths.length(r, 1) == 8  # optimistic start
    assert lengths.length(r, 5) == 0  # the batch is too large
    for _ in range(5):
        lengths.update(r, 8, 3)  # acceptance falls below 1/2: half the length
    assert 0.2 <= lengths.acceptance(r) < 0.5 and lengths.length(r, 1) == 4
    for _ in range(10):
        lengths.update(r, 8, 0)
    got = [lengths.length(r, 1) for _ in range(8)]
    assert got.count(0) == 6 and got.count(1) == 2  # off, but a one-token probe every 4 steps
    for _ in range(10):
        lengths.update(r, 1, 1)
    assert lengths.length(r, 1) == 8  # back on once the probes are accepted
    assert AdaptiveDraftLength(3, adaptive=False).length(r, 1000) == 3
