"""The router's prefix trees keep adapters apart: a request's key leads with its LoRA adapter (any `model` other than
the base model's names), so no adapter's request is placed as if it shared a replica's K/V with the base model's or
another adapter's; cache_salt still applies within an adapter."""

from __future__ import annotations

from prefixrt.routing.prompt import RoutingKeys, model_token, salt_token
from prefixrt.routing.tree import ApproxPrefixTree, block_keys

MESSAGES = [{"role": "system", "content": "You answer questions about the quick brown fox. " * 6},
            {"role": "user", "content": "What does the fox do?"}]


def test_keys_lead_with_the_adapter(tiny_tokenizer):
    keys = RoutingKeys(tiny_tokenizer, base_models=("tiny-llama",))
    route = "/v1/chat/completions"
    ids = keys.chat_ids(MESSAGES)
    base = keys.of(route, {"model": "tiny-llama", "messages": MESSAGES})
    assert base == ids == keys.of(route, {"messages": MESSAGES})  # the base model by name or by default
    a = keys.of(route, {"model": "a", "messages": MESSAGES})
    b = keys.of(route, {"model": "b", "messages": MESSAGES})
    assert a == [model_token("a"), *ids] and b == [model_token("b"), *ids] and a[0] != b[0]
    salted = keys.of(route, {"model": "a", "messages": MESSAGES, "cache_salt": "t"})
    assert salted == [model_token("a"), salt_token("t"), *ids]
    # no string spells another namespace: a salt equal to an adapter's name is a different pseudo-token
    assert keys.of(route, {"messages": MESSAGES, "cache_salt": "a"})[0] != model_token("a")
    assert all(t < 0 for t in (model_token("a"), salt_token("a")))


def test_a_replicas_tree_matches_only_its_own_adapters_prefix(tiny_tokenizer):
    keys = RoutingKeys(tiny_tokenizer, base_models=("tiny-llama",))
    route = "/v1/chat/completions"
    tree = ApproxPrefixTree(block_size=4)
    a = keys.of(route, {"model": "a", "messages": MESSAGES})
    tree.insert(block_keys(a, 4))
    assert tree.match(block_keys(a, 4)) >= len(a) - 4
    for other in ({"model": "b", "messages": MESSAGES}, {"model": "tiny-llama", "messages": MESSAGES},
                  {"model": "a", "messages": MESSAGES, "cache_salt": "x"}):
        assert tree.match(block_keys(keys.of(route, other), 4)) == 0, other
