"""K/V received from another engine (KVReceiver.begin / finish / abandon, cache/kv_receive.py) and the wire it
comes over (parallel/kv_transport.py), on a real pool, allocator and radix tree on the CPU.

The lifetime contract: a receive's pages go back to the allocator only once its Transfer is done (the sender
confirmed it never started or has finished). The checker must trip when that is bypassed (the production bug:
slots reused while a transfer still writes them).
"""

from __future__ import annotations

import threading

import pytest
import torch

from prefixrt.parallel.kv_transport import Channel, local_groups, write_layer
from tests.cache.test_kv_manager import compute, make_kv, req


def test_receive_reserves_the_missing_pages_and_publishes_them():
    kv = make_kv(num_slots=64, page_size=2)
    r = req(range(10, 18))
    kv.admit(r)
    compute(kv, r)
    kv.release(r)  # tokens 10..17 cached
    tokens = list(range(10, 18)) + list(range(30, 37))  # 15 tokens: 14 whole pages' worth, 8 cached already
    inc = kv.receiver.begin(tokens, None)
    assert inc.start == 8 and len(inc.tokens) == 14 and len(inc.slots) == 6 and len(inc.pages) == 3
    assert kv.cache.locked_tokens == 8  # the cached part stays while the rest arrives
    assert kv.private_tokens == 6
    kv.check_integrity()
    inc.transfer.mark_all()
    assert kv.receiver.finish(inc) == 14
    m = kv.cache.match_prefix(tokens, None)
    assert m.length == 14 and m.slots[8:] == inc.slots
    assert kv.cache.locked_tokens == 0 and kv.private_tokens == 0
    kv.check_integrity()
    assert kv.receiver.begin(tokens, None) is None  # nothing missing any more


def test_duplicates_of_what_the_cache_gained_meanwhile_are_freed():
    kv = make_kv(num_slots=64)
    tokens = list(range(20, 30))
    inc = kv.receiver.begin(tokens, None)
    r = req(tokens + [5])  # the same prompt computed here while the receive is in flight
    kv.admit(r)
    compute(kv, r)
    kv.release(r)
    free_before = kv.free_tokens
    inc.transfer.mark_all()
    kv.receiver.finish(inc)
    assert kv.free_tokens == free_before + 10  # all ten received slots were duplicates
    kv.check_integrity()


def test_abandoned_receive_keeps_its_pages_until_the_sender_confirms():
    kv = make_kv(num_slots=16)
    inc = kv.receiver.begin(list(range(40, 52)), None)
    kv.receiver.abandon(inc)  # aborted while the transfer may still write
    assert kv.free_tokens == kv.total_tokens - 12
    kv.check_integrity()
    kv.reclaim()  # not confirmed yet: nothing comes back
    assert kv.free_tokens == kv.total_tokens - 12 and kv.receiver.pending == 1
    assert set(kv.allocator.alloc(kv.allocator.free_pages)).isdisjoint(inc.pages)
    assert kv.receiver.target_ok(inc)
    kv.allocator.free([p for p in range(1, 16) if p not in inc.pages])
    inc.transfer.mark_all()  # the confirmation: complete (or never started)
    kv.reclaim()
    assert kv.free_tokens == kv.total_tokens and kv.receiver.pending == 0
    kv.check_integrity()


def test_the_checker_trips_when_slots_are_reused_while_written():
    kv = make_kv(num_slots=16)
    inc = kv.receiver.begin(list(range(40, 52)), None)
    kv.cache.unlock(inc.handle)
    kv.receiver.incoming.pop(id(inc))
    kv.allocator.free(inc.pages)  # the bug: straight back to the allocator, the transfer still pending
    assert not kv.receiver.target_ok(inc)  # the receiver's check before it writes a layer
    r = req(range(100, 112))
    kv.admit(r)
    with pytest.raises(AssertionError, match="reused while a receive copy"):
        compute(kv, r)  # the allocator side: the pages come back while their transfer is pending
    assert kv.lifetime_violations == 2


def test_freeing_a_page_of_a_pending_receive_through_the_manager_raises():
    kv = make_kv(num_slots=16)
    inc = kv.receiver.begin(list(range(40, 44)), None)
    with pytest.raises(AssertionError, match="freed while a receive copy"):
        kv.free_pages(inc.pages)
    assert kv.lifetime_violations == 1


def test_layers_over_gloo_land_in_the_reserved_slots():
    src = make_kv(num_slots=32)
    dst = make_kv(num_slots=32)
    torch.manual_seed(0)
    for buf in src.pool.k_buffers + src.pool.v_buffers:
        buf.copy_(torch.randn_like(buf))
    g0, g1 = local_groups(2)
    a, b = Channel(g0, 1, 5, 6), Channel(g1, 0, 6, 5)
    send_slots = torch.tensor([3, 9, 4, 20], dtype=torch.int64)
    inc = dst.receiver.begin([7, 8, 9, 10], None)
    recv_slots = torch.tensor(inc.slots, dtype=torch.int64)

    def sender():
        a.send_obj({"n": 4})
        for layer in range(src.pool.num_layers):
            a.send_layer(src.pool, layer, send_slots)

    t = threading.Thread(target=sender)
    t.start()
    assert b.recv_obj() == {"n": 4}
    for layer in range(dst.pool.num_layers):
        write_layer(dst.pool, layer, recv_slots, b.recv_layer(dst.pool, 4))
        inc.transfer.events[layer].set()
    t.join()
    for layer in range(src.pool.num_layers):
        assert torch.equal(dst.pool.k_buffers[layer][recv_slots], src.pool.k_buffers[layer][send_slots])
        assert torch.equal(dst.pool.v_buffers[layer][recv_slots], src.pool.v_buffers[layer][send_slots])
    assert a.bytes_sent == b.bytes_received
    dst.receiver.finish(inc)
    dst.check_integrity()
