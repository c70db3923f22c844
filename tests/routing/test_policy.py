"""Unit tests of the approximate prefix tree and the routing policies (no engines: exact expected values)."""

from __future__ import annotations

import random

import pytest

from prefixrt.routing.policy import CacheAwarePolicy, NoReplicaError, RoundRobinPolicy, make_policy
from prefixrt.routing.tree import ApproxPrefixTree, block_keys


def ids(seed: int, n: int = 64) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def test_block_keys_name_whole_prefixes():
    a, b = ids(1, 40), ids(1, 40)
    b[20] += 1  # differs in the third block of 8
    ka, kb = block_keys(a, 8), block_keys(b, 8)
    assert len(ka) == 5  # 40 // 8 full blocks; a trailing partial block is not recorded
    assert ka[:2] == kb[:2] and all(x != y for x, y in zip(ka[2:], kb[2:]))
    assert block_keys(a[:7], 8) == []


def test_tree_match_insert_and_lookups_do_not_mutate():
    t = ApproxPrefixTree(block_size=4, max_tokens=1000)
    p = ids(2, 20)
    assert t.match(block_keys(p, 4)) == 0
    t.insert(block_keys(p, 4))
    assert t.match(block_keys(p, 4)) == 20
    assert t.match(block_keys(p[:13], 4)) == 12  # full blocks only
    q = p[:8] + ids(3, 12)
    assert t.match(block_keys(q, 4)) == 8
    before = list(t._blocks)
    t.match(block_keys(q, 4))
    assert list(t._blocks) == before and t.num_tokens == 20


def test_lru_pruning_removes_leaves_first_and_keeps_paths_whole():
    t = ApproxPrefixTree(block_size=4, max_tokens=16)  # 4 blocks
    a = ids(4, 12)  # 3 blocks
    b = a[:4] + ids(5, 8)  # shares a's first block, 2 blocks of its own
    t.insert(block_keys(a, 4))
    t.insert(block_keys(b, 4))  # 5 blocks recorded -> the least recent (a's leaf) goes
    assert t.num_tokens == 16
    assert t.match(block_keys(b, 4)) == 12  # b whole
    assert t.match(block_keys(a, 4)) == 8  # a lost its leaf, not its root
    t.insert(block_keys(ids(6, 8), 4))  # two more blocks: a's remaining own block and b's leaf go
    assert t.match(block_keys(b, 4)) == 8 and t.match(block_keys(a, 4)) == 4
    t.set_max_tokens(4)
    assert t.num_tokens == 4  # only a root block is left: never a block without its parent


def route(policy, prompt, finish=True):
    d = policy.choose(prompt)
    policy.routed(d.replica, prompt)
    if finish:
        policy.finished(d.replica)
    return d


def test_same_prefix_goes_to_the_replica_that_has_it():
    p = CacheAwarePolicy(["a", "b", "c", "d"], block_size=8)
    prefix = ids(7, 48)
    first = route(p, prefix + ids(100, 8))
    assert first.reason == "miss"
    for i in range(20):
        d = route(p, prefix + ids(200 + i, 8))
        assert (d.replica, d.reason, d.matched_tokens) == (first.replica, "hit", 48)


@pytest.mark.parametrize("finish", [True, False])
def test_misses_spread_evenly_whatever_the_loads(finish):
    """Distinct new prefixes while every replica looks the same (sequential traffic: all loads 0; or a burst:
    none finished) are spread over the replicas, not all sent to one (first-index tie-break)."""
    p = CacheAwarePolicy(["a", "b", "c", "d"], block_size=8)
    got = [route(p, ids(1000 + i), finish=finish) for i in range(40)]
    assert all(d.reason == "miss" for d in got)
    counts = {r: sum(d.replica == r for d in got) for r in "abcd"}
    assert set(counts.values()) == {10}, counts


def test_a_busy_replica_with_a_small_tree_gets_no_misses():
    """Misses go by load, never to the replica with the smallest tree: a replica busy with unique short
    prompts (no shared tree) is not fed all new traffic while the others idle."""
    p = CacheAwarePolicy(["busy", "x", "y"], block_size=8)
    for i in range(30):  # in flight on "busy": prompts shorter than a block, so its tree stays empty
        p.routed("busy", ids(i, 5))
    for r in ("x", "y"):
        for i in range(5):
            p.routed(r, ids(300 + 7 * i + ord(r), 64))
            p.finished(r)
    assert p.trees["busy"].num_tokens == 0 < p.trees["x"].num_tokens
    got = [route(p, ids(5000 + i)) for i in range(30)]
    assert all(d.replica != "busy" for d in got)
    assert {d.replica for d in got} == {"x", "y"}


def test_a_hot_prefix_spills_when_its_replica_is_overloaded():
    """One prefix, many requests in flight: it stays on its replica until that one is overloaded (load beyond
    the least-loaded by more than abs AND rel thresholds), then spills; the spread stays bounded."""
    p = CacheAwarePolicy(["a", "b", "c"], block_size=8, balance_abs_threshold=4, balance_rel_threshold=1.5)
    prefix = ids(9, 48)
    got = [route(p, prefix + ids(700 + i, 8), finish=False) for i in range(60)]
    first = got[0].replica
    assert all(d.replica == first for d in got[:5]) and got[5].replica != first  # load 5 > 0 + 4 and > 1.5 * 0
    assert got[5].reason == "balance"
    loads = p.loads.in_flight
    assert max(loads.values()) - min(loads.values()) <= 5 + 1
    assert sum(loads.values()) == 60
    # the spilled-to replicas now hold the prefix too: hits there
    assert any(d.reason == "hit" and d.replica != first for d in got[6:])


def test_cache_threshold_and_a_short_shared_header():
    """A match below cache_threshold of the prompt (e.g. only the chat template's header) is a miss: it does
    not drag new prefixes to the one replica that saw the header first."""
    p = CacheAwarePolicy(["a", "b"], block_size=4, cache_threshold=0.5)
    header = ids(10, 8)
    route(p, header + ids(11, 56))
    got = [route(p, header + ids(20 + i, 56)) for i in range(10)]
    assert all(d.reason == "miss" and d.matched_tokens in (0, 8) for d in got)
    assert {d.replica for d in got} == {"a", "b"}


def test_health_and_candidates():
    p = CacheAwarePolicy(["a", "b"])
    p.set_healthy("a", False)
    assert {route(p, ids(i)).replica for i in range(5)} == {"b"}
    assert p.choose(ids(1), candidates=["b"]).replica == "b"
    with pytest.raises(NoReplicaError):
        p.choose(ids(1), candidates=["a"])
    p.set_healthy("b", False)
    with pytest.raises(NoReplicaError):
        p.choose(ids(1))


def test_round_robin_and_names():
    p = make_policy("round_robin", ["a", "b", "c"], block_size=8)
    assert isinstance(p, RoundRobinPolicy)
    assert [route(p, ids(1)).replica for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")
    with pytest.raises(ValueError):
        CacheAwarePolicy(cache_threshold=2.0)
