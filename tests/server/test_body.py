"""Large JSON bodies are decoded in the parser process (server/body.py), with json.loads' exact results and errors.

The oracle is the inline path (`json.loads` on the loop, what Starlette's Request.json does): an app whose
parser sends every body to the parser process must answer every request, good or malformed, exactly as an
app that parses every body inline. Admission (API keys, the 413 limit) still comes first: a refused body
never starts the parser process.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import signal

import pytest
from starlette.testclient import TestClient

from prefixrt.server.app import create_app
from prefixrt.server.body import OFFLOAD_BYTES, BodyParser, loads_json

GREEDY = {"temperature": 0, "max_new_tokens": 2}  # /generate's spelling
PAD = "pad " * 80_000  # 320 KB: above OFFLOAD_BYTES, so `prefixrt serve` sends it to the parser process too

BODIES = [
    json.dumps({"model": "tiny-llama", "prompt": "hi", "max_tokens": 2, "temperature": 0, "sampling_params": GREEDY}).encode(),
    json.dumps({"model": "tiny-llama", "prompt": "Ünïcode 🎉 " + PAD, "max_tokens": 2}, ensure_ascii=False).encode(),
    json.dumps({"model": "tiny-llama", "prompt": PAD, "max_tokens": 2}).encode(),  # over the 128-token context: a 400
    json.dumps({"model": "tiny-llama", "max_tokens": 2, "temperature": 0, "sampling_params": GREEDY,
                "messages": [{"role": "user", "content": "hi"}]}).encode(),
    json.dumps({"model": "tiny-llama", "max_tokens": 2, "messages": [{"role": "user", "content": PAD}]}).encode(),
    json.dumps({"model": "tiny-llama", "max_tokens": 2, "messages": [{"role": "nobody", "content": PAD}]}).encode(),
    json.dumps({"model": "tiny-llama", "max_tokens": "two", "prompt": PAD}).encode(),
    json.dumps({"model": "tiny-llama", "max_tokens": 2, "prompt": "a\ud800" + PAD}).encode(),  # a lone surrogate
    json.dumps({"model": "tiny-llama", "max_tokens": 2, "prompt": "hi", "temperature": float("nan"),
                "sampling_params": {"temperature": float("nan")}}).encode(),
    b'{"model": "tiny-llama", "prompt": "' + PAD.encode() + b'", "max_tokens": 2',  # truncated
    b'{"model": "tiny-llama", "prompt": "' + PAD.encode() + b'"} trailing',
    b'{"model": "tiny-llama", "prompt": "\xff\xfe' + PAD.encode() + b'"}',  # not UTF-8
    b"[" * 200_000 + b"]" * 200_000,  # deeper than the recursion limit
    b"",
]


def _stable(value):
    """value without what differs between any two requests: ids, timestamps, prefix-cache hits."""
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k not in ("id", "created", "request_id", "cached_tokens")}
    if isinstance(value, list):
        return [_stable(v) for v in value]
    return value


@pytest.fixture(scope="module")
def apps(engine):
    """(inline, offloaded): the same engine behind an app that parses every body on the loop and one that
    parses every body in the parser process."""
    inline, offloaded = create_app(engine), create_app(engine)
    inline.state.body_parser = BodyParser(offload_bytes=2**62)
    offloaded.state.body_parser = BodyParser(offload_bytes=0)
    with TestClient(inline) as a, TestClient(offloaded) as b:
        yield a, b


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_offloaded_parsing_answers_exactly_as_inline_parsing(apps, path):
    inline, offloaded = apps
    for body in BODIES:
        a = inline.post(path, content=body, headers={"content-type": "application/json"})
        b = offloaded.post(path, content=body, headers={"content-type": "application/json"})
        assert a.status_code < 500, (body[:80], a.text[:300])
        assert (a.status_code, _stable(a.json())) == (b.status_code, _stable(b.json())), body[:80]
    assert inline.app.state.body_parser._pool is None  # never started: every body parsed inline
    assert offloaded.app.state.body_parser._pool is not None


def test_serve_threshold_sends_large_bodies_to_the_parser_process(engine):
    app = create_app(engine)
    assert app.state.body_parser.offload_bytes is None  # in-process apps parse inline (see BodyParser)
    app.state.body_parser = parser = BodyParser(OFFLOAD_BYTES)  # as `prefixrt serve` sets it
    with TestClient(app) as http:
        r = http.post("/v1/completions", json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and parser._pool is None  # small: parsed inline
        r = http.post("/v1/completions", json={"model": "tiny-llama", "prompt": PAD, "max_tokens": 2})
        assert r.status_code == 400 and "context is 128" in r.json()["error"]["message"], r.text
        assert parser._pool is not None
    assert parser._pool is None  # the app's shutdown stopped it


def test_refused_bodies_never_reach_the_parser(engine):
    """API keys and the body-size limit are applied by Admission before any parsing."""
    app = create_app(engine, api_key="k", max_request_bytes=2 * len(PAD))
    app.state.body_parser = BodyParser(offload_bytes=0)
    body = json.dumps({"model": "tiny-llama", "prompt": PAD, "max_tokens": 2})
    with TestClient(app) as http:
        r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        r = http.post("/v1/completions", content=body * 3, headers={"authorization": "Bearer k"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
        assert app.state.body_parser._pool is None


def test_a_dead_parser_process_is_replaced():
    parser = BodyParser(offload_bytes=0)
    body = json.dumps({"a": [1, 2.5, None, "é"]}).encode()
    try:
        assert asyncio.run(parser.loads(body)) == json.loads(body)
        pool = parser._pool
        for pid in list(pool._processes):  # the worker dies (killed, out of memory)
            os.kill(pid, signal.SIGKILL)
        assert asyncio.run(parser.loads(body)) == json.loads(body)  # parsed inline this once
        assert asyncio.run(parser.loads(body)) == json.loads(body)
        assert parser._pool is not None and parser._pool is not pool
    finally:
        parser.close()


# Bodies where a JSON parser could differ from json.loads: numbers at the edges of float and int, escapes, bytes
# that are not UTF-8, a BOM, duplicate keys, non-standard constants, nesting, whitespace, trailing garbage.
EDGE_BODIES = [
    b'{"a":1}', b'{"a":1,}', b'[1,2,]', b"01", b"-0", b"-0.0", b"1.", b".5", b"+1", b"NaN", b"Infinity", b"-Infinity",
    b"nan", b"[1e400]", b"[-1e400]", b"1e-400", b"[1.5e1000000]", b"2.2250738585072011e-308",
    b'{"a": 1.7976931348623157e308}', b"123456789012345678901234567890", b"-123456789012345678901234567890",
    b"1" * 5000, b'"\\ud800"', b'"\\udc00x"', b'"\\ud83d\\ude00"', b'"a\x01b"', b'"a\tb"', b'"\\u0000"', b'"\\/"',
    b'"\xed\xa0\x80"', b'"\xff"', b'\xef\xbb\xbf{"a":1}', '"é"'.encode("utf-16"), '"é😀"'.encode(),
    b'{"a":1,"a":2}', b"  [1]  ", b"[1] x", b"", b'{"a":1}\n', b"\t\r\n 1", b"[1,\x0c2]", b"\x00",
    b"[" * 300 + b"]" * 300, b"[" * 5000 + b"]" * 5000, b'{"a":"\\x"}', b"{1:2}", b"{'a':1}", b"// c\n1",
    b"true", b"null", b"[true,false,null]", b"1E5", b"0.1",
]


def _same(x, y) -> bool:
    """x and y are the same JSON value: same types all the way down, floats equal bit for bit (or both NaN)."""
    if type(x) is not type(y):
        return False
    if isinstance(x, float):
        return (math.isnan(x) and math.isnan(y)) or (x == y and math.copysign(1, x) == math.copysign(1, y))
    if isinstance(x, list):
        return len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y))
    if isinstance(x, dict):
        return list(x) == list(y) and all(_same(x[k], y[k]) for k in x)
    return x == y


def _verdict(loads, body: bytes):
    try:
        return "value", loads(body)
    except RecursionError as e:
        return "error", (type(e), str(e))
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError included
        return "error", (type(e), str(e))


@pytest.mark.parametrize("body", EDGE_BODIES, ids=range(len(EDGE_BODIES)))
def test_loads_json_is_json_loads(body):
    """The same value, or the same exception with the same message."""
    want, got = _verdict(json.loads, body), _verdict(loads_json, body)
    assert want[0] == got[0], body[:40]
    assert _same(want[1], got[1]) if want[0] == "value" else want[1] == got[1], body[:40]


def test_loads_json_numbers_are_json_loads_numbers():
    rng = random.Random(0)
    numbers = [repr(rng.uniform(-1e6, 1e6)) for _ in range(2000)]
    numbers += [f"{rng.randrange(10**17)}e{rng.randrange(-330, 310)}" for _ in range(2000)]
    numbers += [f"0.{rng.randrange(10**25):025d}" for _ in range(1000)]
    numbers += [str(rng.randrange(-(2**70), 2**70)) for _ in range(1000)]
    body = ("[" + ",".join(numbers) + "]").encode()
    assert _same(json.loads(body), loads_json(body))
