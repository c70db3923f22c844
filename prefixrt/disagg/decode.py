"""Prefill/decode disaggregation: prefill engines compute prompts' K/V and send it to a decode engine, which
publishes it in its own radix cache and decodes. Each side is a full Engine with its own pool and radix cache.

Data flow for one request on the decode engine (DecodeEngine):
  1. prepare (caller's thread, as usual), then on the loop thread: KVReceiver.begin (cache/kv_receive.py) locks what the decode
     cache already holds of prompt[:-1] and allocates pages for the rest; a KVRequest(start, tokens) goes to a
     prefill peer (round robin). The last prompt token is always computed here (it samples the first token).
  2. The prefill side (PrefillWorker, disagg/prefill.py) runs the prompt through its Engine (cache_prefix: its radix cache reuses
     what it has), locks the path, sends a header and then K/V layer by layer, and unlocks.
  3. The decode side's receiving thread writes each layer into the reserved slots and marks it; after the last
     one the loop publishes the pages in the radix cache (KVReceiver.finish) and admits the request, which matches
     the whole prefix and decodes. A failed or missing peer falls back to computing the prompt locally.

Abort contract (the production bug: a decode engine reused an aborted request's slots while a transfer was still
writing them): the decode side frees a transfer's slots only after the prefill side has confirmed, on the same
ordered stream, that the transfer never started (header "cancelled") or has completed (every layer delivered),
or has ended the stream (EndOfStream: nothing more comes). An abort therefore unlocks the prefix, sends Cancel, and
hands the pages to KVManager's hold (KVReceiver.abandon); they return to the allocator at the first reclaim after
the confirmation. A transfer starts when its header is sent: a Cancel before that is answered "cancelled"; one
that started always completes (bounded by its size).
Checked in debug mode: freed slots are poisoned, the receiver verifies before every layer that its slots are
still its own, and the allocator side refuses pages whose transfer is pending (KVManager.lifetime_violations).
Race mode (delay_s > 0 on the prefill side) delays each layer so aborts land mid-transfer.

Threads: the decode loop owns every KVManager call; per peer, one sender thread (records out) and one receiver
thread (headers, layers, end of stream in; it writes the pool and marks Transfers, nothing else), which hands completions
to the loop through the engine's inbox. On the prefill side, per peer one listener thread and a pool of transfer
threads (prompts prefill concurrently, in the engine's batches; one transfer sends at a time).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from prefixrt.default_models import BASE_MODEL
from prefixrt.disagg.prefill import PrefillWorker
from prefixrt.disagg.records import Cancel, EndOfStream, KVHeader, KVRequest
from prefixrt.engine.engine import Engine
from prefixrt.parallel.kv_transport import TAG_TO_DECODE, TAG_TO_PREFILL, Channel, local_groups

log = logging.getLogger("prefixrt")


# ---------------------------------------------------------------------------------------------- decode side
@dataclass
class _Pending:
    prepared: Any  # engine.PreparedRequest
    inc: Any  # cache.kv_receive.IncomingKV
    peer: int


class DecodeEngine(Engine):
    """An Engine whose prompts' K/V comes from prefill workers (see the module docstring). Until `connect` is
    called (or with no live peer) it computes prompts itself, like a plain Engine.

    transfer_stats(): transfers completed (their tokens, bytes, seconds from header to last layer), transfers
    cancelled before they started, failed ones (computed here instead), requests aborted during their transfer,
    requests not fetched (already cached here, one-token prompt, no live peer or no free pages); of the aborted,
    those whose K/V was being written at the abort."""

    def __init__(self, model: str = BASE_MODEL, **kwargs: Any):
        if str(kwargs.get("speculative") or "").startswith("draft:"):  # received K/V would have no draft K/V
            raise ValueError("a decode engine cannot use a draft model (its prompts' K/V arrives by copy)")
        super().__init__(model, **kwargs)
        self._links: list[_DecodeLink] = []
        self._rr = itertools.count()
        self._xfer_ids = itertools.count(1)
        self._pending: dict[str, _Pending] = {}  # request id -> its transfer (loop thread only)
        self._xfers: dict[int, Any] = {}  # transfer id -> IncomingKV (receivers read it)
        self._xfers_lock = threading.Lock()
        self._stats = {"transfers": 0, "tokens": 0, "bytes": 0, "seconds": 0.0, "cancelled": 0, "failed": 0, "not_fetched": 0,
                       "aborted_during_transfer": 0, "aborted_while_writing": 0}

    def connect(self, group, prefill_ranks, backend: str = "gloo") -> None:
        """Start streams to the prefill workers at these ranks of `group` (call once, before serving)."""
        for r in prefill_ranks:
            link = _DecodeLink(self, Channel(group, r, TAG_TO_PREFILL, TAG_TO_DECODE, backend))
            self._links.append(link)
            link.start()

    # ------------------------------------------------------------------ submission (caller's thread)
    def _hand_over(self, prepared) -> None:  # Engine.enqueue's last step: fetch the prompt's K/V first
        self._post(lambda: self._start(prepared))

    def abort(self, request_id: str) -> None:
        if not self._stopped:
            self._post(lambda: self._abort(request_id))

    def _post(self, fn) -> None:
        """Run fn on the loop thread, in inbox order (after everything enqueued before it)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.add_done_callback(lambda f: f.exception() and log.error("disaggregation step failed: %r", f.exception()))
        self._inbox.put(("call", fn, fut))

    # ------------------------------------------------------------------ the loop thread
    def _start(self, prepared) -> None:
        core, kv = self.core, self.core.kv
        ids = prepared.prompt_ids
        live = [link for link in self._links if link.alive]
        inc = None
        if live and len(ids) > 1:
            inc = kv.receiver.begin(ids[:-1], prepared.params.cache_salt)
        if inc is not None:
            link = live[next(self._rr) % len(live)]
            xfer_id = next(self._xfer_ids)
            inc.meta.update(peer=link, xfer_id=xfer_id)
            with self._xfers_lock:  # (the receiver marks a closed peer's transfers under this lock)
                if link.alive:
                    self._xfers[xfer_id] = inc
                    self._pending[prepared.request_id] = _Pending(prepared, inc, link.ch.peer)
                    link.send(KVRequest(xfer_id, inc.tokens, inc.salt, inc.start))
                    return
            inc.transfer.mark_all()  # never sent: nothing will write its pages
            kv.receiver.abandon(inc)
        # Nothing to fetch (already cached here, or a one-token prompt), no live peer, or no pages: computed here.
        self._stats["not_fetched"] += 1
        core.add(prepared.reqs)

    def _abort(self, rid: str) -> None:
        p = self._pending.pop(rid, None)
        if p is None:
            self.core.abort(rid)
            return
        inc = p.inc
        self._stats["aborted_during_transfer"] += 1
        if inc.meta.get("writing") and not inc.transfer.query():
            self._stats["aborted_while_writing"] += 1
        self.core.kv.receiver.abandon(inc)  # the pages wait for the prefill side's confirmation
        inc.meta["peer"].send(Cancel(inc.meta["xfer_id"]))
        self.core.finish_unscheduled(p.prepared.reqs, "abort")

    def _done(self, xfer_id: int, status: str) -> None:
        """(Loop thread.) A transfer is confirmed: complete, cancelled, or failed/closed."""
        with self._xfers_lock:
            inc = self._xfers.pop(xfer_id, None)
        kv = self.core.kv
        if inc is None:  # confirmed twice (completed, then the peer closed): the first one counted
            return
        rid = next((r for r, p in self._pending.items() if p.inc is inc), None)
        if rid is None:  # aborted meanwhile: its pages were held for this confirmation
            kv.reclaim()
            return
        p = self._pending.pop(rid)
        if status == "complete":
            kv.receiver.finish(inc)
            s = self._stats
            s["transfers"] += 1
            s["tokens"] += len(inc.slots)
            s["bytes"] += inc.meta.get("bytes", 0)
            s["seconds"] += inc.meta.get("seconds", 0.0)
        else:
            if status == "failed":
                log.warning("KV transfer %d failed (%s): computing the prompt locally", xfer_id, inc.transfer.error)
                self._stats["failed"] += 1
            kv.receiver.abandon(inc)
        self.core.add(p.prepared.reqs)

    # ------------------------------------------------------------------ receiving (receiver threads)
    def _receive(self, link: _DecodeLink, hdr: KVHeader) -> None:
        with self._xfers_lock:
            inc = self._xfers[hdr.xfer_id]
        t = inc.transfer
        if hdr.status != "sending":
            if hdr.status == "cancelled":
                self._stats["cancelled"] += 1
            t.mark_all(None if hdr.status == "cancelled" else RuntimeError(hdr.error or "failed"))
            self._post(lambda: self._done(hdr.xfer_id, "cancelled" if hdr.status == "cancelled" else "failed"))
            return
        assert hdr.num_tokens == len(inc.slots), f"sender has {hdr.num_tokens} tokens, {len(inc.slots)} slots reserved"
        kv = self.core.kv
        pool = kv.pool
        t0 = time.perf_counter()
        before = link.ch.bytes_received
        idx = torch.tensor(inc.slots, dtype=torch.int64, device=pool.device)
        inc.meta["writing"] = True
        for layer in range(pool.num_layers):
            data = link.ch.recv_layer(pool, hdr.num_tokens)
            if kv.debug and not kv.receiver.target_ok(inc):
                log.error("KV transfer %d: its slots were freed or reused while it was writing", hdr.xfer_id)
            link.ch.write_layer(pool, layer, idx, data)
            t.events[layer].set()
        inc.meta["seconds"] = time.perf_counter() - t0
        inc.meta["bytes"] = link.ch.bytes_received - before
        self._post(lambda: self._done(hdr.xfer_id, "complete"))

    def _peer_closed(self, link: _DecodeLink) -> None:
        """(Receiver thread.) The peer ended its stream: nothing more will be written for its transfers."""
        with self._xfers_lock:
            link.alive = False
            mine = [(x, inc) for x, inc in self._xfers.items()
                    if inc.meta.get("peer") is link and not inc.transfer.query()]  # (done ones are confirmed)
        for x, inc in mine:
            inc.transfer.mark_all(RuntimeError("the prefill worker closed its stream"))
            self._post(lambda x=x: self._done(x, "failed"))

    # ------------------------------------------------------------------ reporting and shutdown
    def transfer_stats(self) -> dict:
        return self._run_on_loop(lambda: dict(self._stats))

    def stats(self):
        """EngineStats; requests whose K/V is on its way count as waiting."""
        if self._stopped or not self._thread.is_alive():
            return super().stats()

        def snapshot():
            s = self.core.snapshot_stats()
            s.requests_waiting += len(self._pending)
            return s

        return self._run_on_loop(snapshot)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Also waits until no transfer is pending (a held receive included)."""
        deadline = time.monotonic() + timeout
        while self._run_on_loop(lambda: bool(self._pending or self._xfers or self.core.kv.receiver.pending)):
            if time.monotonic() > deadline:
                raise TimeoutError("transfers still pending")
            self._run_on_loop(self.core.kv.reclaim)
            time.sleep(0.01)
        super().wait_idle(max(0.0, deadline - time.monotonic()))

    def shutdown(self) -> None:
        if self._stopped:
            return
        if self._links:
            self._run_on_loop(lambda: [self._abort(rid) for rid in list(self._pending)])
            try:
                self.wait_idle(60.0)
            except TimeoutError:
                log.error("shutting down with KV transfers still unconfirmed")
            for link in self._links:
                link.close()
        super().shutdown()


class _DecodeLink:
    """The decode side of one prefill peer: a sender thread (records out) and a receiver thread."""

    def __init__(self, engine: DecodeEngine, ch: Channel):
        self.engine, self.ch = engine, ch
        self.alive = True  # False once the peer ended its stream: no new transfers go to it
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._end_sent = threading.Event()
        self._end_received = threading.Event()
        self._threads = [threading.Thread(target=self._send_loop, name=f"prefixrt-decode-send-{ch.peer}", daemon=True),
                         threading.Thread(target=self._recv_loop, name=f"prefixrt-decode-recv-{ch.peer}", daemon=True)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def send(self, msg) -> None:
        self._out.put(msg)

    def close(self, timeout: float = 30.0) -> None:
        if not self._end_sent.is_set():
            self._out.put(EndOfStream())
        self._end_received.wait(timeout)
        self._out.put(None)
        for t in self._threads:
            t.join(timeout)

    def _send_loop(self) -> None:
        while True:
            msg = self._out.get()
            if msg is None:
                return
            if self._end_sent.is_set():
                continue  # after the end of the stream nothing more may go out
            self.ch.send_obj(msg)
            if isinstance(msg, EndOfStream):
                self._end_sent.set()

    def _recv_loop(self) -> None:
        try:
            while True:
                msg = self.ch.recv_obj()
                if isinstance(msg, EndOfStream):
                    return
                self.engine._receive(self, msg)
        except Exception:  # noqa: BLE001 - a broken stream: treat as closed
            log.exception("KV stream from rank %d broke", self.ch.peer)
        finally:
            self.engine._peer_closed(self)  # (sets alive False)
            self._end_received.set()
            if not self._end_sent.is_set():
                self._out.put(EndOfStream())


# ---------------------------------------------------------------------------------------------- in-process pair
class DisaggPair:
    """A prefill engine and a decode engine in this process, joined by a gloo group (threads as ranks): the
    in-process form of `prefixrt serve --role prefill` + `--role decode`. Use `pair.decode` as the Provider.

    DisaggPair(model, prefill_kwargs=None, decode_kwargs=None, delay_s=0.0, **engine_kwargs); `_parts` (tests)
    is passed to both engines (they then share the injected model's weights)."""

    def __init__(self, model: str = BASE_MODEL, prefill_kwargs: dict | None = None,
                 decode_kwargs: dict | None = None, delay_s: float = 0.0, **kwargs: Any):
        self.prefill = Engine(model, **{**kwargs, **(prefill_kwargs or {})})
        try:
            self.decode = DecodeEngine(model, **{**kwargs, **(decode_kwargs or {})})
        except BaseException:
            self.prefill.shutdown()
            raise
        group_decode, group_prefill = local_groups(2)
        self.worker = PrefillWorker(self.prefill, group_prefill, decode_ranks=(0,), delay_s=delay_s)
        self.decode.connect(group_decode, prefill_ranks=(1,))

    def shutdown(self) -> None:
        self.decode.shutdown()
        self.worker.close()
        self.prefill.shutdown()

    def __enter__(self) -> DisaggPair:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
