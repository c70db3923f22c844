"""Acceptance on in-process engines: the cache-aware policy over 4 tiny CPU engines, against one engine with
the four pools' memory and against round robin (tests/helpers/routing_workload.py describes the workload)."""

from __future__ import annotations

import pytest

from prefixrt.routing.policy import CacheAwarePolicy, RoundRobinPolicy
from prefixrt.routing.prompt import RoutingKeys
from tests.helpers import routing_workload as wl


@pytest.fixture
def keys(tiny_tokenizer):
    return RoutingKeys(tiny_tokenizer)


def test_routing_keys_are_the_engines_prompt_ids(make_engine, keys):
    """The router's key of a chat request is exactly the engine's prompt: the chat template applied, then
    tokenized (so requests sharing a system prompt share a key prefix through the template's markers)."""
    eng = make_engine("llama", debug=False)
    for req in wl.workload(groups=3, per_group=2):
        assert keys.chat_ids(req.messages) == eng.encode(req.messages)
    a, b = wl.workload(groups=1, per_group=2)
    ka, kb = keys.chat_ids(a.messages), keys.chat_ids(b.messages)
    shared = next(i for i, (x, y) in enumerate(zip(ka, kb)) if x != y)
    assert shared >= 0.6 * len(ka), (shared, len(ka))


def test_acceptance_over_four_engines(make_engine, keys):
    reqs = wl.workload()
    names = [f"r{i}" for i in range(wl.REPLICAS)]
    single = make_engine("llama", debug=False, kv_cache_tokens=wl.REPLICAS * wl.REPLICA_KV_TOKENS)
    engines = {n: make_engine("llama", debug=False, kv_cache_tokens=wl.REPLICA_KV_TOKENS) for n in names}
    one = wl.figures(wl.run_routed({"single": single}, RoundRobinPolicy(["single"]), keys, reqs), ["single"])
    rr = wl.figures(wl.run_routed(engines, RoundRobinPolicy(names), keys, reqs), names)
    for e in engines.values():
        e.flush_cache()
    ca = wl.figures(wl.run_routed(engines, CacheAwarePolicy(names, max_tree_tokens=wl.REPLICA_KV_TOKENS), keys,
                               reqs), names)
    print(f"\nsingle: {one}\nround robin: {rr}\ncache-aware: {ca}")
    wl.check_acceptance(ca, one, rr)
