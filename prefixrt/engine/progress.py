"""ProgressWatch: whether an engine loop that has work is making progress, from its step count.

A scheduler loop can be alive and still stuck: a hung kernel, a deadlock, a step that never returns. Its step
counter (`EngineCore.steps_done`) then stops while it has work (`EngineCore.has_work`). The watch is fed
(steps, busy) observations (by Engine.health on the caller's side, by the engine process's heartbeats for
ProcessEngine) and reports a stall once the count has not moved for `stall_timeout_s` while busy. An idle loop
never stalls. Observations may come from any thread; the last one wins.
"""

from __future__ import annotations

import time

DEFAULT_STALL_TIMEOUT_S = 60.0  # as vLLM's engine iteration timeout: a step longer than this is a hang


class ProgressWatch:
    def __init__(self, stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S):
        self.stall_timeout_s = stall_timeout_s
        self._steps = -1
        self._busy = False
        self._moved_at = time.monotonic()  # when the step count last changed, or the loop last went idle

    def observe(self, steps: int, busy: bool, now: float | None = None) -> None:
        """Record the loop's step count and whether it has work."""
        now = time.monotonic() if now is None else now
        if steps != self._steps or not busy:
            self._moved_at = now
        self._steps, self._busy = steps, busy

    def stall(self, now: float | None = None) -> str | None:
        """Why the loop counts as stuck (busy, no step for stall_timeout_s), or None."""
        now = time.monotonic() if now is None else now
        idle_for = now - self._moved_at
        if self._busy and idle_for > self.stall_timeout_s:
            return (f"the engine loop has made no progress for {idle_for:.0f} s with requests to run "
                    "(a hung kernel or a deadlock)")
        return None
