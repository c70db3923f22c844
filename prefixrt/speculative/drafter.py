"""The Drafter interface.

A drafter proposes up to k tokens that may follow a request's tokens (Req.all_ids), cheaply, on the host. It
gives no distribution: every draft is a point mass, and verification (rejection.py) keeps the target's
distribution exactly whatever the drafter proposes; a bad drafter costs speed, never correctness. Drafters run
on the loop thread and may keep state of their own, per request (keyed by the Req, dropped in on_finished) or
global.
"""

from __future__ import annotations

from prefixrt.request import Req


class Drafter:
    """Proposes draft tokens for a request. Subclasses implement propose()."""

    name = "drafter"

    def propose(self, req: Req, k: int, cache=None) -> list[int]:
        """Up to k tokens that may follow req.all_ids (fewer or none when it has no guess). cache: the engine's
        prefix cache (read only), for drafters that look up cached continuations. Must not change req."""
        raise NotImplementedError

    def on_finished(self, req: Req) -> None:
        """req finished (any reason): a drafter that learns from outputs may record them; one that keeps state per
        request drops req's."""
