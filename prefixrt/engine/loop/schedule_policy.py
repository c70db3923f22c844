"""Scheduling policies: the order in which waiting requests are admitted.

- fcfs: arrival order.
- lpm: longest cached prefix first, pool and host tier alike (maximises reuse while the prefix is still
  in the cache).
- dfs: depth-first over the radix tree, heaviest subtrees (most waiting requests) first, so requests
  sharing a prefix run back to back (SGLang's DFS-weight).
All policies put aged requests (waiting longer than aging_s) first, in arrival order, so nothing waits
unboundedly, and respect `priority` (higher first) before the policy key. With `service` (lpm and fcfs), the
session's attained service (engine/loop/sessions.py) comes next: least attained service first.
"""

from __future__ import annotations

from collections.abc import Callable

from prefixrt.cache.base import MatchResult
from prefixrt.config.engine_config import POLICIES
from prefixrt.request import Req


def order_waiting(
    waiting: list[Req],
    policy: str,
    match: Callable[[Req], MatchResult],
    now: float,
    aging_s: float,
    service: Callable[[Req], int] | None = None,
) -> list[Req]:
    aged = [r for r in waiting if now - r.arrival >= aging_s]
    fresh = [r for r in waiting if now - r.arrival < aging_s]
    aged.sort(key=lambda r: r.arrival)
    attained = (lambda r: 0) if service is None else service  # noqa: E731
    if policy == "fcfs":
        fresh.sort(key=lambda r: (-r.params.priority, attained(r), r.arrival))
    elif policy == "lpm":
        lengths = {id(r): _cached_len(match(r)) for r in fresh}
        fresh.sort(key=lambda r: (-r.params.priority, attained(r), -lengths[id(r)], r.arrival))
    elif policy == "dfs":
        fresh = _dfs_order(fresh, match)
    else:
        raise ValueError(f"unknown schedule_policy {policy!r}; choose one of {POLICIES}")
    return aged + fresh


def _cached_len(m: MatchResult) -> int:
    """Tokens of a match cached in any tier: a host-tier hit loads in a fraction of its recomputation's time."""
    return m.length + m.host_length


def _dfs_order(reqs: list[Req], match: Callable[[Req], MatchResult]) -> list[Req]:
    """Group requests by the tree node their match ends at, weight each node by the requests below it, and
    emit a depth-first walk that visits heavier children first. Requests with no match keep arrival order
    at the end. Reads the tree only through match handles (no mutation)."""
    by_node: dict[int, list[Req]] = {}
    nodes: dict[int, object] = {}
    unmatched: list[Req] = []
    for r in reqs:
        m = match(r)
        if m.handle is None:
            unmatched.append(r)
            continue
        by_node.setdefault(id(m.handle), []).append(r)
        nodes[id(m.handle)] = m.handle
    weight: dict[int, int] = {}
    children: dict[int, list[object]] = {}
    roots: dict[int, object] = {}
    for nid, node in nodes.items():
        w = len(by_node[nid])
        cur = node
        while cur is not None and getattr(cur, "parent", None) is not None:
            weight[id(cur)] = weight.get(id(cur), 0) + w
            parent = cur.parent
            if parent.parent is None:
                roots[id(cur)] = cur
            else:
                kids = children.setdefault(id(parent), [])
                if all(k is not cur for k in kids):
                    kids.append(cur)
            cur = parent
    out: list[Req] = []

    def visit(node):
        out.extend(sorted(by_node.get(id(node), []), key=lambda r: (-r.params.priority, r.arrival)))
        for child in sorted(children.get(id(node), []), key=lambda c: -weight[id(c)]):
            visit(child)

    for root in sorted(roots.values(), key=lambda c: -weight[id(c)]):
        visit(root)
    return out + sorted(unmatched, key=lambda r: (-r.params.priority, r.arrival))
