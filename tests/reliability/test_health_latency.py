"""The HTTP event loop does no heavy work (issue 10, item 5 / build 3): `/health` p99 <= 100 ms while other
clients send 5 MB prompts (seconds of tokenization each) and requests with grammars never seen before (a
compile each), measured against `prefixrt serve` on a tiny checkpoint. (This is the issue's acceptance figure,
so it is asserted; before the fix one 5 MB prompt held /health for seconds.)
"""

from __future__ import annotations

import itertools
import json
import statistics
import threading
import time

import httpx

from tests.server.conftest import ServeProcess, needs_constrained_decoding

DURATION_S = 15.0
P99_LIMIT_S = 0.100


def _load(url: str, bodies, stop: threading.Event, done: list, errors: list) -> None:
    with httpx.Client(base_url=url, timeout=300) as http:
        for path, body in bodies:
            if stop.is_set():
                return
            r = http.post(path, content=body, headers={"content-type": "application/json"})
            if r.status_code >= 500:
                errors.append(r.text[:300])
            done.append((path, r.status_code))


@needs_constrained_decoding()
def test_health_p99_while_tokenizing_5mb_prompts_and_compiling_grammars(model_dirs, tmp_path):
    args = ["--model", str(model_dirs("llama")), "--device", "cpu", "--kv-cache-tokens", "8192", "--log-level",
            "warning"]
    prompt = ("The quick brown fox jumps over the lazy dog. " * 120_000)[:5_000_000]
    big = [("/v1/completions", json.dumps({"model": "m", "prompt": prompt, "max_tokens": 2}).encode()),
           ("/v1/chat/completions", json.dumps({"model": "m", "max_tokens": 2,
                                                "messages": [{"role": "user", "content": prompt}]}).encode())]

    def grammars(offset: int):
        for k in itertools.count(offset, 2):  # every request a regex or schema never compiled before
            if k % 4 < 2:
                yield "/v1/completions", json.dumps({"model": "m", "prompt": "Phone:", "max_tokens": 4,
                                                     "regex": f"[0-9]{{3}}-{k}-[a-z]+"}).encode()
            else:
                schema = {"type": "object", "properties": {f"field_{k}": {"type": "integer"}},
                          "required": [f"field_{k}"]}
                yield "/v1/chat/completions", json.dumps({
                    "model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                    "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
                ).encode()

    with ServeProcess(args, tmp_path / "serve.log") as live:
        stop, done, errors = threading.Event(), [], []
        loads = [itertools.cycle(big), itertools.cycle(big[::-1]), grammars(0), grammars(1)]
        threads = [threading.Thread(target=_load, args=(live.url, b, stop, done, errors), daemon=True) for b in loads]
        for t in threads:
            t.start()
        time.sleep(1.0)  # let the first 5 MB bodies arrive
        latencies = []
        with httpx.Client(base_url=live.url, timeout=30) as http:
            end = time.monotonic() + DURATION_S
            while time.monotonic() < end:
                t0 = time.perf_counter()
                r = http.get("/health")
                latencies.append(time.perf_counter() - t0)
                assert r.status_code == 200, r.text
                time.sleep(0.02)
        stop.set()
        for t in threads:
            t.join(timeout=120)

    latencies.sort()
    p50 = statistics.median(latencies)
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    big_done = sum(1 for path, code in done if code == 400)
    grammar_done = sum(1 for path, code in done if code == 200)
    print(f"\n/health under load: n={len(latencies)} p50={p50 * 1e3:.1f} ms p99={p99 * 1e3:.1f} ms "
          f"max={latencies[-1] * 1e3:.1f} ms; 5 MB prompts answered: {big_done}, new grammars served: {grammar_done}")
    assert not errors, errors
    assert big_done >= 2 and grammar_done >= 3, done  # the load really ran
    assert p99 <= P99_LIMIT_S, f"/health p99 {p99 * 1e3:.1f} ms > {P99_LIMIT_S * 1e3:.0f} ms"
