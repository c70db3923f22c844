"""DecodeEstimate: how many more tokens a request is expected to decode, for admission that knows the budget.

The scheduler admits a waiting request only if the pool can hold, besides its own prompt and expected decode,
what every running request still needs: the rest of its prompt plus its expected decode growth. A request's
expected growth is its remaining max_new_tokens (clipped at CLIP: a client asking for the whole context should
not block admission) times `ratio`, the fraction of their budget that finished requests used (an exponential
average, starting at INIT). A retraction means the estimate was too low: the ratio then steps up. With
ignore_eos (benchmarks) every request uses its whole budget and the ratio converges to 1.
"""

from __future__ import annotations

import math

from prefixrt.request import Req


class DecodeEstimate:
    CLIP = 4096  # max_new_tokens counted at most this much
    INIT = 0.7  # before any request has finished
    FLOOR = 0.05
    WEIGHT = 0.1  # of each finished request in the average
    RETRACT_STEP = 0.1  # added after a retraction

    def __init__(self):
        self.ratio = self.INIT

    def remaining(self, req: Req) -> int:
        """Tokens req is expected to add to its K/V by decoding (at least one while it may still decode)."""
        done = len(req.output_ids) + req.num_unresolved
        left = req.params.max_new_tokens - done
        if left <= 0:
            return 0
        return max(1, math.ceil((min(req.params.max_new_tokens, self.CLIP) - done) * self.ratio))

    def finished(self, req: Req) -> None:
        """req finished on its own (stop or length): fold the share of its budget it used into the ratio."""
        budget = min(req.params.max_new_tokens, self.CLIP)
        if budget <= 0:
            return
        used = min(1.0, len(req.output_ids) / budget)
        self.ratio = max(self.FLOOR, (1 - self.WEIGHT) * self.ratio + self.WEIGHT * used)

    def retracted(self) -> None:
        self.ratio = min(1.0, self.ratio + self.RETRACT_STEP)
