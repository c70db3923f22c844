"""A test drafter with a fixed acceptance rate: it drafts the target's own greedy token with probability p and a
wrong token otherwise (seeded), so a benchmark or a test can set how often drafts are accepted.

It knows the target's greedy continuation from outputs it has seen: every finished greedy request's output is
recorded under its prompt (`on_finished`), or given directly (`teach`); a request whose output so far follows a
recorded one gets the recorded next tokens, each replaced by a wrong one with probability 1 - p. Without a
record it drafts nothing. Run a prompt once to teach it, then again to speculate.
"""

from __future__ import annotations

import random

from prefixrt.request import Req
from prefixrt.speculative.drafter import Drafter


class FixedRateDrafter(Drafter):
    name = "fixed"

    def __init__(self, p: float, vocab_size: int, seed: int = 0):
        self.p = p
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.records: dict[tuple[int, ...], list[int]] = {}

    def teach(self, prompt_ids: list[int], output_ids: list[int]) -> None:
        self.records[tuple(prompt_ids)] = list(output_ids)

    def on_finished(self, req: Req) -> None:
        if req.params.greedy and req.finish_reason in ("stop", "length") and req.output_ids:
            key = tuple(req.prompt_ids)
            if len(req.output_ids) > len(self.records.get(key, ())):
                self.teach(req.prompt_ids, req.output_ids)

    def propose(self, req: Req, k: int, cache=None) -> list[int]:
        rec = self.records.get(tuple(req.prompt_ids))
        out = req.output_ids
        if rec is None or len(rec) <= len(out) or rec[: len(out)] != out:
            return []
        drafts = rec[len(out): len(out) + k]
        return [t if self.rng.random() < self.p else (t + 1 + self.rng.randrange(self.vocab_size - 1))
                % self.vocab_size for t in drafts]
