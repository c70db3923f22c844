"""The host tier under the radix tree on hand-built requests: where each node's K/V lives, the three write
policies, load-back at admission (the loaded pool slots hold exactly the K/V that was evicted), the host LRU,
and the lifetimes contract (a pool page returns only after the copies touching it are done; the checker
raises otherwise). check_integrity (both tiers' accounting) runs after every step."""

from __future__ import annotations

import pytest
import torch

from prefixrt.cache.allocator import PageAllocator
from prefixrt.cache.host_pool import HostKVPool
from prefixrt.cache.kv_manager import KVManager
from prefixrt.cache.kv_pool import KVPool
from prefixrt.cache.req_table import ReqToTokenTable
from prefixrt.cache.tiered_radix import TieredRadixCache
from prefixrt.cache.transfer import KVTransfer, LoadWaiter
from tests.cache.test_kv_manager import req

LAYERS = 2


def make_kv(pool_tokens=16, host_tokens=64, page_size=1, policy="write_back", threshold=2, delay=0.0):
    num_slots = pool_tokens + page_size
    pool = KVPool(num_slots, num_layers=LAYERS, num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu")
    allocator = PageAllocator(num_slots, page_size)
    host = HostKVPool(host_tokens, LAYERS, 1, 2, torch.float32, page_size, pin=False)
    transfer = KVTransfer(pool, host, delay_s=delay, debug=True)
    cache = TieredRadixCache(allocator, host, transfer, policy=policy, write_threshold=threshold, debug=True)
    return KVManager(pool, allocator, ReqToTokenTable(8, 128, "cpu"), cache, debug=True)


def compute(kv: KVManager, r, n=None):
    """A forward: slots for the next n tokens; their K/V is a function of (token, position, layer)."""
    n = r.num_pending if n is None else n
    assert kv.ensure_pages(kv.pages_for(r, n))
    slots = kv.extend(r, n)
    for j, s in enumerate(slots):
        pos = r.kv_len + j
        for layer in range(LAYERS):
            kv.pool.k_buffers[layer][s] = torch.tensor([[r.all_ids[pos], pos + 100 * layer]], dtype=torch.float32)
            kv.pool.v_buffers[layer][s] = -kv.pool.k_buffers[layer][s]
    r.kv_len += n
    return slots


def expected_kv(ids, layer):
    return torch.tensor([[[t, p + 100 * layer]] for p, t in enumerate(ids)], dtype=torch.float32).reshape(-1, 1, 2)


def run(kv, ids, rid="r"):
    r = req(ids, rid=rid)
    kv.admit(r)
    compute(kv, r)
    kv.release(r)
    kv.check_integrity()
    return r


def assert_row_holds(kv, r, ids):
    """r's table row points at pool slots holding exactly ids' K/V (after the loads are done)."""
    w = kv.tiers.load_waiter()
    if w is not None:
        w.wait_all()
    slots = torch.tensor(kv.slots_of(r, 0, len(ids)), dtype=torch.int64)
    for layer in range(LAYERS):
        assert torch.equal(kv.pool.k_buffers[layer][slots], expected_kv(ids, layer))
        assert torch.equal(kv.pool.v_buffers[layer][slots], -expected_kv(ids, layer))


@pytest.mark.parametrize("page_size", [1, 4])
def test_eviction_moves_to_host_and_admission_loads_back_exact_kv(page_size):
    kv = make_kv(pool_tokens=16, page_size=page_size, policy="write_back")
    a_ids = list(range(10, 22))  # 12 tokens
    run(kv, a_ids, "a")
    run(kv, list(range(50, 62)), "b")  # needs the pool: a is moved to the host tier
    cache = kv.cache
    assert cache.host_cached_tokens >= 8 and kv.evicted_tokens_total > 0
    m = kv.match(req(a_ids))
    assert m.length + m.host_length == 11 // page_size * page_size and m.host_length > 0
    r = req(a_ids, rid="again")
    kv.admit(r)
    assert r.num_cached_tokens == 11 // page_size * page_size  # counts both tiers
    assert cache.host_hit_tokens_total == m.host_length
    assert_row_holds(kv, r, a_ids[: r.kv_len])
    kv.check_integrity()
    compute(kv, r)
    kv.release(r)
    kv.reclaim(wait=True)
    kv.check_integrity()
    assert kv.free_tokens + kv.evictable_tokens == kv.total_tokens


def test_write_through_copies_at_insert_and_eviction_only_drops_the_pool_copy():
    kv = make_kv(policy="write_through")
    run(kv, list(range(10, 22)), "a")
    assert kv.cache.host_cached_tokens == 12 and kv.cache.backed_up_tokens_total == 12
    backed = kv.cache.backed_up_tokens_total
    run(kv, list(range(50, 62)), "b")
    assert kv.cache.backed_up_tokens_total == backed + 12  # b at its insert; a's eviction copied nothing
    r = req(list(range(10, 22)), rid="c")
    kv.admit(r)
    assert r.num_cached_tokens == 11
    assert_row_holds(kv, r, list(range(10, 21)))
    kv.release(r)
    kv.check_integrity()


def test_write_through_selective_copies_after_n_hits_and_drops_cold_nodes():
    kv = make_kv(policy="write_through_selective", threshold=2)
    hot = list(range(10, 18))
    run(kv, hot, "h1")
    assert kv.cache.host_cached_tokens == 0
    run(kv, hot, "h2")  # 1 hit
    assert kv.cache.host_cached_tokens == 0
    run(kv, hot, "h3")  # 2 hits: copied now
    assert kv.cache.host_cached_tokens >= 7
    run(kv, list(range(100, 116)), "cold")  # fills the pool: hot moves to the host
    run(kv, list(range(200, 216)), "cold2")  # cold (no hits) is dropped, not copied
    assert kv.match(req(list(range(100, 116)))).host_length == 0
    m = kv.match(req(hot))
    assert m.length + m.host_length == 7 and m.host_length > 0
    kv.check_integrity()


def test_host_lru_deletes_the_oldest_host_only_nodes():
    kv = make_kv(pool_tokens=8, host_tokens=16, policy="write_back")
    for i in range(4):  # four 8-token prompts through an 8-token pool and a 16-token host tier
        run(kv, [1000 + 100 * i + j for j in range(8)], f"p{i}")
    assert kv.cache.host_evicted_tokens_total > 0
    assert kv.match(req([1000 + j for j in range(8)])).host_length == 0  # the oldest is gone from both tiers
    m = kv.match(req([1200 + j for j in range(8)]))
    assert m.length + m.host_length == 7
    kv.check_integrity()


def test_a_pool_page_waits_for_its_pending_backup_and_the_checker_catches_an_early_free():
    kv = make_kv(pool_tokens=8, policy="write_back", delay=0.05)
    run(kv, list(range(10, 18)), "a")
    r = req(list(range(50, 58)), rid="b")
    kv.admit(r)
    assert kv.ensure_pages(8)  # evicts a: its backup runs 2 x 50 ms; the pages come back only after it
    held = kv.cache.transfer._unaccounted
    assert held and all(t.query() for t in held if t.kind == "backup")
    kv.release(r)
    kv.check_integrity()
    # The checker: hand back a page while a copy out of it is still pending.
    run(kv, list(range(300, 308)), "c")
    node_slots = kv.cache.cached_slots()
    t = kv.cache.transfer.backup(node_slots, [1, 2, 3, 4, 5, 6, 7, 8])
    kv.track(t, node_slots)
    with pytest.raises(AssertionError, match="pending"):
        kv.free_pages([node_slots[0]])
    t.wait()
    kv.close()


def test_a_forward_that_skips_a_layer_wait_is_caught():
    kv = make_kv(pool_tokens=8, policy="write_back", delay=0.02)
    run(kv, list(range(10, 18)), "a")
    run(kv, list(range(50, 58)), "b")
    r = req(list(range(10, 18)), rid="c")
    kv.admit(r)
    w = kv.tiers.load_waiter()
    assert isinstance(w, LoadWaiter) and w.loads
    w.wait(0)  # layer 1 "forgot" its wait
    with pytest.raises(AssertionError, match="without waiting"):
        w.check()
    w.wait(1)
    w.check()
    assert_row_holds(kv, r, list(range(10, 17)))
    kv.release(r)
    kv.check_integrity()
    kv.close()


def test_flush_empties_both_tiers():
    kv = make_kv(policy="write_through")
    run(kv, list(range(10, 22)), "a")
    run(kv, list(range(50, 62)), "b")
    kv.flush()
    kv.reclaim(wait=True)
    assert kv.cache.host_cached_tokens == 0 and kv.evictable_tokens == 0
    assert kv.free_tokens == kv.total_tokens
    kv.check_integrity()


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_random_requests_keep_both_tiers_exact_and_accounted(policy, page_size):
    """Random prompts over a few shared stems through a 24-token pool and a 48-token host tier: after every
    admission the request's row holds exactly its prefix's K/V (wherever it came from), and both tiers'
    accounting holds after every step; some requests publish a chunk and leave midway (abort)."""
    import random

    rng = random.Random(hash((policy, page_size)) % 1000)
    kv = make_kv(pool_tokens=24, host_tokens=48, page_size=page_size, policy=policy, threshold=2)
    stems = [[rng.randrange(3, 50) for _ in range(rng.randint(4, 12))] for _ in range(5)]
    hits = 0
    for i in range(150):
        ids = list(rng.choice(stems))[: rng.randint(1, 12)] + [rng.randrange(3, 50) for _ in range(rng.randint(1, 6))]
        r = req(ids, rid=f"r{i}")
        kv.admit(r)
        hits += r.kv_len
        assert_row_holds(kv, r, ids[: r.kv_len])
        if rng.random() < 0.3 and r.num_pending > 2:  # publish a chunk, then leave (an abort midway)
            compute(kv, r, r.num_pending // 2)
            kv.cache_unfinished(r)
        else:
            compute(kv, r)
        kv.release(r)
        kv.check_integrity()
        if rng.random() < 0.1:
            kv.reclaim(wait=True)
            assert kv.free_tokens + kv.evictable_tokens == kv.total_tokens
    assert hits > 0 and kv.cache.host_hit_tokens_total > 0
    kv.close()
