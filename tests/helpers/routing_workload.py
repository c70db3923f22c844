"""The routing acceptance workload: GROUPS prefix groups x PER_GROUP chat requests, interleaved at random.

Every request of a group shares the group's system prompt (~60 tokens of the tiny tokenizer) and has its own
short user question, so a replica that has served a group reuses ~70% of the next prompt of that group. Each
replica's KV pool (REPLICA_KV_TOKENS) holds about a quarter of the groups' prefixes and the single-replica
reference gets the four pools' memory (4 x REPLICA_KV_TOKENS), which holds them all: cache-aware routing can
match the single replica only by keeping each group on one replica, and round robin, which sends every group
everywhere, thrashes every pool.

The figures: the hit rate is sum(cached_tokens) / sum(prompt_tokens) over all requests (what the replicas
report per request), and the load of a replica is the number of requests it served.
"""

from __future__ import annotations

import os
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

GROUPS, PER_GROUP, REPLICAS = 32, 16, 4
REPLICA_KV_TOKENS = 768
# The smoke copy the HTTP router and Ray Serve tests run (each replica pool holds two groups' prefixes of ~85
# tokens and the requests in flight): 8 groups x 16 requests. PREFIXRT_ROUTING_FULL=1 runs them on the full
# workload instead (docs/serving.md reports both).
SMOKE_GROUPS, SMOKE_PER_GROUP, SMOKE_KV_TOKENS = 8, 16, 256
if os.environ.get("PREFIXRT_ROUTING_FULL") == "1":
    SMOKE_GROUPS, SMOKE_PER_GROUP, SMOKE_KV_TOKENS = GROUPS, PER_GROUP, REPLICA_KV_TOKENS
_WORDS = ("alpha beta gamma delta fox dog cache radix tree prefix token value shared prompt stitch nine Paris "
          "France answer question key items name quick brown lazy time saves").split()


@dataclass(frozen=True)
class Request:
    group: int
    messages: list


def workload(groups: int = GROUPS, per_group: int = PER_GROUP, seed: int = 0) -> list[Request]:
    """groups x per_group chat requests in a seeded random order (the same list on every call)."""
    rng = random.Random(seed)
    systems = [" ".join(rng.choice(_WORDS) for _ in range(17)) for g in range(groups)]
    reqs = [Request(g, [{"role": "system", "content": systems[g]},
                        {"role": "user", "content": f"q{i} {rng.choice(_WORDS)}?"}])
            for g in range(groups) for i in range(per_group)]
    rng.shuffle(reqs)
    return reqs


@dataclass
class Figures:
    hit_rate: float
    loads: list[int]

    @property
    def busiest_over_mean(self) -> float:
        return max(self.loads) / (sum(self.loads) / len(self.loads))

    def __str__(self) -> str:
        return f"hit rate {self.hit_rate:.3f}, loads {self.loads}, busiest/mean {self.busiest_over_mean:.2f}"


def figures(usages: list[tuple[object, int, int]], replicas: list) -> Figures:
    """usages: (replica, prompt_tokens, cached_tokens) per request."""
    prompt = sum(u[1] for u in usages)
    cached = sum(u[2] for u in usages)
    return Figures(cached / prompt, [sum(1 for u in usages if u[0] == r) for r in replicas])


def check_acceptance(cache_aware: Figures, single: Figures, round_robin: Figures) -> None:
    """The brief's three lines, with the figures in the message."""
    msg = f"cache-aware: {cache_aware}; single: {single}; round robin: {round_robin}"
    assert cache_aware.hit_rate >= 0.9 * single.hit_rate, msg
    assert cache_aware.hit_rate >= 2.0 * round_robin.hit_rate, msg
    assert cache_aware.busiest_over_mean <= 1.5, msg


def run_routed(engines: dict, policy, keys, reqs, concurrency: int = 4):
    """Send every request through `policy` (choose, routed, finished) to its engine; usage per request."""
    lock = threading.Lock()

    def one(req):
        ids = keys.chat_ids(req.messages)
        with lock:
            d = policy.choose(ids)
            policy.routed(d.replica, ids)
        try:
            c = engines[d.replica].generate(req.messages, {"max_new_tokens": 1, "temperature": 0.0})
        finally:
            with lock:
                policy.finished(d.replica)
        return d.replica, c.prompt_tokens, c.cached_tokens

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, reqs))
