"""PrefillWorker: the prefill side of disaggregation (disagg/decode.py has the protocol and its abort contract).

It serves KVRequests from decode engines with an ordinary Engine: the prompt is computed there (cache_prefix: its
radix cache reuses what it holds), its cached path locked, and K/V sent layer by layer on the peer's stream.
"""

from __future__ import annotations

import concurrent.futures
import threading

import torch

from prefixrt.disagg.records import EndOfStream, KVHeader, KVRequest
from prefixrt.engine.engine import Engine
from prefixrt.parallel.kv_transport import TAG_TO_DECODE, TAG_TO_PREFILL, Channel, sleep_s


class PrefillWorker:
    """Serves KVRequests from decode engines with `engine` (which keeps serving its own requests too).

    Per decode peer: a listener thread, and up to `max_inflight` transfers computing at once on a thread pool (their
    prompts prefill together in the engine's batches); sending is one transfer at a time per peer, in the order
    they finish computing. A transfer starts when its header is sent: a Cancel before that is answered
    "cancelled" (its K/V, if computed, just stays in this engine's cache); after it, the transfer completes.
    delay_s (race mode) sleeps before each layer is sent."""

    def __init__(self, engine: Engine, group, decode_ranks=(0,), backend: str = "gloo", delay_s: float = 0.0,
                 max_inflight: int = 16):
        if not engine.config.radix_cache:
            raise ValueError("a prefill worker needs radix_cache=True (it sends K/V from its radix cache)")
        self.engine = engine
        self.delay_s = delay_s
        self.transfers_total = 0
        self.cancelled_total = 0
        self._peers = [_PrefillPeer(self, Channel(group, r, TAG_TO_DECODE, TAG_TO_PREFILL, backend), max_inflight)
                       for r in decode_ranks]
        for p in self._peers:
            p.start()

    def close(self, timeout: float = 30.0) -> None:
        """Finish the transfers in flight, end the stream to every peer and wait for theirs to end."""
        for p in self._peers:
            p.close(timeout)

    # ------------------------------------------------------------------ one transfer (a pool thread)
    def compute(self, req: KVRequest):
        """Prefill req.tokens in the engine and lock their cached path: (handle, slots). Raises if it cannot."""
        eng = self.engine
        n = len(req.tokens)
        for _ in range(3):  # the path may be evicted between the prefill and the lock: prefill again
            eng.cache_prefix(req.tokens, req.salt)
            locked = eng._run_on_loop(lambda: _lock_path(eng, req.tokens, req.salt, n))
            if locked is not None:
                return locked
        raise RuntimeError("the prompt's K/V could not be kept in the prefill engine's cache")

    def send(self, ch: Channel, req: KVRequest, slots: list[int]) -> None:
        """(Holding ch.send_lock.) The header, then every layer's K/V of positions [start, n)."""
        pool = self.engine.core.kv.pool
        n = len(req.tokens)
        idx = torch.tensor(slots[req.start:n], dtype=torch.int64, device=pool.device)
        ch.send_obj(KVHeader(req.xfer_id, "sending", num_tokens=n - req.start))
        for layer in range(pool.num_layers):  # started: always completes (the decode side holds its slots)
            sleep_s(self.delay_s)
            ch.send_layer(pool, layer, idx)
        self.transfers_total += 1

    def unlock(self, handle) -> None:
        eng = self.engine
        eng._run_on_loop(lambda: eng.core.kv.cache.unlock(handle))


def _lock_path(eng: Engine, tokens: list[int], salt, n: int):
    """(Loop thread.) Lock the cached path of tokens[:n]: (handle, its slots), or None if not all cached."""
    cache = eng.core.kv.cache
    m = cache.match_prefix(tokens, salt, max_len=n)
    if m.length < n:
        return None
    return cache.lock(m), list(m.slots)


class _PrefillPeer:
    """The prefill side of one decode peer. Transfer states (under _lock): queued -> computing -> sending -> done,
    or cancelled (answered) from queued, or cancel_requested from computing (answered before any header)."""

    def __init__(self, worker: PrefillWorker, ch: Channel, max_inflight: int):
        self.worker, self.ch = worker, ch
        self._lock = threading.Lock()
        self._state: dict[int, str] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_inflight, thread_name_prefix=f"prefixrt-prefill-{ch.peer}")
        self._closing = False
        self._end_sent = False
        self._listener = threading.Thread(target=self._listen, name=f"prefixrt-prefill-listen-{ch.peer}", daemon=True)

    def start(self) -> None:
        self._listener.start()

    def close(self, timeout: float) -> None:
        self._end_stream()
        self._listener.join(timeout)

    def _end_stream(self) -> None:
        """Once: no new transfers; those in flight finish (or are answered); then EndOfStream."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._pool.shutdown(wait=True)
        with self.ch.send_lock:
            self.ch.send_obj(EndOfStream())

    def _listen(self) -> None:
        while True:
            msg = self.ch.recv_obj()
            if isinstance(msg, EndOfStream):
                self._end_stream()
                return
            if isinstance(msg, KVRequest):
                with self._lock:
                    if self._closing:
                        continue  # after our end of stream: the decode side treats it as failed
                    self._state[msg.xfer_id] = "queued"
                    self._pool.submit(self._run, msg)
                continue
            with self._lock:  # a Cancel
                state = self._state.get(msg.xfer_id)
                if state == "computing":
                    self._state[msg.xfer_id] = "cancel_requested"
                if state != "queued":
                    continue  # being computed (answered before any header), sending (it completes), or done
                self._state[msg.xfer_id] = "cancelled"
            self._answer_cancelled(msg.xfer_id)

    def _answer_cancelled(self, xfer_id: int) -> None:
        self.worker.cancelled_total += 1
        with self.ch.send_lock:
            self.ch.send_obj(KVHeader(xfer_id, "cancelled"))
        with self._lock:
            self._state.pop(xfer_id, None)

    def _run(self, req: KVRequest) -> None:
        with self._lock:
            if self._state.get(req.xfer_id) != "queued":
                return  # cancelled while queued: answered already
            self._state[req.xfer_id] = "computing"
        try:
            handle, slots = self.worker.compute(req)
        except Exception as e:  # noqa: BLE001 - the decode side computes the prompt itself
            with self.ch.send_lock:
                self.ch.send_obj(KVHeader(req.xfer_id, "failed", error=str(e)))
            with self._lock:
                self._state.pop(req.xfer_id, None)
            return
        try:
            with self.ch.send_lock:
                with self._lock:
                    cancelled = self._state[req.xfer_id] == "cancel_requested"
                    self._state[req.xfer_id] = "sending"
                if cancelled:
                    self.worker.cancelled_total += 1
                    self.ch.send_obj(KVHeader(req.xfer_id, "cancelled"))
                else:
                    self.worker.send(self.ch, req, slots)
        finally:
            with self._lock:
                self._state.pop(req.xfer_id, None)
            self.worker.unlock(handle)
