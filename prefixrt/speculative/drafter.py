"""The Drafter interface and SpecState, a request's speculation state.

A drafter proposes up to k tokens that may follow a request's tokens (Req.all_ids), cheaply, on the host. It
gives no distribution: every draft is a point mass, and verification (rejection.py) keeps the target's
distribution exactly whatever the drafter proposes; a bad drafter costs speed, never correctness. Drafters run
on the loop thread and may keep per-request state in Req.spec (a SpecState) and global state of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefixrt.request import Req


@dataclass
class SpecState:
    """Per-request speculation state (Req.spec): the adaptive draft length's acceptance average and step
    counter, and a drafter's own record (the n-gram index)."""

    acceptance: float = 1.0  # moving average of accepted / drafted (optimistic start)
    steps: int = 0  # decode steps seen while speculation was possible
    drafter: Any = None
    extra: dict = field(default_factory=dict)


class Drafter:
    """Proposes draft tokens for a request. Subclasses implement propose()."""

    name = "drafter"

    def propose(self, req: Req, k: int, cache=None) -> list[int]:
        """Up to k tokens that may follow req.all_ids (fewer or none when it has no guess). cache: the engine's
        prefix cache (read only), for drafters that look up cached continuations. Must not change req beyond
        req.spec.drafter."""
        raise NotImplementedError

    def on_finished(self, req: Req) -> None:
        """req finished (any reason): a drafter that learns from outputs may record them."""
