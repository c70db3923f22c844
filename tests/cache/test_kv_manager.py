"""KVManager on hand-built requests: admission, extension, publication, release, eviction, accounting.

Each test drives a real pool / allocator / request table / prefix cache (tiny, on the CPU) through the calls
the scheduler makes, and checks exact page, slot and token counts, plus check_integrity after every step.
"""

from __future__ import annotations

import pytest
import torch

from prefixrt.cache.allocator import PageAllocator
from prefixrt.cache.kv_manager import KVManager
from prefixrt.cache.kv_pool import KVPool
from prefixrt.cache.no_reuse import NoReuseCache
from prefixrt.cache.radix import RadixCache
from prefixrt.cache.req_table import ReqToTokenTable
from prefixrt.params import SamplingParams
from prefixrt.request import Req


def make_kv(num_slots: int = 64, page_size: int = 1, radix: bool = True, debug: bool = True) -> KVManager:
    pool = KVPool(num_slots, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu")
    allocator = PageAllocator(num_slots, page_size)
    cache = RadixCache(allocator) if radix else NoReuseCache(allocator)
    return KVManager(pool, allocator, ReqToTokenTable(8, 128, "cpu"), cache, debug=debug)


def req(ids: list[int], rid: str = "r", salt=None, **params) -> Req:
    return Req(rid=rid, prompt_ids=list(ids), params=SamplingParams(**params), sink=None, salt=salt)


def compute(kv: KVManager, r: Req, n: int | None = None) -> list[int]:
    """What one forward does to r's memory: slots for the next n pending tokens, then kv_len advances."""
    n = r.num_pending if n is None else n
    assert kv.ensure_pages(kv.pages_for(r, n))
    slots = kv.extend(r, n)
    r.kv_len += n
    return slots


def test_admit_on_empty_cache_then_extend_allocates_exact_pages():
    kv = make_kv(num_slots=64, page_size=4)
    r = req(range(10, 20))
    kv.admit(r)
    assert (r.kv_len, r.cached_len, r.num_cached_tokens, r.pages) == (0, 0, 0, [])
    assert kv.pages_for(r, 10) == 3  # ceil(10 / 4)
    slots = compute(kv, r)
    assert len(r.pages) == 3
    assert slots == [p * 4 + j for p in r.pages for j in range(4)][:10]  # page-major, positions in order
    assert kv.free_tokens == kv.total_tokens - 12
    assert kv.private_tokens == 12
    kv.table.flush()
    assert kv.table.table[r.row, :10].tolist() == slots
    kv.check_integrity()
    assert kv.pages_for(r, 2) == 0 and kv.pages_for(r, 3) == 1  # 12 slots hold 12 tokens


def test_release_publishes_and_the_next_request_reuses_all_but_its_last_token():
    kv = make_kv(num_slots=64)
    a = req([5, 6, 7, 8, 9], rid="a")
    kv.admit(a)
    slots_a = compute(kv, a)
    kv.release(a)
    assert (a.row, a.pages, a.kv_len) == (None, [], 0)
    assert kv.evictable_tokens == 5 and kv.free_tokens == kv.total_tokens - 5
    kv.check_integrity()

    b = req([5, 6, 7, 8, 9], rid="b")  # the same prompt: everything but the last token is reused
    kv.admit(b)
    assert b.num_cached_tokens == 4 and b.kv_len == b.cached_len == 4
    assert kv.slots_of(b, 0, 4) == slots_a[:4]
    assert kv.cache.locked_tokens == 4 and kv.evictable_tokens == 1
    assert compute(kv, b) != slots_a[4:]  # the last token is recomputed into a private slot
    kv.release(b)
    kv.check_integrity()
    assert kv.evictable_tokens == 5  # b's duplicate of token 9 was freed, not cached twice
    assert kv.free_tokens + kv.evictable_tokens == kv.total_tokens


def test_match_stops_before_the_first_scored_token():
    kv = make_kv()
    a = req([1, 2, 3, 4, 5, 6])
    kv.admit(a)
    compute(kv, a)
    kv.release(a)
    scored = req([1, 2, 3, 4, 5, 6])
    scored.input_logprobs_from = 3  # wants log p(all_ids[3]), so the logits after token 2 must be computed
    assert kv.match(scored).length == 2
    assert kv.match(req([1, 2, 3, 4, 5, 6])).length == 5


def test_namespaces_never_share():
    kv = make_kv()
    a = req([1, 2, 3, 4], salt="tenant-a")
    kv.admit(a)
    compute(kv, a)
    kv.release(a)
    assert kv.match(req([1, 2, 3, 4], salt="tenant-b")).length == 0
    assert kv.match(req([1, 2, 3, 4], salt=None)).length == 0
    assert kv.match(req([1, 2, 3, 4], salt="tenant-a")).length == 3


@pytest.mark.parametrize("page_size", [1, 4])
def test_cache_unfinished_frees_private_duplicates_of_a_concurrent_prefill(page_size):
    """Two requests prefill the same 8 tokens privately; the second to publish gives its copies back and
    its table row points at the tree's slots."""
    kv = make_kv(num_slots=64, page_size=page_size)
    a, b = req(range(1, 11), rid="a"), req(range(1, 11), rid="b")
    kv.admit(a)
    kv.admit(b)
    compute(kv, a, 8)
    compute(kv, b, 8)
    used = kv.total_tokens - kv.free_tokens
    assert used == 16
    kv.cache_unfinished(a)
    assert a.cached_len == 8 and kv.cache.locked_tokens == 8
    kv.cache_unfinished(b)
    assert b.cached_len == 8
    assert kv.total_tokens - kv.free_tokens == 8  # b's 8 duplicates were freed
    assert kv.slots_of(b, 0, 8) == kv.slots_of(a, 0, 8)
    kv.table.flush()
    assert kv.table.table[b.row, :8].tolist() == kv.slots_of(a, 0, 8)
    kv.check_integrity()
    for r in (a, b):
        compute(kv, r)
        kv.release(r)
    kv.check_integrity()
    assert kv.cache.locked_tokens == 0


def test_ensure_pages_evicts_only_when_short_and_never_takes_locked_memory():
    kv = make_kv(num_slots=17)  # 16 usable slots (page 0 is the padding slot)
    assert kv.total_tokens == 16
    a = req(range(100, 112), rid="a")
    kv.admit(a)
    compute(kv, a)
    kv.release(a)
    assert kv.free_tokens == 4 and kv.evictable_tokens == 12
    assert kv.ensure_pages(4) and kv.evicted_tokens_total == 0  # enough free: nothing evicted
    assert kv.ensure_pages(6)  # 2 short: the LRU leaf goes, and it is a's whole 12-token node
    assert kv.evicted_tokens_total == 12 and kv.free_tokens == 16 and kv.evictable_tokens == 0
    kv.check_integrity()

    b = req(range(200, 212), rid="b")
    kv.admit(b)
    compute(kv, b)
    kv.cache_unfinished(b)  # published while running: cached but locked
    assert kv.cache.locked_tokens == 12 and kv.evictable_tokens == 0 and kv.free_tokens == 4
    assert not kv.ensure_pages(5)
    assert kv.cache.locked_tokens == 12 and kv.evicted_tokens_total == 12  # nothing was taken
    kv.release(b)
    assert kv.ensure_pages(5) and kv.evicted_tokens_total == 24
    kv.check_integrity()


def test_no_reuse_cache_keeps_nothing():
    kv = make_kv(radix=False)
    a = req([1, 2, 3, 4, 5])
    kv.admit(a)
    compute(kv, a)
    kv.cache_unfinished(a)
    assert a.cached_len == 0
    kv.release(a)
    assert kv.free_tokens == kv.total_tokens and kv.evictable_tokens == 0
    b = req([1, 2, 3, 4, 5])
    kv.admit(b)
    assert b.num_cached_tokens == 0
    kv.release(b)
    kv.check_integrity()


def test_released_slots_are_poisoned_in_debug_mode():
    kv = make_kv(radix=False)
    a = req([1, 2, 3])
    kv.admit(a)
    slots = compute(kv, a)
    kv.pool.write(0, torch.tensor(slots), torch.ones(3, 1, 2), torch.ones(3, 1, 2))
    kv.release(a)
    assert torch.isnan(kv.pool.k_buffers[0][slots]).all()


def test_integrity_check_catches_a_leaked_page():
    kv = make_kv()
    a = req([1, 2, 3])
    kv.admit(a)
    compute(kv, a)
    a.pages.pop()  # the request forgets a page it owns: nobody accounts for it any more
    with pytest.raises(AssertionError, match="KV leak"):
        kv.check_integrity()


@pytest.mark.parametrize("page_size", [1, 4])
def test_followers_on_one_cached_prefix_copy_the_first_ones_row_and_match_the_host_write(page_size):
    """Requests admitted on the same cached prefix: the first writes its row from the host and registers it; the
    next ones copy that row on the device. Each row's first cells equal the reference (the match's slots, written
    from the host). Once the registered request leaves, the next one writes from the host and registers again."""
    kv = make_kv(num_slots=256, page_size=page_size)
    shared = list(range(100, 124))  # 24 tokens: whole pages for both page sizes
    leader = req(shared + [1, 2, 3, 4], rid="leader")
    kv.admit(leader)
    compute(kv, leader)
    kv.cache_unfinished(leader)
    followers = [req(shared + [10 + i] * 5, rid=f"f{i}") for i in range(4)]
    for f in followers:
        kv.admit(f)
        assert f.cached_len == 24
    assert len(kv.table._copies) == 3  # the first follower wrote from the host, three copied its row
    kv.table.flush()
    for f in followers:
        m = kv.cache.match_prefix(f.all_ids, max_len=24)
        assert kv.table.table[f.row, :24].tolist() == m.slots == kv.slots_of(f, 0, 24)
        compute(kv, f)
    kv.check_integrity()

    source = followers[0]
    kv.release(source)
    late = req(shared + [50] * 5, rid="late")
    kv.admit(late)
    assert kv.table._copies == []  # its source left: a host write, and late is the new source
    assert kv._prefix_rows[late.cache_handle] == (late.row, 24)
    kv.table.flush()
    assert kv.table.table[late.row, :24].tolist() == kv.slots_of(late, 0, 24)
    for r in (leader, *followers[1:], late):
        kv.release(r)
    kv.check_integrity()
    assert kv._prefix_rows == {} and kv.cache.locked_tokens == 0
    assert kv.free_tokens + kv.evictable_tokens == kv.total_tokens


def test_admit_uses_a_current_match_and_rematches_a_stale_one():
    kv = make_kv(num_slots=64)
    a = req([5, 6, 7, 8, 9], rid="a")
    kv.admit(a)
    compute(kv, a)
    b = req([5, 6, 7, 8, 1], rid="b")
    stale = kv.match(b)  # nothing cached yet
    kv.cache_unfinished(a)  # the tree changes
    kv.admit(b, stale)
    assert b.cached_len == 4  # re-matched, not admitted on the stale empty match
    kv.release(a)
    kv.release(b)
    kv.check_integrity()
