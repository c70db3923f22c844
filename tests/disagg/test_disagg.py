"""Prefill/decode disaggregation (disagg/decode.py) end to end on a tiny checkpoint (CPU, fp32, gloo).

Oracle: the same greedy requests on one plain engine. The pair is a prefill Engine and a DecodeEngine in this
process, joined by a two-rank gloo group (each rank's streams on their own threads). Race mode delays every
layer the prefill side sends, and debug mode poisons freed slots with NaN, so slots reused while a transfer
still writes them change another request's output, trip the receiver's ownership check, or the allocator's.
"""

from __future__ import annotations

import random
import time

import pytest

from prefixrt.parallel import kv_transport
from tests.engine.test_engine import _tree_workload
from tests.helpers.engines import assert_idle_and_clean

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture
def make_pair(tiny_checkpoints, tiny_tokenizer):
    """make_pair(delay_s=0.0, **engine_kwargs) -> DisaggPair on the tiny llama (both engines debug=True)."""
    from types import SimpleNamespace

    from prefixrt.disagg.decode import DisaggPair
    from prefixrt.hub.loader import load_model

    pairs = []

    def make(delay_s: float = 0.0, **kwargs):
        path, _ = tiny_checkpoints("llama")
        model = load_model(path, dtype="float32", device="cpu")
        resolved = SimpleNamespace(name="tiny-llama", revision="test", extra_eos_token_ids=(), path=str(path))
        kwargs = {"device": "cpu", "debug": True, "kv_cache_tokens": 4096, **kwargs}
        pair = DisaggPair("tiny-llama", delay_s=delay_s, _parts=(model, tiny_tokenizer, resolved), **kwargs)
        pairs.append(pair)
        return pair

    yield make
    try:
        for pair in pairs:
            for eng in (pair.decode, pair.prefill):
                assert_idle_and_clean(eng)
            assert pair.decode.core.kv.lifetime_violations == 0
    finally:
        for pair in pairs:
            pair.shutdown()


@pytest.mark.parametrize("page_size", [1, 4])
def test_outputs_equal_a_single_engine(page_size, make_pair, make_engine):
    prompts = _tree_workload(40, seed=3 + page_size)
    params = {"max_new_tokens": 8, **GREEDY}
    ref = make_engine("llama", page_size=page_size)
    want = [c.token_ids for c in ref.generate(prompts, params)]
    pair = make_pair(page_size=page_size)
    got = pair.decode.generate(prompts, params)
    assert [c.token_ids for c in got] == want
    s = pair.decode.transfer_stats()
    assert s["transfers"] > 0 and s["tokens"] > 0 and s["failed"] == 0
    assert s["bytes"] == s["tokens"] * pair.decode.core.kv.pool.num_layers * 2 * 2 * 16 * 4  # K+V, kvh 2, d 16, fp32
    # Every prompt token but the last came over the wire or from the decode side's own cache.
    assert all(c.cached_tokens >= (len(p) - 1) // page_size * page_size for c, p in zip(got, prompts))
    # Again, one by one: the decode cache now holds the prompts, so they are not fetched again.
    before = s["transfers"]
    assert [pair.decode.generate(p, params).token_ids for p in prompts[:10]] == want[:10]
    assert pair.decode.transfer_stats()["transfers"] == before
    # The prefill side's radix cache reused shared prefixes while computing them.
    assert pair.prefill.stats().cached_tokens_total > 0


def test_abort_storm_during_delayed_transfers(make_pair, make_engine, monkeypatch):
    """Aborts before the transfer starts (queued on the prefill side: cancelled), while its layers are being
    written (the abort is sent as each victim's header arrives, with 20 ms between layers), and at random times.
    The surviving requests' outputs equal the single engine's, the checker saw no slot freed or reused while
    written, and both pools are intact."""
    rng = random.Random(0)
    prompts = _tree_workload(36, seed=11)
    params = {"max_new_tokens": 6, **GREEDY}
    ref = make_engine("llama")
    want = [c.token_ids for c in ref.generate(prompts, params)]
    pair = make_pair(delay_s=0.02, kv_cache_tokens=1024)
    dec = pair.decode
    rids = [f"s{i}" for i in range(len(prompts))]
    mid_transfer = set(rids[0:24:3])  # aborted as their K/V starts arriving
    queued = set(rids[-6:])  # aborted right after submission: still queued behind the others
    at_random = set(rng.sample(rids[1:-6], 6)) - mid_transfer
    by_first_slot = {}  # a transfer's first destination slot -> its request id
    write = kv_transport.Channel.write_layer

    aborted_mid_write = []

    def write_and_abort(ch, pool, layer, slots, kv):
        write(ch, pool, layer, slots, kv)
        rid = by_first_slot.pop(int(slots[0]), None) if layer == 0 else None
        if rid in mid_transfer:
            dec.abort(rid)  # taken by the loop while the next layer is still to be written
            deadline = time.monotonic() + 10
            while rid in dec._pending and time.monotonic() < deadline:
                time.sleep(0.001)
            aborted_mid_write.append(rid)

    monkeypatch.setattr(kv_transport.Channel, "write_layer", write_and_abort)
    start = dec._start

    def start_and_note(prepared):
        start(prepared)
        p = dec._pending.get(prepared.request_id)
        if p is not None:
            by_first_slot[p.inc.slots[0]] = prepared.request_id

    dec._start = start_and_note
    streams = {rid: dec.stream(p, {**params, "request_id": rid}) for rid, p in zip(rids, prompts)}
    for rid in sorted(queued):
        dec.abort(rid)
    for rid in sorted(at_random):
        time.sleep(rng.uniform(0.0, 0.03))
        dec.abort(rid)
    out = {}
    for rid, it in streams.items():
        chunks = list(it)
        out[rid] = ([t for c in chunks for t in c.token_ids], chunks[-1].finish_reason)
    for rid, w in zip(rids, want):
        toks, reason = out[rid]
        if rid in mid_transfer | queued | at_random:
            assert reason in ("abort", "length"), (rid, reason)
            assert toks == w[: len(toks)], rid
        else:
            assert (toks, reason) == (w, "length"), rid
    dec.wait_idle()  # an aborted stream ends at once; its transfer's confirmation may still be on its way
    s = dec.transfer_stats()
    # Every abort taken mid-write is counted; an abort at random may land mid-write too (its timing is free).
    assert len(aborted_mid_write) >= 3, s
    assert len(aborted_mid_write) <= s["aborted_while_writing"] <= len(aborted_mid_write) + len(at_random), s
    assert s["cancelled"] > 0 and pair.worker.cancelled_total == s["cancelled"], s
    assert dec.core.kv.lifetime_violations == 0
    for eng in (dec, pair.prefill):
        assert_idle_and_clean(eng)
    # The pool still serves exactly: the survivors' prompts again, through the same decode cache.
    again = dec.generate(prompts[:8], params)
    assert [c.token_ids for c in again] == want[:8]


def test_a_prefill_worker_that_goes_away_is_confirmed_by_its_end_of_stream(make_pair, make_engine):
    """The prefill side closes while the decode side's requests are on their way: its end of stream confirms that nothing more
    will be written, the decode side computes those prompts itself (outputs unchanged), and later requests never go
    there."""
    prompts = _tree_workload(16, seed=21)
    params = {"max_new_tokens": 4, **GREEDY}
    want = [c.token_ids for c in make_engine("llama").generate(prompts, params)]
    pair = make_pair(delay_s=0.01)
    streams = [pair.decode.stream(p, params) for p in prompts]
    pair.worker.close()  # finishes what it computes now, answers nothing that arrives later
    got = [[t for c in it for t in c.token_ids] for it in streams]
    assert got == want
    s = pair.decode.transfer_stats()
    assert s["transfers"] + s["failed"] + s["not_fetched"] == len(prompts) and s["failed"] > 0, s
    assert [pair.decode.generate(p, params).token_ids for p in prompts[:4]] == want[:4]
    assert pair.decode.transfer_stats()["transfers"] == s["transfers"]  # nothing sent to a closed peer
