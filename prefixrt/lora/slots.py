"""AdapterSlots: which LoRA adapter each GPU slot holds, an LRU of the resident ones, and their loads.

The model's target linears hold a fixed number of slots (model/lora.py LoraWeights). An adapter is resident when
its weights are in one; its host copy (registry.py PackedAdapter, pinned on CUDA) is what a load copies. A load
goes to a free slot, else to the least recently used slot that no admitted request holds; it runs beside the
forwards (a CUDA side stream / a worker thread on the CPU) and a request is admitted only once its adapter's load
is complete (`ready`), so a request waiting for its adapter never stalls the batch.

Contracts (checked by tests/lora/test_engine_lora.py's delayed loads):
- A slot is written only while no admitted request holds it (refs == 0) and no forward still to run can read it:
  on CUDA the load stream first waits for every forward launched so far; on the CPU each forward completes before
  the loop goes on.
- A request is admitted under a slot only after the slot's load has completed (`ready` polls it, never blocks).
All methods run on the loop thread.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class _Slot:
    digest: str | None = None  # the adapter it holds (or is loading); None: free
    refs: int = 0  # admitted requests running under it
    load: Any = None  # the load in flight (a CUDA event or a Future); None once complete
    load_started: float = 0.0
    last_used: int = 0  # LRU tick


class AdapterSlots:
    def __init__(self, num_slots: int, device: torch.device, load_delay_s: float = 0.0):
        """load_delay_s: race mode (tests): every load first sleeps this long on the worker (CPU only)."""
        self.device = torch.device(device)
        self.slots = [_Slot() for _ in range(num_slots)]
        self.by_digest: dict[str, int] = {}
        self._tick = itertools.count(1)
        self.load_delay_s = load_delay_s
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._worker = None if self._stream is not None else concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="prefixrt-lora-load")
        self.loads_total = 0
        self.load_seconds_total = 0.0
        self.load_seconds: dict[str, float] = {}  # digest -> seconds of its loads so far
        # Seconds with at least one load in flight (the union of the loads' intervals, not their sum): a run's
        # share of wall time spent loading adapters, however many loads overlap one another
        self._busy_done = 0.0  # of the busy periods that have ended
        self._busy_since: float | None = None  # start of the busy period now (None: no load in flight)
        self._in_flight = 0
        # (start, seen complete) of recent loads, time.perf_counter(): how much of a run had a load in flight
        self.load_intervals: collections.deque = collections.deque(maxlen=1 << 16)
        self.on_loaded = None  # callback(digest, seconds) when a load completes (the manager's stats)

    # ------------------------------------------------------------------ queries
    @property
    def num_resident(self) -> int:
        """Slots holding a completely loaded adapter."""
        self._poll_all()
        return sum(1 for s in self.slots if s.digest is not None and s.load is None)

    @property
    def load_busy_seconds_total(self) -> float:
        """Seconds so far with at least one load in flight (the current busy period up to now included)."""
        since = self._busy_since
        return self._busy_done + (time.perf_counter() - since if since is not None else 0.0)

    def slot_of(self, digest: str) -> int | None:
        return self.by_digest.get(digest)

    def ready(self, digest: str) -> bool:
        """Whether the adapter is resident with its load complete (polls the load; never blocks)."""
        i = self.by_digest.get(digest)
        if i is None:
            return False
        return self._poll(self.slots[i])

    def _poll(self, slot: _Slot) -> bool:
        load = slot.load
        if load is None:
            return True
        done = load.query() if isinstance(load, torch.cuda.Event) else load.done()
        if not done:
            return False
        if not isinstance(load, torch.cuda.Event):
            load.result()  # a failed copy raises here, on the loop thread
        slot.load = None
        now = time.perf_counter()
        spent = now - slot.load_started
        self.load_intervals.append((slot.load_started, now))
        self.loads_total += 1
        self.load_seconds_total += spent
        self.load_seconds[slot.digest] = self.load_seconds.get(slot.digest, 0.0) + spent
        self._in_flight -= 1
        if self._in_flight == 0:
            self._busy_done += now - self._busy_since
            self._busy_since = None
        if self.on_loaded is not None:
            self.on_loaded(slot.digest, spent)
        return True

    def _poll_all(self) -> None:
        for s in self.slots:
            if s.load is not None:
                self._poll(s)

    # ------------------------------------------------------------------ loads
    def request(self, digest: str, copy_into, keep: frozenset[str] | set[str] = frozenset(),
                spare: frozenset[str] | set[str] = frozenset()) -> bool:
        """Make the adapter resident: True if it is (or its load has started), False if no slot can take it now
        (every slot is held by admitted requests, loading, or holds an adapter in `keep`: those the requests ahead
        in line need). Slots holding an adapter in `spare` (others waiting requests need) go last. copy_into(slot)
        writes its weights into a slot (on the load stream / worker)."""
        if digest in self.by_digest:
            return True
        victim = self._victim(keep, spare)
        if victim is None:
            return False
        slot = self.slots[victim]
        if slot.digest is not None:
            del self.by_digest[slot.digest]
        slot.digest, slot.refs, slot.last_used = digest, 0, next(self._tick)
        slot.load_started = time.perf_counter()
        self.by_digest[digest] = victim
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # forwards that may read the old one
            with torch.cuda.stream(self._stream):
                copy_into(victim)
                event = torch.cuda.Event()
                event.record(self._stream)
            slot.load = event
        else:
            delay = self.load_delay_s

            def run():
                if delay:
                    time.sleep(delay)
                copy_into(victim)

            slot.load = self._worker.submit(run)
        if self._in_flight == 0:
            self._busy_since = slot.load_started
        self._in_flight += 1
        return True

    def _victim(self, keep: frozenset[str] | set[str], spare: frozenset[str] | set[str]) -> int | None:
        """A free slot, else the least recently used one that nothing holds, that is not loading and whose adapter
        is not in keep, one whose adapter is not in spare first."""
        free = [i for i, s in enumerate(self.slots) if s.digest is None]
        if free:
            return free[0]
        self._poll_all()
        idle = [i for i, s in enumerate(self.slots) if s.refs == 0 and s.load is None and s.digest not in keep]
        return min(idle, key=lambda i: (self.slots[i].digest in spare, self.slots[i].last_used)) if idle else None

    # ------------------------------------------------------------------ holding
    def acquire(self, digest: str) -> int:
        """An admitted request runs under the adapter (which must be ready): its slot, held until release."""
        i = self.by_digest[digest]
        slot = self.slots[i]
        assert slot.load is None, "a request admitted under an adapter whose load is not complete"
        slot.refs += 1
        slot.last_used = next(self._tick)
        return i

    def release(self, digest: str) -> None:
        slot = self.slots[self.by_digest[digest]]
        assert slot.refs > 0, "LoRA slot released more often than acquired"
        slot.refs -= 1
        slot.last_used = next(self._tick)

    def drop(self, digest: str) -> None:
        """Forget a resident adapter nothing holds (it was unloaded): its slot becomes free."""
        i = self.by_digest.get(digest)
        if i is None:
            return
        slot = self.slots[i]
        if slot.refs:
            raise RuntimeError("a LoRA slot held by admitted requests cannot be dropped")
        if slot.load is not None:  # a load still writes it: the slot is free once it is done
            self._wait(slot)
        del self.by_digest[digest]
        self.slots[i] = _Slot()

    def _wait(self, slot: _Slot) -> None:
        load = slot.load
        if isinstance(load, torch.cuda.Event):
            load.synchronize()
        else:
            load.result()
        self._poll(slot)

    def check(self) -> None:
        """Debug: the slot table agrees with itself."""
        held = {s.digest: i for i, s in enumerate(self.slots) if s.digest is not None}
        assert held == self.by_digest, f"LoRA slots {held} != index {self.by_digest}"
        assert all(s.refs >= 0 for s in self.slots)

    def close(self) -> None:
        for s in self.slots:
            if s.load is not None:
                self._wait(s)
        if self._worker is not None:
            self._worker.shutdown(wait=True)
