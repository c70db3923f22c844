"""`prefixrt router` over four `prefixrt serve` workers, as users run them (subprocesses on a tiny model).

The acceptance figures on a smaller copy of the workload (8 groups x 16 requests, each worker's pool holding
a quarter of the groups' prefixes; the full 32 x 16 runs in test_engines.py over in-process engines and was
measured through the router as docs/serving.md says): cache-aware through `prefixrt router`, round robin
through the same app run in this process (one process less to start), and one in-process engine with the
four pools' memory as the single-replica reference. Then proxy behaviour against the worker itself as the oracle: streaming,
errors, /v1/models, Responses follow-ups, and a worker dying.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from tests.helpers import routing_workload as wl
from tests.routing.conftest import RouterProcess, start_workers

pytest.importorskip("fastapi")
GROUPS, PER_GROUP, KV_TOKENS = wl.SMOKE_GROUPS, wl.SMOKE_PER_GROUP, wl.SMOKE_KV_TOKENS
CHAT = {"model": "tiny", "max_tokens": 1, "temperature": 0}


@pytest.fixture(scope="module")
def cluster(routing_model_dir, tiny_tokenizer, tmp_path_factory):
    from prefixrt.routing.policy import RoundRobinPolicy
    from prefixrt.routing.prompt import RoutingKeys
    from prefixrt.routing.proxy import create_router_app
    from tests.helpers.live_server import LiveServer

    logs = tmp_path_factory.mktemp("router-logs")
    workers, router, rr = [], None, None
    try:
        workers = start_workers(routing_model_dir, wl.REPLICAS, KV_TOKENS, logs)
        urls = [w.url for w in workers]
        router = RouterProcess([*(a for u in urls for a in ("--worker", u)), "--model", str(routing_model_dir),
                                "--health-interval", "0.5", "--block-size", "8", "--log-level", "warning"],
                               logs / "router.log").start()
        rr = LiveServer(create_router_app(urls, RoundRobinPolicy(urls), RoutingKeys(tiny_tokenizer))).__enter__()
        router.wait_all_workers(len(workers))
        yield workers, {"cache_aware": router, "round_robin": rr}
        log = router.log()
        assert "Traceback" not in log, log
    finally:
        if rr is not None:
            rr.__exit__(None, None, None)
        if router is not None:
            router.stop()
        for w in workers:
            w.__exit__(None, None, None)


async def drive(url: str, reqs, concurrency: int = 8):
    """Every request as an OpenAI chat completion through `url`; (worker, prompt_tokens, cached_tokens) each."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        async def one(req):
            async with sem:
                r = await c.post("/v1/chat/completions", json={**CHAT, "messages": req.messages})
                assert r.status_code == 200, r.text
                u = r.json()["usage"]
                return r.headers["x-prefixrt-worker"], u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]

        return await asyncio.gather(*(one(q) for q in reqs))


def test_acceptance_through_the_router(cluster, make_engine):
    workers, routers = cluster
    reqs = wl.workload(GROUPS, PER_GROUP)
    urls = [w.url for w in workers]
    rr = wl.figures(asyncio.run(drive(routers["round_robin"].url, reqs)), urls)
    for w in workers:
        w.wait_idle()
        assert httpx.post(w.url + "/flush_cache", timeout=30).status_code == 200
    ca = wl.figures(asyncio.run(drive(routers["cache_aware"].url, reqs)), urls)
    single_engine = make_engine("llama", debug=False, kv_cache_tokens=wl.REPLICAS * KV_TOKENS)
    usages = []
    for q in reqs:
        c = single_engine.generate(q.messages, {"max_new_tokens": 1, "temperature": 0.0})
        usages.append(("single", c.prompt_tokens, c.cached_tokens))
    single = wl.figures(usages, ["single"])
    print(f"\nsingle: {single}\nround robin: {rr}\ncache-aware: {ca}")
    wl.check_acceptance(ca, single, rr)
    stats = httpx.get(routers["cache_aware"].url + "/router/stats").json()
    assert sum(stats["decisions"].values()) == len(reqs) and stats["decisions"]["hit"] > len(reqs) // 2, stats
    assert [stats["replicas"][u]["routed"] for u in urls] == ca.loads
    assert all(stats["replicas"][u]["in_flight"] == 0 for u in urls), stats  # every reply ended its load


def test_streaming_passes_through_event_by_event(cluster):
    import openai

    workers, routers = cluster
    msgs = [{"role": "user", "content": "The quick brown fox"}]
    direct = httpx.post(workers[0].url + "/v1/chat/completions",
                        json={**CHAT, "messages": msgs, "max_tokens": 12}, timeout=60).json()
    client = openai.OpenAI(base_url=routers["cache_aware"].url + "/v1", api_key="x", max_retries=0)
    deltas = [ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=12, temperature=0, stream=True) if ch.choices]
    assert len(deltas) > 1 and "".join(deltas) == direct["choices"][0]["message"]["content"]
    with httpx.stream("POST", routers["cache_aware"].url + "/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": "radix trees", "max_tokens": 5, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    assert len(events) >= 3


def test_a_client_leaving_a_stream_aborts_it_on_the_worker(cluster):
    """Leaving a stream through the router closes the worker's stream: the worker aborts the request (its
    aborted count goes up) and the router ends the request's load."""
    workers, routers = cluster
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 115, "ignore_eos": True, "stream": True}
    before = {w.url: w.wait_idle()["aborted_requests_total"] for w in workers}
    with httpx.stream("POST", routers["cache_aware"].url + "/v1/completions", json=body, timeout=60) as r:
        worker = next(w for w in workers if w.url == r.headers["x-prefixrt-worker"])
        next(r.iter_lines())  # the first event, then leave
    deadline = time.monotonic() + 20
    while worker.stats()["aborted_requests_total"] == before[worker.url]:
        assert time.monotonic() < deadline, worker.stats()
        time.sleep(0.05)
    assert worker.wait_idle()["aborted_requests_total"] == before[worker.url] + 1
    while httpx.get(routers["cache_aware"].url + "/router/stats").json()["replicas"][worker.url]["in_flight"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_errors_pass_through_unchanged(cluster):
    workers, routers = cluster
    bad = {**CHAT, "messages": [{"role": "user", "content": "hi"}], "temperature": -1}
    got = httpx.post(routers["cache_aware"].url + "/v1/chat/completions", json=bad, timeout=60)
    want = httpx.post(workers[0].url + "/v1/chat/completions", json=bad, timeout=60)
    assert got.status_code == want.status_code == 400
    assert got.json() == want.json() and got.headers.get("x-should-retry") == want.headers.get("x-should-retry")
    broken = httpx.post(routers["cache_aware"].url + "/v1/chat/completions", content=b"{not json", timeout=60,
                        headers={"content-type": "application/json"})
    direct = httpx.post(workers[0].url + "/v1/chat/completions", content=b"{not json", timeout=60,
                        headers={"content-type": "application/json"})
    assert (broken.status_code, broken.json()) == (direct.status_code, direct.json())
    models = httpx.get(routers["cache_aware"].url + "/v1/models").json()
    assert models == httpx.get(workers[0].url + "/v1/models").json()


def test_responses_follow_up_goes_to_the_worker_that_stored_it(cluster):
    workers, routers = cluster
    url = routers["cache_aware"].url
    first = httpx.post(url + "/v1/responses", timeout=60, json={
        "model": "tiny", "input": "prefix caching reuses", "max_output_tokens": 4, "temperature": 0})
    assert first.status_code == 200, first.text
    owner = first.headers["x-prefixrt-worker"]
    for stream in (False, True):
        body = {"model": "tiny", "input": "and then?", "max_output_tokens": 3, "temperature": 0,
                "previous_response_id": first.json()["id"], "stream": stream}
        r = httpx.post(url + "/v1/responses", json=body, timeout=60)
        assert r.status_code == 200 and r.headers["x-prefixrt-worker"] == owner, r.text
    if not stream:
        assert r.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0
    got = httpx.get(url + f"/v1/responses/{first.json()['id']}")
    assert got.status_code == 200 and got.json()["id"] == first.json()["id"]
    assert httpx.get(url + "/v1/responses/resp_unknown").status_code == 404


def test_a_session_key_keeps_its_requests_on_one_worker(cluster):
    """prompt_cache_key: every turn of a session goes where its first went, though their prompts differ wholly."""
    workers, routers = cluster
    url = routers["cache_aware"].url
    owners = set()
    for turn in range(4):
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            **CHAT, "prompt_cache_key": "agent-7", "messages": [{"role": "user", "content": f"turn {turn} " * 8}]})
        assert r.status_code == 200, r.text
        owners.add(r.headers["x-prefixrt-worker"])
    assert len(owners) == 1


def test_a_dead_worker_is_taken_out_of_rotation(cluster):
    """Last in the module: it kills a worker."""
    workers, routers = cluster
    url = routers["cache_aware"].url
    dead = workers[-1]
    os.killpg(dead.proc.pid, signal.SIGKILL)
    dead.proc.wait()
    deadline = time.monotonic() + 20
    while httpx.get(url + "/health").json()["workers"][dead.url] == "ok":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    served = set()
    for i in range(12):
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": f"question {i}: what is the capital", "max_tokens": 1})
        assert r.status_code == 200, r.text
        served.add(r.headers["x-prefixrt-worker"])
    # Every request was served, by live workers only. (Which of them serves is the policy's business: prefix hits
    # and the decayed load of the module's earlier requests decide it, so it need not be all of them.)
    assert dead.url not in served and served <= {w.url for w in workers[:-1]}
    assert json.loads(httpx.get(url + "/health").text)["status"] == "ok"


def test_router_flag_mistakes_are_one_line(routing_model_dir):
    import subprocess

    from tests.helpers.serve import cli, cli_env

    r = subprocess.run(cli("router", "--worker", "127.0.0.1:1", "--model", str(routing_model_dir)), env=cli_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        "prefixrt router: --worker '127.0.0.1:1': give a base URL such as http://127.0.0.1:30001"), r.stderr
