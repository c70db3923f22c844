"""BlockCache's own invariants: whole blocks only, exact keys (tokens and parent chain, never a hash alone),
tail-first LRU eviction from the free queue, reference counts, and a property test against a model of the
cached prefixes. The PrefixCache contract tests run for it in test_radix.py."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixrt.cache.allocator import PageAllocator, pages_to_slots
from prefixrt.cache.block import BlockCache, block_tokens_for


def _slots(a: PageAllocator, n: int) -> list[int]:
    return pages_to_slots(a.alloc(-(-n // a.page_size)), a.page_size)[:n]


def test_block_size_is_a_multiple_of_the_page():
    assert block_tokens_for(1) == 16 and block_tokens_for(4) == 16 and block_tokens_for(32) == 32
    assert block_tokens_for(24) == 48
    with pytest.raises(ValueError):
        BlockCache(PageAllocator(64, 4), block_tokens=6)


def test_only_whole_blocks_are_cached_and_the_partial_one_is_freed():
    a = PageAllocator(1000, 1)
    c = BlockCache(a, block_tokens=4)
    assert c.align_tokens == 4
    before = a.free_tokens
    assert c.insert(list(range(10)), _slots(a, 10)) == 0
    assert a.free_tokens == before - 8, "the two tokens of the partial block go back to the allocator"
    assert c.evictable_tokens == 8 and c.locked_tokens == 0
    assert c.match_prefix(list(range(10))).length == 8
    assert c.match_prefix(list(range(7))).length == 4
    assert c.match_prefix(list(range(10)), max_len=7).length == 4
    assert c.match_prefix(list(range(3))).length == 0
    c.check_integrity()


def test_pages_inside_blocks():
    a = PageAllocator(1024, 4)
    c = BlockCache(a)  # blocks of 16 tokens = 4 pages
    s = _slots(a, 40)
    assert c.insert(list(range(40)), s) == 0
    assert c.evictable_tokens == 32 and a.free_tokens == a.total_tokens - 32
    m = c.match_prefix(list(range(40)))
    assert m.length == 32 and m.slots == s[:32]
    c.check_integrity()


def test_keys_compare_tokens_not_hashes():
    """Python hashes -1 and -2 alike, so these blocks' tuples collide in the table: a hit must still be exact."""
    assert hash((-1,) * 4) == hash((-2,) * 4)
    a = PageAllocator(1000, 1)
    c = BlockCache(a, block_tokens=4)
    c.insert([-1] * 4, _slots(a, 4))
    assert c.match_prefix([-2] * 4).length == 0
    assert c.insert([-2] * 4, _slots(a, 4)) == 0
    assert c.match_prefix([-2] * 4).slots != c.match_prefix([-1] * 4).slots
    c.check_integrity()


def test_a_block_is_keyed_by_its_whole_prefix():
    """The same tokens after another first block are another block (the parent chain is part of the key)."""
    a = PageAllocator(1000, 1)
    c = BlockCache(a, block_tokens=4)
    head_a, head_b, tail = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]
    c.insert(head_a + tail, _slots(a, 8))
    assert c.match_prefix(head_b + tail).length == 0
    assert c.insert(head_b + tail, _slots(a, 8)) == 0
    assert c.match_prefix(head_b + tail).slots[4:] != c.match_prefix(head_a + tail).slots[4:]
    assert c.match_prefix(tail).length == 0  # a block found only from the start of the prompt
    c.check_integrity()


def test_eviction_is_tail_first_and_lru():
    a = PageAllocator(1000, 1)
    c = BlockCache(a, block_tokens=4)
    x, y = [1] * 12, [2] * 12
    c.insert(x, _slots(a, 12))
    c.insert(y, _slots(a, 12))
    c.match_prefix(x)  # x is now the most recent: y goes first
    assert c.evict(4) == 4
    assert c.match_prefix(y).length == 8, "a path loses its tail block first"
    assert c.match_prefix(x).length == 12
    assert c.evict(8) == 8
    assert c.match_prefix(y).length == 0 and c.match_prefix(x).length == 12
    c.check_integrity()


def test_locks_count_references_and_stale_locks_raise():
    a = PageAllocator(1000, 1)
    c = BlockCache(a, block_tokens=4)
    c.insert(list(range(12)), _slots(a, 12))
    m8 = c.match_prefix(list(range(8)))
    assert c.unlocked_on_path(m8) == 8
    h8 = c.lock(m8)
    m12 = c.match_prefix(list(range(12)))
    assert c.unlocked_on_path(m12) == 4
    h12 = c.lock(m12)
    assert c.shared_on_path(h12) == 8 and c.shared_on_path(h8) == 8
    assert c.locked_tokens == 12 and c.evictable_tokens == 0
    assert c.evict(100) == 0, "locked blocks are never evicted"
    c.unlock(h12)
    assert c.locked_tokens == 8 and c.evict(100) == 4
    stale = c.match_prefix(list(range(8)))
    c.insert([7] * 4, _slots(a, 4))
    with pytest.raises(RuntimeError):
        c.lock(stale)
    c.unlock(h8)
    with pytest.raises(RuntimeError):
        c.unlock(h8)
    c.check_integrity()


def test_namespaces_have_their_own_blocks():
    a = PageAllocator(1000, 1)
    c = BlockCache(a, block_tokens=4)
    c.insert(list(range(8)), _slots(a, 8), salt="tenant-a")
    assert c.match_prefix(list(range(8)), salt="tenant-b").length == 0
    assert c.match_prefix(list(range(8))).length == 0
    assert c.match_prefix(list(range(8)), salt="tenant-a").length == 8


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), page_size=st.sampled_from([1, 2]), blocks_of=st.sampled_from([1, 2, 4]))
def test_matches_equal_a_model_of_the_cached_prefixes(seed, page_size, blocks_of):
    """Random inserts, locks and evictions: every match is the longest block-aligned prefix among the
    prefixes the model says are cached, and free + evictable + locked + held == total throughout."""
    rng = random.Random(seed)
    a = PageAllocator(128 * page_size, page_size)
    c = BlockCache(a, block_tokens=blocks_of * page_size)
    b = c.block_tokens
    held: list[tuple[object, list[int]]] = []

    def cached_prefixes() -> set[tuple]:  # the model, read off the slots the cache owns
        return {tuple(p) for p in known if c.match_prefix(list(p)).length == len(p)}

    known: set[tuple] = set()  # every block-aligned prefix ever inserted
    for _ in range(80):
        toks = [rng.choice([0, 1]) for _ in range(rng.randint(1, 6) * page_size)]
        op = rng.random()
        if op < 0.5:
            m = c.match_prefix(toks)
            h = c.lock(m)
            need = len(toks) - m.length
            if a.free_tokens < need:
                c.evict(need - a.free_tokens)
            if a.free_tokens < need:
                c.unlock(h)
                continue
            own = _slots(a, need)
            existing = c.insert(toks, m.slots + own)
            assert existing >= m.length
            if existing > m.length:
                a.free_slots(own[: existing - m.length])
            c.unlock(h)
            known.update(tuple(toks[:k]) for k in range(b, len(toks) // b * b + 1, b))
        elif op < 0.7:
            held.append((c.lock(c.match_prefix(toks)), []))
        elif op < 0.85 and held:
            h, _ = held.pop(rng.randrange(len(held)))
            c.unlock(h)
        else:
            c.evict(rng.randint(1, 24))
        c.check_integrity()
        assert a.free_tokens + c.evictable_tokens + c.locked_tokens == a.total_tokens
        alive = cached_prefixes()
        probe = [rng.choice([0, 1]) for _ in range(8 * page_size)]
        want = max([k for k in range(0, len(probe) + 1, b) if k == 0 or tuple(probe[:k]) in alive])
        assert c.match_prefix(probe).length == want
        # prefix-closed: an alive prefix's own prefixes are alive (no orphaned blocks)
        assert all(p[:k] in alive for p in alive for k in range(b, len(p), b))
    for h, _ in held:
        c.unlock(h)
    c.flush()
    c.check_integrity()
    assert a.free_tokens == a.total_tokens
