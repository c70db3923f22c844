"""64 concurrent streaming clients through `prefixrt serve` (engine in its own process) get, byte for byte, the
text the in-process engine gives for the same greedy requests."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import random
import threading
import time

import httpx

from tests.server.conftest import SERVED_NAME, assert_clean

WORDS = ["the", "cat", "sat", "on", "a", "mat", "über", "naïve", "café", "東京", "🙂", "and", "then", ",", "."]


def _prompts(n: int) -> list[str]:
    rng = random.Random(33)
    shared = " ".join(rng.choice(WORDS) for _ in range(8))  # a shared prefix: the radix cache serves it
    return [shared + " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4))) for _ in range(n)]


async def _stream(http: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[str, int, str | None]:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    text, events, reason, done = "", 0, None, False
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                reason = choice["finish_reason"] or reason
                events += 1
    assert done
    return text, events, reason


async def test_64_concurrent_streams_match_in_process(server, engine):
    prompts = _prompts(64)
    max_tokens = 40
    params = {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    expected = [c.text for c in engine.generate(prompts, params)]  # one batch in-process
    solo = engine.generate(prompts[5], params).text
    assert solo == expected[5]  # greedy output does not depend on the batch
    async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=httpx.Limits(max_connections=128)) as http:
        results = await asyncio.gather(*(_stream(http, p, max_tokens) for p in prompts))
    texts = [t for t, _, _ in results]
    assert [t.encode() for t in texts] == [e.encode() for e in expected]
    assert all(reason == "length" for _, _, reason in results)
    assert all(1 <= events <= max_tokens for _, events, _ in results)
    assert_clean(server.wait_idle())


def test_requests_sent_while_the_pipe_is_busy_cross_it_as_one_batch(model_dirs):
    """Group commit: while one caller writes to the pipe, the others only queue; their requests then cross as
    one Batch message, in order, and every one of them runs."""
    from prefixrt.engine.process.client import ProcessEngine

    eng = ProcessEngine(str(model_dirs("llama")), device="cpu", kv_cache_tokens=4096)
    pool = concurrent.futures.ThreadPoolExecutor(8)
    try:
        params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
        prompts = _prompts(8)
        expected = [eng.generate(p, params).text for p in prompts]
        writes0 = eng._pipe.writes
        real, gate, first = eng._conn.send_bytes, threading.Event(), threading.Event()

        def held(data):  # the first write waits until everyone else has queued
            if not first.is_set():
                first.set()
                assert gate.wait(30)
            real(data)

        eng._conn.send_bytes = held
        futs = [pool.submit(eng.generate, prompts[0], params)]
        assert first.wait(30)
        futs += [pool.submit(eng.generate, p, params) for p in prompts[1:]]
        deadline = time.monotonic() + 30
        while len(eng._pipe.queued) < 7 and time.monotonic() < deadline:
            time.sleep(0.01)
        gate.set()
        got = [f.result(timeout=60).text for f in futs]
        assert got == expected
        assert eng._pipe.writes - writes0 == 2 and eng._pipe.batched == 7
    finally:
        eng.shutdown()  # fails whatever still waits
        pool.shutdown(wait=False)
