"""The cyclic garbage collector held off while an engine's loop has work, and run when it goes idle.

Why: CPython's collector runs when allocation counts cross its thresholds, on whichever thread allocates. On the
loop thread of a busy engine that is a pause at an arbitrary step: measured on an H200 host at batch 256, a
generation-2 pass took 23.5 ms and a generation-1 pass 14.5 ms, each longer than a 16 ms decode step, so the GPU
waited. The engine's long-lived objects are frozen at start-up (engine.py), and almost all per-step garbage is freed
by reference counting, so a collection during a busy stretch rarely frees anything it could not free a little later.

What: `BusyGC.busy()` when a loop starts working, `BusyGC.idle()` when it has nothing left; automatic collection is
off while any engine in the process is busy (a count: several engines may share the process) and, on the last
`idle()`, back on after one collection of the young generations. A stretch busy for longer than `max_busy_s` runs
one such collection on its next `busy()` call (the loop calls it every step), so cyclic garbage never piles up
for long. A process whose collector was already off is left alone.
"""

from __future__ import annotations

import gc
import threading
import time

_lock = threading.Lock()
_busy = 0  # engines busy now
_owned = False  # this module turned automatic collection off (and turns it back on)


class BusyGC:
    """One engine loop's side of it (not thread-safe: the loop thread's own)."""

    max_busy_s = 30.0

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._busy_since: float | None = None
        self.collections = 0  # young-generation passes this loop ran itself

    def busy(self) -> None:
        global _busy, _owned
        if not self.enabled:
            return
        now = time.monotonic()
        if self._busy_since is None:
            self._busy_since = now
            with _lock:
                _busy += 1
                if _busy == 1 and gc.isenabled():
                    gc.disable()
                    _owned = True
        elif now - self._busy_since > self.max_busy_s:
            self._busy_since = now
            self._collect()

    def idle(self) -> None:
        global _busy, _owned
        if not self.enabled or self._busy_since is None:
            return
        self._busy_since = None
        with _lock:  # (collected under the lock: an engine turning busy meanwhile finds the collector on)
            _busy -= 1
            if _busy == 0 and _owned:
                _owned = False
                self._collect()
                gc.enable()

    def _collect(self) -> None:
        gc.collect(1)
        self.collections += 1
