"""StageClock: where a start-up's seconds go, stage by named stage (the engine's `start-up:` line).

Stages nest, and each second is charged to the innermost stage running: a `resolve` that converts a checkpoint
reports only its own bookkeeping, the conversion's stages report theirs, and the stages never overlap, so their
sum is the time they cover. Whatever no stage covers is the remainder of `total()`, printed as `other`.
One clock belongs to one start-up, on one thread.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class StageClock:
    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = {}  # stage -> seconds charged to it, in the order stages first ran
        self._running: list[str] = []  # the stages open now, innermost last
        self._since = self.started  # when the innermost open stage was last charged

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Charge the time inside the block to `name` (less any stage opened inside it); a name timed twice adds
        up. Nothing is charged to a stage that raises before it ends but the seconds it ran."""
        self._charge()
        self._running.append(name)
        self.seconds.setdefault(name, 0.0)
        try:
            yield
        finally:
            self._charge()
            self._running.pop()

    def total(self) -> float:
        """Seconds since the clock was made."""
        return time.perf_counter() - self.started

    def named(self) -> float:
        """Seconds charged to named stages so far."""
        return sum(self.seconds.values())

    def summary(self) -> str:
        """`12.3s: resolve 0.1s, load 2.0s, ..., other 0.2s (98% named)` for the time since the clock was made."""
        total = self.total()
        parts = [f"{name} {seconds:.1f}s" for name, seconds in self.seconds.items()]
        parts.append(f"other {max(total - self.named(), 0.0):.1f}s")
        share = self.named() / total if total > 0 else 1.0
        return f"{total:.1f}s: {', '.join(parts)} ({share:.0%} named)"

    def _charge(self) -> None:
        now = time.perf_counter()
        if self._running:
            self.seconds[self._running[-1]] += now - self._since
        self._since = now
