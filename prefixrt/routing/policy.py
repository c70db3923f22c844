"""Routing policies for data-parallel replicas: which replica serves a prompt (token ids).

A policy is a check-then-commit pair: `choose(ids)` decides and mutates nothing; `routed(replica, ids)` records
that the request went there (it now counts as that replica's load and, for the cache-aware policy, its prompt
is in that replica's approximate tree); `finished(replica)` ends it. Front-ends (the HTTP router, the Ray Serve
request router) call the three around each request. Replicas are any hashable keys (URLs, Ray replica ids).

CacheAwarePolicy decides in this order:
1. Eligible replicas: the healthy candidates that are not *overloaded*. A replica is overloaded when its load
   (requests routed and not finished) exceeds the least-loaded candidate's by more than `balance_abs_threshold`
   AND by more than a factor `balance_rel_threshold`. So a hot prefix cannot pile onto one replica: once its
   replica is that far ahead, the prefix spills to another (which then caches it too).
2. Hit: among eligible replicas, the one whose tree matches the most leading tokens, if that match is at least
   `cache_threshold` of the prompt (ties: the less loaded, then the hash order below).
3. Miss: the least-loaded eligible replica; ties go to the one that took fewer requests recently (an
   exponentially decayed count), then to a hash of (the prompt's first block, replica) — rendezvous hashing.
   Both tie-breaks spread misses: many new prefixes arriving while loads are equal do not all land on one
   replica (a first-index tie-break does that), and a replica is never picked for holding the smallest cache
   (which ignores load and keeps feeding a busy replica whose unique prompts build no shared tree).
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from prefixrt.routing.tree import ApproxPrefixTree, block_keys

Replica = Hashable


@dataclass(frozen=True)
class Decision:
    """Where a request goes and why: reason is "hit" (longest match), "miss" (least loaded) or "balance" (the
    best match was on an overloaded replica); matched_tokens is the chosen replica's approximate cache match."""

    replica: Replica
    reason: str
    matched_tokens: int = 0


class NoReplicaError(RuntimeError):
    """No healthy replica to route to."""


def _rendezvous(seed: int, replica: Replica) -> int:
    """A per-(prompt, replica) hash that is the same in every process (Python's str hash is salted)."""
    digest = hashlib.blake2b(f"{seed}|{replica!r}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class _LoadBook:
    """In-flight requests per replica (routed, not finished) and a decayed count of recent routings."""

    def __init__(self, recent_half_life: float):
        self.decay = 0.5 ** (1.0 / recent_half_life)
        self.in_flight: dict[Replica, int] = {}
        self.recent: dict[Replica, float] = {}
        self.total: dict[Replica, int] = {}

    def add(self, r: Replica) -> None:
        self.in_flight.setdefault(r, 0)
        self.recent.setdefault(r, 0.0)
        self.total.setdefault(r, 0)

    def remove(self, r: Replica) -> None:
        for d in (self.in_flight, self.recent, self.total):
            d.pop(r, None)

    def routed(self, r: Replica) -> None:
        for k in self.recent:
            self.recent[k] *= self.decay
        self.recent[r] += 1.0
        self.in_flight[r] += 1
        self.total[r] += 1

    def finished(self, r: Replica) -> None:
        if self.in_flight.get(r, 0) > 0:
            self.in_flight[r] -= 1


class RoutingPolicy:
    """The interface every policy implements (see the module docstring for the call order)."""

    def __init__(self, replicas: Iterable[Replica] = (), recent_half_life: float = 256.0):
        self.loads = _LoadBook(recent_half_life)
        self.healthy: dict[Replica, bool] = {}
        for r in replicas:
            self.add_replica(r)

    @property
    def replicas(self) -> list[Replica]:
        return list(self.healthy)

    def add_replica(self, r: Replica) -> None:
        self.healthy.setdefault(r, True)
        self.loads.add(r)

    def remove_replica(self, r: Replica) -> None:
        self.healthy.pop(r, None)
        self.loads.remove(r)

    def set_healthy(self, r: Replica, healthy: bool) -> None:
        if r in self.healthy:
            self.healthy[r] = healthy

    def _candidates(self, candidates: Iterable[Replica] | None) -> list[Replica]:
        pool = self.replicas if candidates is None else [r for r in candidates if r in self.healthy]
        pool = [r for r in pool if self.healthy[r]]
        if not pool:
            raise NoReplicaError("no healthy replica")
        return pool

    def choose(self, token_ids: Sequence[int], candidates: Iterable[Replica] | None = None) -> Decision:
        """Where a request with these prompt ids should go, among `candidates` (default: every replica).
        Mutates nothing. Raises NoReplicaError when none is healthy."""
        raise NotImplementedError

    def routed(self, replica: Replica, token_ids: Sequence[int]) -> None:
        """The request was sent to `replica`: it counts as that replica's load until finished()."""
        self.loads.routed(replica)

    def finished(self, replica: Replica) -> None:
        """A request routed to `replica` ended (completed, failed or aborted)."""
        self.loads.finished(replica)

    def stats(self) -> dict:
        return {"replicas": {repr(r) if not isinstance(r, str) else r: {
            "healthy": self.healthy[r], "in_flight": self.loads.in_flight[r], "routed": self.loads.total[r]}
            for r in self.healthy}}


class RoundRobinPolicy(RoutingPolicy):
    """Each request to the next healthy replica in turn (the cache-blind baseline)."""

    def __init__(self, replicas: Iterable[Replica] = (), **kwargs):
        super().__init__(replicas, **kwargs)
        self._next = 0

    def choose(self, token_ids: Sequence[int], candidates: Iterable[Replica] | None = None) -> Decision:
        pool = self._candidates(candidates)
        return Decision(pool[self._next % len(pool)], "round_robin")

    def routed(self, replica: Replica, token_ids: Sequence[int]) -> None:
        super().routed(replica, token_ids)
        self._next += 1


class CacheAwarePolicy(RoutingPolicy):
    """Longest approximate prefix match, unless load is imbalanced; misses to the least-loaded replica."""

    def __init__(self, replicas: Iterable[Replica] = (), *, block_size: int = 16, cache_threshold: float = 0.5,
                 balance_abs_threshold: int = 16, balance_rel_threshold: float = 1.5,
                 max_tree_tokens: int = 1 << 20, recent_half_life: float = 256.0):
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_abs_threshold < 0 or balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        self.block_size = block_size
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_tokens = max_tree_tokens
        self.trees: dict[Replica, ApproxPrefixTree] = {}
        super().__init__(replicas, recent_half_life=recent_half_life)

    def add_replica(self, r: Replica) -> None:
        super().add_replica(r)
        self.trees.setdefault(r, ApproxPrefixTree(self.block_size, self.max_tree_tokens))

    def remove_replica(self, r: Replica) -> None:
        super().remove_replica(r)
        self.trees.pop(r, None)

    def set_capacity(self, r: Replica, kv_tokens: int) -> None:
        """Size replica r's tree to its KV capacity (what it can actually keep cached)."""
        if r in self.trees:
            self.trees[r].set_max_tokens(max(kv_tokens, self.block_size))

    def overloaded(self, pool: Sequence[Replica]) -> set[Replica]:
        """Replicas of `pool` whose load is beyond both thresholds above the least-loaded one's."""
        load = self.loads.in_flight
        least = min(load[r] for r in pool)
        return {r for r in pool if load[r] - least > self.balance_abs_threshold
                and load[r] > self.balance_rel_threshold * least}

    def choose(self, token_ids: Sequence[int], candidates: Iterable[Replica] | None = None) -> Decision:
        pool = self._candidates(candidates)
        keys = block_keys(token_ids, self.block_size)
        seed = keys[0] if keys else hash(tuple(token_ids))
        load, recent = self.loads.in_flight, self.loads.recent
        matched = {r: self.trees[r].match(keys) for r in pool}
        hot = self.overloaded(pool)
        eligible = [r for r in pool if r not in hot]  # never empty: the least-loaded replica is not overloaded
        best = max(eligible, key=lambda r: (matched[r], -load[r], _rendezvous(seed, r)))
        if matched[best] > 0 and matched[best] >= self.cache_threshold * len(token_ids):
            return Decision(best, "hit", matched[best])
        target = min(eligible, key=lambda r: (load[r], recent[r], -_rendezvous(seed, r)))
        best_anywhere = max(matched.values())
        spilled = best_anywhere > matched[target] and best_anywhere >= self.cache_threshold * len(token_ids)
        return Decision(target, "balance" if spilled else "miss", matched[target])

    def routed(self, replica: Replica, token_ids: Sequence[int]) -> None:
        super().routed(replica, token_ids)
        self.trees[replica].insert(block_keys(token_ids, self.block_size))

    def stats(self) -> dict:
        out = super().stats()
        for r, tree in self.trees.items():
            out["replicas"][repr(r) if not isinstance(r, str) else r]["tree_tokens"] = tree.num_tokens
        return out


POLICIES = {"cache_aware": CacheAwarePolicy, "round_robin": RoundRobinPolicy}


def make_policy(name: str, replicas: Iterable[Replica] = (), **kwargs) -> RoutingPolicy:
    """A policy by name ("cache_aware" | "round_robin"); kwargs go to its constructor."""
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}")
    if name == "round_robin":
        kwargs = {k: v for k, v in kwargs.items() if k == "recent_half_life"}
    return POLICIES[name](replicas, **kwargs)
