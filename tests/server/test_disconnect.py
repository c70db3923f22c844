"""A client that goes away aborts its request and its KV is released; the requests left are unaffected."""

from __future__ import annotations

import asyncio
import random
import time

import httpx

from prefixrt.openai import OpenAI
from tests.server.conftest import assert_clean


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(5)
    shared = [1] + [rng.randrange(3, 300) for _ in range(12)]
    return [shared + [rng.randrange(3, 300) for _ in range(rng.randint(1, 8))] for _ in range(n)]


async def test_64_streams_half_cut(server, engine):
    prompts = _prompts(64)
    max_tokens = 80
    # Solo runs on the in-process engine (same weights): greedy outputs must not depend on the batch.
    solo = [engine.generate(p, {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).text
            for p in prompts[1::2]]
    before = server.stats()["aborted_requests_total"]

    async def one(http: httpx.AsyncClient, k: int):
        body = {"model": "tiny-llama", "prompt": prompts[k], "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        text, n = "", 0
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                n += 1
                if k % 2 == 0 and n == 3:
                    return None  # leaving the block closes the connection mid-stream
                text += httpx.Response(200, content=line[6:]).json()["choices"][0]["text"]
        return text

    limits = httpx.Limits(max_connections=100)
    async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
        results = await asyncio.gather(*(one(http, k) for k in range(64)))
    assert results[1::2] == solo
    stats = server.wait_idle()
    assert_clean(stats)
    assert stats["aborted_requests_total"] - before == 32


def test_nonstreaming_disconnect_aborts(server):
    before = server.stats()["aborted_requests_total"]
    body = {"model": "tiny-llama", "prompt": "The quick brown", "max_tokens": 110, "temperature": 0, "ignore_eos": True,
            "n": 64}
    try:
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)  # long enough to be running
    except httpx.TimeoutException:
        pass
    # The request may still be on its way to the engine (it is submitted from a worker thread): wait for it.
    deadline = time.monotonic() + 30
    while server.stats()["aborted_requests_total"] - before < 64 and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = server.wait_idle()
    assert stats["aborted_requests_total"] - before == 64
    assert_clean(stats)


def test_shim_stream_break_aborts(engine):
    before = engine.stats().aborted_requests_total
    client = OpenAI(engine=engine)
    stream = client.completions.create(model="tiny-llama", prompt="hi", max_tokens=110, stream=True,
                                       extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    engine.wait_idle()
    s = engine.stats()
    assert s.aborted_requests_total - before == 1
    assert_clean(s.to_dict())
    client.close()
