"""KVTransfer: batched K/V copies between the device pool and the host pool, layer by layer, off the loop.

Every copy — a load (host -> pool), a backup (pool -> host), a host poisoning in debug mode — goes through one
FIFO: on CUDA one load stream, on the CPU one worker thread. The host tier is page-first (host_pool.py) and the
pool layer-first: on CUDA a copy moves each run of consecutive host slots (every layer at once) in one DMA to or
from a device staging buffer, and one indexed op per K/V scatters it into (or gathers it from) every layer of
the pool, chunk by chunk (STAGING_BYTES). Invariants:
- FIFO order makes host slots reusable at once: a copy into a host slot freed by eviction runs after every
  earlier copy that read it. Device slots have no such luck (the forward runs on another stream/thread): a
  device slot written by a load or read by a backup returns to the allocator only once that Transfer is done
  (KVManager tracks it, see kv_manager.py).
- A Transfer has one completion mark per layer, set in layer order: layer i's mark passing means layers
  0..i are copied. A forward waits on layer i's mark before layer i's attention reads the pool (LoadWaiter).
  On CUDA all marks pass together (a copy moves every layer at once); the CPU copier sets them layer by layer.
- A backup waits for the forwards already launched (CUDA: the load stream waits on the compute stream), so it
  copies K/V that is fully written.
Race mode (delay_s > 0): every layer of every copy is delayed (a sleep on the worker, a spin kernel on the
stream) so a missing wait reads slots that are not loaded yet: poisoned with NaN in debug mode.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time

import torch

from prefixrt.cache.host_lists import int64_tensor
from prefixrt.cache.host_pool import HostKVPool
from prefixrt.cache.kv_pool import KVPool, byte_view

# Device staging for one chunk of a copy (bytes): host runs land here by DMA, then one scatter per K/V puts them
# into the layer-first pool (a load; a backup gathers first). Larger chunks amortise the scatter; this bounds the
# device memory a copy borrows.
STAGING_BYTES = 256 * 2**20


class Transfer:
    """One batched copy of num_tokens tokens' K/V, all layers. `seq` orders the copies of one FIFO (KVTransfer):
    a copy with a higher seq completes after every copy with a lower one."""

    _seq = itertools.count()

    def __init__(self, kind: str, num_layers: int, num_tokens: int, cuda: bool):
        self.kind = kind  # "load" | "backup" | "receive" (K/V written by another engine: parallel/kv_transport.py)
        self.seq = next(Transfer._seq)
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

    def busy(self) -> bool:
        """Some copy (load or backup) issued is not done yet."""
        return any(not t.query() for t in self._unaccounted)

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
        if self.cuda:
            self.stream.synchronize()
        self.host.close()

    # ------------------------------------------------------------------ the copies
    def _chunk_tokens(self) -> int:
        return max(1, STAGING_BYTES // self.host.bytes_per_token)

    def _issue(self, t: Transfer, host_slots: list[int], gpu_slots: list[int]) -> None:
        if not self.cuda:
            self._queue.put(("copy", t, list(host_slots), list(gpu_slots)))
            return
        compute = torch.cuda.current_stream(self.pool.device)
        s = self.stream
        if t.kind == "backup" or self.debug:  # a backup reads K/V written by forwards already launched; in
            s.wait_stream(compute)  # debug mode a load also follows the NaN poisoning of its freshly freed slots
        pool, host = self.pool, self.host
        n, step = len(gpu_slots), self._chunk_tokens()
        with torch.cuda.stream(s):
            idx = int64_tensor(gpu_slots).pin_memory().to(pool.device, non_blocking=True)
            staging = torch.empty((min(n, step), *host.kv.shape[1:]), dtype=host.kv.dtype, device=pool.device)
            t.start.record(s)
            if self.delay_s > 0:
                torch.cuda._sleep(int(self.delay_s * self.num_layers * 1.5e9))
            for c in range(0, n, step):  # staging chunks: one DMA per run of host slots, one scatter per K/V
                m = min(step, n - c)
                buf, ids = staging[:m], idx[c:c + m]
                runs = _runs(host_slots[c:c + m])
                if t.kind == "load":
                    for a, b, off in runs:
                        buf[off: off + b - a].copy_(host.kv[a:b], non_blocking=True)
                    byte_view(pool.k_all).index_copy_(1, ids, byte_view(buf[:, :, 0]).transpose(0, 1))
                    byte_view(pool.v_all).index_copy_(1, ids, byte_view(buf[:, :, 1]).transpose(0, 1))
                else:
                    byte_view(buf[:, :, 0]).copy_(byte_view(pool.k_all).index_select(1, ids).transpose(0, 1))
                    byte_view(buf[:, :, 1]).copy_(byte_view(pool.v_all).index_select(1, ids).transpose(0, 1))
                    for a, b, off in runs:
                        host.kv[a:b].copy_(buf[off: off + b - a], non_blocking=True)
            for ev in t.events:  # all layers land together (layer i's mark still means layers 0..i are copied)
                ev.record(s)

    def _work(self) -> None:
        """The CPU copier (one thread): layer by layer, each layer's mark set as it lands (race mode: a delay
        before each layer), so per-layer waits are exercised on the CPU as the forward would need them."""
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
                block = self.host.kv.index_select(0, h) if t.kind == "load" else None  # [n, layers, 2, kvh, d]
                for layer in range(self.num_layers):
                    if self.delay_s > 0:
                        time.sleep(self.delay_s)
                    if t.kind == "load":
                        byte_view(self.pool.k_buffers[layer]).index_copy_(0, g, byte_view(block[:, layer, 0]))
                        byte_view(self.pool.v_buffers[layer]).index_copy_(0, g, byte_view(block[:, layer, 1]))
                    else:
                        kv = torch.stack((self.pool.k_buffers[layer].index_select(0, g),
                                          self.pool.v_buffers[layer].index_select(0, g)), dim=1)
                        byte_view(self.host.kv[:, layer]).index_copy_(0, h, byte_view(kv))
                    t.seconds = time.perf_counter() - t0
                    t.events[layer].set()
            except BaseException as e:  # never leave a waiter hanging: mark every layer, with the error
                t.error = e
                for ev in t.events:
                    ev.set()
