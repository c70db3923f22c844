"""RadixCache and KV accounting: unit tests plus a property test over random operation sequences.

The tests of the PrefixCache contract (ownership on insert, LRU eviction of unlocked entries, alignment,
namespaces, accounting under random operations) run for the radix tree and the hash-block cache (block.py, with
blocks of one page, where both must behave alike); tests/cache/test_block.py has the block cache's own."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixrt.cache.allocator import OutOfPages, PageAllocator, pages_to_slots
from prefixrt.cache.block import BlockCache
from prefixrt.cache.no_reuse import NoReuseCache
from prefixrt.cache.radix import RadixCache

# The contract's implementations (blocks of one page: the block cache's alignment equals the tree's).
CACHES = {"radix": RadixCache, "block": lambda a: BlockCache(a, block_tokens=a.page_size)}
contract = pytest.mark.parametrize("make_cache", list(CACHES.values()), ids=list(CACHES))


def _alloc_slots(alloc: PageAllocator, n: int) -> list[int]:
    ps = alloc.page_size
    return pages_to_slots(alloc.alloc(-(-n // ps)), ps)[:n]


def test_allocator_reserves_page_zero_and_detects_double_free():
    a = PageAllocator(64, 4)
    assert a.total_tokens == 60 and a.free_tokens == 60
    pages = a.alloc(15)
    assert 0 not in pages and len(set(pages)) == 15
    with pytest.raises(OutOfPages):
        a.alloc(1)
    a.free(pages[:3])
    with pytest.raises(RuntimeError):
        a.free(pages[:1])
    assert a.free_tokens == 12


def test_match_is_read_only_and_lock_splits():
    a = PageAllocator(1000, 1)
    c = RadixCache(a)
    toks = list(range(10))
    slots = _alloc_slots(a, 10)
    assert c.insert(toks, slots) == 0
    v = c.version
    m = c.match_prefix(list(range(5)) + [99])
    assert m.length == 5 and m.slots == slots[:5]
    assert c.version == v, "lookup must not change the tree"
    h = c.lock(m)
    assert c.version != v, "lock of a partial match splits"
    assert c.locked_tokens == 5 and c.evictable_tokens == 5
    c.check_integrity()
    c.unlock(h)
    assert c.locked_tokens == 0 and c.evictable_tokens == 10
    c.check_integrity()


@contract
def test_insert_reports_existing_prefix_and_takes_ownership_of_rest(make_cache):
    a = PageAllocator(1000, 1)
    c = make_cache(a)
    s1 = _alloc_slots(a, 8)
    assert c.insert(list(range(8)), s1) == 0
    s2 = _alloc_slots(a, 12)
    existing = c.insert(list(range(12)), s2)
    assert existing == 8
    a.free_slots(s2[:8])  # the caller frees its duplicates
    assert c.match_prefix(list(range(12))).slots == s1 + s2[8:]
    assert c.evictable_tokens == 12
    c.check_integrity()


@contract
def test_eviction_is_lru_over_unlocked_leaves(make_cache):
    a = PageAllocator(1000, 1)
    c = make_cache(a)
    for first in (1, 2, 3):
        c.insert([first, 0, 0, 0], _alloc_slots(a, 4))
    c.match_prefix([1, 0, 0, 0])  # touch 1: now 2 is least recent
    h = c.lock(c.match_prefix([3, 0, 0, 0]))
    freed = c.evict(4)
    assert freed == 4
    assert c.match_prefix([2, 0, 0, 0]).length == 0
    assert c.match_prefix([1, 0, 0, 0]).length == 4
    assert c.evict(100) == 4  # only 1 is left evictable; 3 is locked
    assert c.match_prefix([3, 0, 0, 0]).length == 4
    c.unlock(h)
    c.check_integrity()


@contract
def test_page_alignment(make_cache):
    a = PageAllocator(1024, 16)
    c = make_cache(a)
    toks = list(range(40))
    slots = _alloc_slots(a, 48)
    assert c.insert(toks, slots[:40]) == 0  # only 32 tokens (two pages) are kept
    a.free_slots(slots[32:48])
    assert c.evictable_tokens == 32
    for hit in (1, 15, 16, 17, 31, 32, 33):
        assert c.match_prefix(toks[:hit]).length == hit // 16 * 16
    assert c.match_prefix(toks[:20] + [999] * 20).length == 16
    c.check_integrity()


@contract
def test_namespaces_never_share(make_cache):
    a = PageAllocator(1000, 1)
    c = make_cache(a)
    c.insert(list(range(10)), _alloc_slots(a, 10), salt="tenant-a")
    assert c.match_prefix(list(range(10)), salt="tenant-b").length == 0
    assert c.match_prefix(list(range(10)), salt=None).length == 0
    assert c.match_prefix(list(range(10)), salt="tenant-a").length == 10


def test_no_reuse_cache_frees_on_insert():
    a = PageAllocator(100, 1)
    c = NoReuseCache(a)
    s = _alloc_slots(a, 10)
    assert c.insert(list(range(10)), s) == 0
    assert a.free_tokens == a.total_tokens
    assert c.match_prefix(list(range(10))).length == 0


@contract
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), page_size=st.sampled_from([1, 4]))
def test_random_operations_keep_accounting(make_cache, seed, page_size):
    """Random insert/match/lock/unlock/evict/abort: free + evictable + locked + held == total always."""
    rng = random.Random(seed)
    a = PageAllocator(256 * page_size, page_size)
    c = make_cache(a)
    held: list[tuple[object, list[int]]] = []  # (lock handle, private slots of an 'in-flight request')
    vocab = [0, 1, 2]

    def check():
        c.check_integrity()
        private = sum(len(s) for _, s in held)
        assert a.free_tokens + c.evictable_tokens + c.locked_tokens + private == a.total_tokens

    for _ in range(120):
        op = rng.random()
        toks = [rng.choice(vocab) for _ in range(rng.randint(1, 12) * page_size)]
        if op < 0.35:  # a request: match + lock, compute the rest privately, maybe abort, then insert
            m = c.match_prefix(toks)
            h = c.lock(m)
            need = len(toks) - m.length
            if a.free_tokens < need:
                c.evict(need - a.free_tokens)
            if a.free_tokens < need:
                c.unlock(h)
                continue
            own = _alloc_slots(a, need)
            held.append((h, own))
            check()
            if rng.random() < 0.2:  # abort before publishing
                h, own = held.pop()
                a.free_slots(own)
                c.unlock(h)
            else:
                h, own = held.pop()
                existing = c.insert(toks, m.slots + own)
                if existing > m.length:
                    a.free_slots(own[: existing - m.length])
                c.unlock(h)
        elif op < 0.6:
            c.match_prefix(toks)
        elif op < 0.75:
            m = c.match_prefix(toks)
            held.append((c.lock(m), []))
        elif op < 0.9 and held:
            h, own = held.pop(rng.randrange(len(held)))
            a.free_slots(own)
            c.unlock(h)
        else:
            c.evict(rng.randint(1, 40))
        check()
    for h, own in held:
        a.free_slots(own)
        c.unlock(h)
    c.flush()
    check()
    assert a.free_tokens == a.total_tokens


def _tree(c: RadixCache) -> list[tuple]:
    """Every node as (path tokens, slots, lock count), in path order."""
    out = []

    def walk(node, path):
        for child in node.children.values():
            p = path + tuple(child.key)
            out.append((p, tuple(child.slots), child.lock_ref))
            walk(child, p)

    for salt, root in c._roots.items():
        walk(root, (salt,))
    return sorted(out)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), page_size=st.sampled_from([1, 4]))
def test_insert_below_equals_insert_then_match(seed, page_size):
    """A running request re-publishing its prefix from its locked node (insert_below) leaves the tree, the
    counters and the LRU order exactly as insert + match_prefix from the root (the reference) do."""
    rng = random.Random(seed)
    caches = [RadixCache(PageAllocator(256 * page_size, page_size)) for _ in range(2)]
    running: list[list] = []  # per request: [tokens, [handle in each cache], cached_len, private slots per cache]
    vocab = [0, 1, 2]
    for _ in range(150):
        op = rng.random()
        if op < 0.3:  # admit: match + lock a prefix, the rest computed privately
            toks = [rng.choice(vocab) for _ in range(rng.randint(1, 10) * page_size)]
            ms = [c.match_prefix(toks) for c in caches]
            assert ms[0].length == ms[1].length and ms[0].slots == ms[1].slots
            need = len(toks) - ms[0].length
            if any(c.allocator.free_tokens < need for c in caches):
                continue
            own = [_alloc_slots(c.allocator, need) for c in caches]
            assert own[0] == own[1]
            running.append([toks, [c.lock(m) for c, m in zip(caches, ms)], ms[0].length, own])
        elif op < 0.6 and running:  # publish: maybe grow first, then insert (reference) / insert_below (fast)
            r = running[rng.randrange(len(running))]
            toks, handles, cached, own = r
            grow = rng.randint(0, 3) * page_size
            if grow and all(c.allocator.free_tokens >= grow for c in caches):
                toks.extend(rng.choice(vocab) for _ in range(grow))
                for c, o in zip(caches, own):
                    o.extend(_alloc_slots(c.allocator, grow))
            if len(toks) <= cached:
                continue
            answers, ms = [], []
            for i, c in enumerate(caches):
                if i == 0 or handles[i] is None:  # the reference (the engine's path without a locked node)
                    existing = c.insert(toks, c.match_prefix(toks[:cached]).slots + own[i])
                    m = c.match_prefix(toks)
                    answers.append((existing, m.slots[cached:existing], m.length))
                else:
                    existing, have, m = c.insert_below(handles[i], cached, toks, own[i])
                    answers.append((existing, have, m.length))
                ms.append(m)
            assert answers[0] == answers[1] and answers[0][2] == len(toks)
            existing0 = answers[0][0]
            new_handles = [c.lock(m) for c, m in zip(caches, ms)]
            for c, h in zip(caches, handles):
                c.unlock(h)
            for c, o in zip(caches, own):  # the tree took [cached, existing): those private slots go back
                c.allocator.free_slots(o[: existing0 - cached])
            r[1], r[2], r[3] = new_handles, len(toks), [o[len(toks) - cached:] for o in own]
        elif op < 0.75 and running:  # finish: unlock, free what is private
            toks, handles, cached, own = running.pop(rng.randrange(len(running)))
            for c, h, o in zip(caches, handles, own):
                c.allocator.free_slots(o)
                c.unlock(h)
        else:
            k = rng.randint(1, 40)
            assert caches[0].evict(k) == caches[1].evict(k)
        assert _tree(caches[0]) == _tree(caches[1])
        for c in caches:
            c.check_integrity()
        assert caches[0].evictable_tokens == caches[1].evictable_tokens
        assert caches[0].locked_tokens == caches[1].locked_tokens
        assert caches[0].allocator.free_tokens == caches[1].allocator.free_tokens
    while caches[0].evictable_tokens:  # the LRU order is the same: the same slots go back, step by step
        assert caches[0].evict(page_size) == caches[1].evict(page_size)
        assert _tree(caches[0]) == _tree(caches[1])
