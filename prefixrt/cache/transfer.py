"""KVTransfer: batched K/V copies between the device pool and the host pool, layer by layer, off the loop.

Every copy — a load (host -> pool), a backup (pool -> host), a host poisoning in debug mode — goes through one
FIFO: on CUDA one load stream, on the CPU one worker thread. Invariants:
- FIFO order makes host slots reusable at once: a copy into a host slot freed by eviction runs after every
  earlier copy that read it. Device slots have no such luck (the forward runs on another stream/thread): a
  device slot written by a load or read by a backup returns to the allocator only once that Transfer is done
  (KVManager tracks it, see kv_manager.py).
- A Transfer has one completion mark per layer, set in layer order: layer i's mark passing means layers
  0..i are copied. A forward waits on layer i's mark before layer i's attention reads the pool (LoadWaiter),
  so layer i+1 loads while layer i computes.
- A backup waits for the forwards already launched (CUDA: the load stream waits on the compute stream), so it
  copies K/V that is fully written.
Race mode (delay_s > 0): every layer of every copy is delayed (a sleep on the worker, a spin kernel on the
stream) so a missing wait reads slots that are not loaded yet: poisoned with NaN in debug mode.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from prefixrt.cache.host_pool import HostKVPool
from prefixrt.cache.kv_pool import KVPool


class Transfer:
    """One batched copy of num_tokens tokens' K/V, all layers."""

    def __init__(self, kind: str, num_layers: int, num_tokens: int, cuda: bool):
        self.kind = kind  # "load" | "backup" | "receive" (K/V written by another engine: parallel/kv_transport.py)
        self.num_tokens = num_tokens
        self.cuda = cuda
        self.error: BaseException | None = None
        self.seconds: float | None = None  # copy time, once known
        self._done = False
        if cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.events = [torch.cuda.Event(enable_timing=(i == num_layers - 1)) for i in range(num_layers)]
        else:
            self.events = [threading.Event() for _ in range(num_layers)]

    def layer_ready(self, layer: int) -> None:
        """Make the caller's work wait for layer `layer` of this copy (CUDA: the current stream waits; CPU: the
        calling thread blocks)."""
        if self.cuda:
            torch.cuda.current_stream().wait_event(self.events[layer])
            return
        self.events[layer].wait()
        if self.error is not None:
            raise RuntimeError(f"KV {self.kind} failed: {self.error}")

    def mark_all(self, error: BaseException | None = None) -> None:
        """(CPU marks) Every layer is done: written, or never to be written (a cancelled or failed receive)."""
        self.error = error
        for ev in self.events:
            ev.set()

    def query(self) -> bool:
        if not self._done:
            self._done = self.events[-1].query() if self.cuda else self.events[-1].is_set()
            if self._done and self.cuda:
                self.seconds = self.start.elapsed_time(self.events[-1]) / 1000
        return self._done

    def wait(self) -> None:
        if not self._done:
            if self.cuda:
                self.events[-1].synchronize()
            else:
                self.events[-1].wait()
            self.query()


class LoadWaiter:
    """What one forward waits on: the loads in flight when it was launched. The model calls wait(i) before layer
    i's attention; a CUDA-graph replay calls wait_all() first. check() (debug) asserts each layer was waited."""

    def __init__(self, loads: list[Transfer], num_layers: int):
        self.loads = loads
        self.waited = [False] * num_layers

    def wait(self, layer: int) -> None:
        for t in self.loads:
            t.layer_ready(layer)
        self.waited[layer] = True

    def wait_all(self) -> None:
        last = len(self.waited) - 1  # marks are set in layer order: the last implies the others
        for t in self.loads:
            t.layer_ready(last)
        self.waited = [True] * len(self.waited)

    def check(self) -> None:
        missing = [i for i, w in enumerate(self.waited) if not w]
        assert not missing, f"layers {missing} read the pool without waiting for the loads in flight"


class _Mark:
    def __init__(self, cuda: bool):
        self.event = torch.cuda.Event() if cuda else threading.Event()

    def query(self) -> bool:
        return self.event.query() if isinstance(self.event, torch.cuda.Event) else self.event.is_set()

    def wait(self) -> None:
        if isinstance(self.event, torch.cuda.Event):
            self.event.synchronize()
        else:
            self.event.wait()


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """Contiguous runs of slots: (first, end, offset into slots)."""
    out, i = [], 0
    while i < len(slots):
        j = i + 1
        while j < len(slots) and slots[j] == slots[j - 1] + 1:
            j += 1
        out.append((slots[i], slots[i] + (j - i), i))
        i = j
    return out


class KVTransfer:
    def __init__(self, pool: KVPool, host: HostKVPool, delay_s: float = 0.0, debug: bool = False):
        self.pool = pool
        self.host = host
        self.delay_s = delay_s
        self.debug = debug
        self.cuda = pool.device.type == "cuda"
        self.num_layers = pool.num_layers
        # Counters (read by stats()): transfers, tokens and seconds per direction.
        self.totals = {"load": [0, 0, 0.0], "backup": [0, 0, 0.0]}
        self._unaccounted: list[Transfer] = []
        self._loads: list[Transfer] = []  # loads not yet seen complete
        if self.cuda:
            self.stream = torch.cuda.Stream(pool.device)
        else:
            self._queue: queue.SimpleQueue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._work, name="prefixrt-kv-transfer", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ issuing
    def load(self, host_slots: list[int], gpu_slots: list[int]) -> Transfer:
        assert len(host_slots) == len(gpu_slots)
        t = Transfer("load", self.num_layers, len(gpu_slots), self.cuda)
        self._issue(t, host_slots, gpu_slots)
        self._loads.append(t)
        self._account(t)
        return t

    def backup(self, gpu_slots: list[int], host_slots: list[int]) -> Transfer:
        assert len(host_slots) == len(gpu_slots)
        t = Transfer("backup", self.num_layers, len(gpu_slots), self.cuda)
        self._issue(t, host_slots, gpu_slots)
        self._account(t)
        return t

    def _account(self, t: Transfer) -> None:
        self._unaccounted.append(t)
        if len(self._unaccounted) > 256:  # fold the finished ones into the totals (bounded memory)
            self.stats()

    def poison_host(self, host_slots: list[int]) -> None:
        """Debug: NaN into freed host slots, in FIFO order after the copies that may still read them (CPU)."""
        if self.cuda or not host_slots:
            return
        self._queue.put(("poison", list(host_slots)))

    def marker(self) -> _Mark:
        """A mark in the FIFO: passed once every copy issued before it is done (query/wait)."""
        m = _Mark(self.cuda)
        if self.cuda:
            m.event.record(self.stream)
        else:
            self._queue.put(("mark", m.event))
        return m

    def barrier(self) -> None:
        """Wait until every copy (and debug poisoning) issued so far is done: host slots then touched from the
        calling thread cannot race a copy still reading or writing them."""
        self.marker().wait()

    def pending_loads(self) -> list[Transfer]:
        """Loads not known to be complete (a forward must wait for these)."""
        if self._loads:
            self._loads = [t for t in self._loads if not t.query()]
        return self._loads

    def stats(self) -> dict:
        keep = []
        for t in self._unaccounted:
            if t.query():
                tot = self.totals[t.kind]
                tot[0] += 1
                tot[1] += t.num_tokens
                tot[2] += t.seconds or 0.0
            else:
                keep.append(t)
        self._unaccounted = keep
        return self.totals

    def wait_all(self) -> None:
        for t in list(self._unaccounted):
            t.wait()

    def close(self) -> None:
        if not self.cuda and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=10)

    # ------------------------------------------------------------------ the copies
    def _issue(self, t: Transfer, host_slots: list[int], gpu_slots: list[int]) -> None:
        if not self.cuda:
            self._queue.put(("copy", t, list(host_slots), list(gpu_slots)))
            return
        compute = torch.cuda.current_stream(self.pool.device)
        s = self.stream
        if t.kind == "backup" or self.debug:  # a backup reads K/V written by forwards already launched; in
            s.wait_stream(compute)  # debug mode a load also follows the NaN poisoning of its freshly freed slots
        kvh, d = self.pool.num_kv_heads, self.pool.head_dim
        n = len(gpu_slots)
        runs = _runs(host_slots)
        with torch.cuda.stream(s):
            idx = torch.tensor(gpu_slots, dtype=torch.int64).pin_memory().to(self.pool.device, non_blocking=True)
            t.start.record(s)
            for layer in range(self.num_layers):
                if self.delay_s > 0:
                    torch.cuda._sleep(int(self.delay_s * 1.5e9))
                for dev_buf, host_buf in ((self.pool.k_buffers[layer], self.host.k_buffers[layer]),
                                          (self.pool.v_buffers[layer], self.host.v_buffers[layer])):
                    if t.kind == "load":
                        tmp = torch.empty((n, kvh, d), dtype=dev_buf.dtype, device=dev_buf.device)
                        for a, b, off in runs:
                            tmp[off: off + b - a].copy_(host_buf[a:b], non_blocking=True)
                        dev_buf.index_copy_(0, idx, tmp)
                    else:
                        tmp = dev_buf.index_select(0, idx)
                        for a, b, off in runs:
                            host_buf[a:b].copy_(tmp[off: off + b - a], non_blocking=True)
                t.events[layer].record(s)

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if job[0] == "poison":
                self.host.poison(job[1])
                continue
            if job[0] == "mark":
                job[1].set()
                continue
            _, t, host_slots, gpu_slots = job
            t0 = time.perf_counter()
            try:
                h = torch.tensor(host_slots, dtype=torch.int64)
                g = torch.tensor(gpu_slots, dtype=torch.int64)
                for layer in range(self.num_layers):
                    if self.delay_s > 0:
                        time.sleep(self.delay_s)
                    for dev_buf, host_buf in ((self.pool.k_buffers[layer], self.host.k_buffers[layer]),
                                              (self.pool.v_buffers[layer], self.host.v_buffers[layer])):
                        if t.kind == "load":
                            dev_buf.index_copy_(0, g, host_buf.index_select(0, h))
                        else:
                            host_buf.index_copy_(0, h, dev_buf.index_select(0, g))
                    t.seconds = time.perf_counter() - t0
                    t.events[layer].set()
            except BaseException as e:  # never leave a waiter hanging: mark every layer, with the error
                t.error = e
                for ev in t.events:
                    ev.set()
