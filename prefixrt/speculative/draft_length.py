"""Adaptive draft length: how many tokens to draft for a request this step.

Per request, a moving average of its acceptance (accepted / drafted). Off when the decode batch is larger than
max_batch (verification then costs more than it saves), or while the average is below min_acceptance (then one
probe step every probe_every steps, so a request whose text turns repetitive gets speculation back); the full
length at or above half acceptance, half of it below.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixrt.request import Req


@dataclass
class _Acceptance:
    acceptance: float = 1.0  # moving average of accepted / drafted (optimistic start)
    steps: int = 0  # decode steps seen while speculation was possible


class AdaptiveDraftLength:
    def __init__(self, max_tokens: int, max_batch: int = 32, min_acceptance: float = 0.2, probe_every: int = 8,
                 decay: float = 0.7, adaptive: bool = True):
        self.max_tokens = max_tokens
        self.max_batch = max_batch
        self.min_acceptance = min_acceptance
        self.probe_every = probe_every
        self.decay = decay
        self.adaptive = adaptive
        self._requests: dict[Req, _Acceptance] = {}  # each speculating request's average (forget() drops it)

    def length(self, req: Req, batch_size: int) -> int:
        if not self.adaptive:
            return self.max_tokens
        if batch_size > self.max_batch:
            return 0
        s = self._requests.get(req)
        if s is None:
            s = self._requests[req] = _Acceptance()
        s.steps += 1
        if s.acceptance < self.min_acceptance:
            return 1 if s.steps % self.probe_every == 0 else 0
        return self.max_tokens if s.acceptance >= 0.5 else max(1, self.max_tokens // 2)

    def update(self, req: Req, drafted: int, accepted: int) -> None:
        s = self._requests.get(req)
        if drafted <= 0 or s is None:
            return
        s.acceptance = self.decay * s.acceptance + (1 - self.decay) * (accepted / drafted)

    def acceptance(self, req: Req) -> float | None:
        """req's moving average of accepted / drafted (None before its first speculating step)."""
        s = self._requests.get(req)
        return None if s is None else s.acceptance

    def forget(self, req: Req) -> None:
        """req finished: drop its average."""
        self._requests.pop(req, None)
