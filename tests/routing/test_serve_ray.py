"""prefixrt.serve_ray on a local Ray (127.0.0.1): four EngineReplicas on the tiny model behind the ingress,
routed by PrefixCacheRouter. The HTTP smoke workload of test_router_http.py (8 groups x 16 requests, pools of
a quarter of the prefixes) through Serve's HTTP proxy; the references (one engine with the four pools' memory,
round robin over four) run on in-process engines of the same weights. Skipped, with the reason, only when ray
is not installed or cannot start here."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest

from tests.helpers import routing_workload as wl

GROUPS, PER_GROUP, KV_TOKENS = wl.SMOKE_GROUPS, wl.SMOKE_PER_GROUP, wl.SMOKE_KV_TOKENS
CHAT = {"model": "tiny", "max_tokens": 1, "temperature": 0}


@pytest.fixture(scope="module")
def ray_app(routing_model_dir):
    try:
        import ray
        from ray import serve
    except ImportError as e:
        pytest.skip(f"ray[serve] is not installed ({e}); pip install 'prefixrt[ray]'")
    from tests.helpers.serve import free_port

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=False, configure_logging=False)
    except Exception as e:  # any failure to start is the skip reason
        print(f"ray cannot start on this machine: {e!r}")
        pytest.skip(f"ray cannot start on this machine: {e!r}")
    try:
        from prefixrt.serve_ray import build_app

        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        engine_kwargs = {"device": "cpu", "kv_cache_tokens": KV_TOKENS}
        serve.run(build_app(str(routing_model_dir), wl.REPLICAS, engine_kwargs, "tiny", policy_kwargs={"block_size": 8,
                            "max_tree_tokens": KV_TOKENS}), name="prefixrt", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


async def drive(url: str, reqs, concurrency: int = 8):
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        async def one(req):
            async with sem:
                r = await c.post("/v1/chat/completions", json={**CHAT, "messages": req.messages})
                assert r.status_code == 200, r.text
                u = r.json()["usage"]
                return r.headers["x-prefixrt-replica"], u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]

        return await asyncio.gather(*(one(q) for q in reqs))


def test_acceptance_through_ray_serve(ray_app, make_engine, tiny_tokenizer):
    from prefixrt.routing.policy import RoundRobinPolicy
    from prefixrt.routing.prompt import RoutingKeys

    reqs = wl.workload(GROUPS, PER_GROUP)
    usages = asyncio.run(drive(ray_app, reqs))
    replicas = sorted({u[0] for u in usages})
    assert len(replicas) == wl.REPLICAS
    ca = wl.figures(usages, replicas)
    keys = RoutingKeys(tiny_tokenizer)
    names = [f"r{i}" for i in range(wl.REPLICAS)]
    engines = {n: make_engine("llama", debug=False, kv_cache_tokens=KV_TOKENS) for n in names}
    rr = wl.figures(wl.run_routed(engines, RoundRobinPolicy(names), keys, reqs, concurrency=8), names)
    single_engine = make_engine("llama", debug=False, kv_cache_tokens=wl.REPLICAS * KV_TOKENS)
    single = wl.figures(wl.run_routed({"s": single_engine}, RoundRobinPolicy(["s"]), keys, reqs, 8), ["s"])
    print(f"\nsingle: {single}\nround robin: {rr}\ncache-aware (Ray Serve): {ca}")
    wl.check_acceptance(ca, single, rr)


def test_ray_streaming_errors_and_responses(ray_app):
    with httpx.stream("POST", ray_app + "/v1/chat/completions", timeout=60, json={
            **CHAT, "messages": [{"role": "user", "content": "The quick brown fox"}], "max_tokens": 6,
            "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    bad = httpx.post(ray_app + "/v1/chat/completions", timeout=60,
                     json={**CHAT, "messages": [{"role": "user", "content": "hi"}], "temperature": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
    first = httpx.post(ray_app + "/v1/responses", timeout=60, json={
        "model": "tiny", "input": "prefix caching reuses", "max_output_tokens": 3, "temperature": 0})
    assert first.status_code == 200, first.text
    follow = httpx.post(ray_app + "/v1/responses", timeout=60, json={
        "model": "tiny", "input": "and?", "max_output_tokens": 2, "previous_response_id": first.json()["id"]})
    assert follow.status_code == 200, follow.text
    assert follow.headers["x-prefixrt-replica"] == first.headers["x-prefixrt-replica"]
    assert httpx.get(ray_app + "/v1/models", timeout=60).json()["data"][0]["id"]
