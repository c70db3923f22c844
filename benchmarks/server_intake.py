"""Request intake through `prefixrt serve`: many long token-id prompts arriving at once (the RAG shape).

    PYTHONPATH=$PWD python benchmarks/server_intake.py [--requests 64] [--prefix 3500] [--unique 80] [--output 16]

A tiny random Llama (2 layers, hidden 64, vocab 320, context raised to 8192) is built in a temp folder, so the
model step costs little and what the server does with each request shows: the JSON body, its validation, the
prompt's checks, the hand-off to the engine process. `prefixrt serve` runs as users run it (engine in a child
process). The client sends every request at once as `POST /generate` with `"stream": true` (the body
`prefixrt bench --url` sends: token ids, sampling_params, text streamed) from pre-encoded bytes over raw
sockets, so the client's own CPU stays out of the way on a small machine.

Reported per --rounds round (one row each, then the best): the time from the first byte sent to the first
streamed event of the last request (`all_first_s`: every request has reached the engine and had its first
token), TTFT p50 / max, the whole run's wall time, and the CPU seconds the server process and the engine
process spent over the intake (until `all_first_s`) and over the whole run, per request. --inprocess adds a
row for the same prompts through Engine.astream in this process (no HTTP) as the floor. --wire prints instead what
the engine-process messages cost to pickle and unpickle: one Add of a RAG prompt, one step's Outputs for every
request. --checks N,M,...: instead, the event-loop time of a token-id completion's checks in the server process
for prompts of N, M, ... ids (the body check, completion_params, encode, and the checks and packing of a process
engine's submit), with the code of the checkout it runs in: run it at two commits for a before / after.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import child_pids, cpu_seconds, free_port, int_flags, script_parser, tiny_model_dir

REPO = Path(__file__).resolve().parents[1]

MAX_CONTEXT = 8192


def long_context_model(root: Path) -> Path:
    """The tiny server Llama (benchmarks/common.py) with its context raised so that RAG-length prompts fit (RoPE
    is computed, so the weights do not depend on it)."""
    path = tiny_model_dir(root)
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["max_position_embeddings"] = MAX_CONTEXT
    cfg_path.write_text(json.dumps(cfg))
    return path


def workload(n: int, prefix: int, unique: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(16, vocab) for _ in range(prefix)]
    return [shared + [rng.randrange(16, vocab) for _ in range(unique)] for _ in range(n)]


def request_bytes(port: int, prompt: list[int], output: int) -> bytes:
    body = json.dumps({"sampling_params": {"max_new_tokens": output, "temperature": 0, "ignore_eos": True},
                       "prompt": prompt, "stream": True}).encode()
    head = (f"POST /generate HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
    return head + body


async def one(port: int, data: bytes, t0: float, first_seen: asyncio.Queue) -> tuple[float, float, int]:
    """Send one request and read its response to the end: (time to its first SSE event, time to the end, number
    of events). Puts the first event's time on first_seen as soon as it comes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    first = None
    events = 0
    head = b""
    while True:
        block = await reader.read(65536)
        if not block:
            break
        if first is None:
            head += block
            if b"data: " in head:
                first = time.perf_counter() - t0
                first_seen.put_nowait(first)
                if not head.startswith(b"HTTP/1.1 200"):
                    raise RuntimeError(f"request failed: {head[:300]!r}")
        events += block.count(b"data: ")
    writer.close()
    if first is None:
        raise RuntimeError(f"no event in the response: {head[:300]!r}")
    return first, time.perf_counter() - t0, events


def start_server(model: str, args) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "prefixrt.cli", "serve", "--model", model, "--port", str(port), "--log-level",
           "warning", "--device", "cpu", "--kv-cache-tokens", str(args.kv_cache_tokens),
           "--max-running-requests", str(args.requests)]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    for _ in range(600):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return proc, port
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("the server exited during start-up")
        time.sleep(0.5)
    raise RuntimeError("the server did not start")


def post(port: int, path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: "
                  f"{len(data)}\r\nconnection: close\r\n\r\n".encode() + data)
        out = b""
        while block := s.recv(65536):
            out += block
    return out


async def http_round(port: int, bodies: list[bytes], pids: dict[str, int], cold: bool) -> dict:
    if cold:
        post(port, "/flush_cache", {})
    cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
    first_seen: asyncio.Queue = asyncio.Queue()
    t0 = time.perf_counter()
    tasks = [asyncio.ensure_future(one(port, b, t0, first_seen)) for b in bodies]
    for _ in bodies:  # every request has had its first event: the intake is over
        await first_seen.get()
    cpu_intake = {k: cpu_seconds(p) - cpu0[k] for k, p in pids.items()}
    res = await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    cpu_all = {k: cpu_seconds(p) - cpu0[k] for k, p in pids.items()}
    n = len(bodies)
    ttft = sorted(r[0] for r in res)
    return {"all_first_s": round(max(ttft), 3), "ttft_p50_ms": round(1000 * statistics.median(ttft), 1),
            "ttft_max_ms": round(1000 * ttft[-1], 1), "wall_s": round(wall, 3),
            "events": sum(r[2] for r in res),
            "intake_cpu_ms_per_request": {k: round(1000 * v / n, 2) for k, v in cpu_intake.items()},
            "run_cpu_ms_per_request": {k: round(1000 * v / n, 2) for k, v in cpu_all.items()}}


async def inprocess_round(eng, prompts: list[list[int]], output: int, cold: bool) -> dict:
    if cold:
        eng.flush_cache()
    params = {"max_new_tokens": output, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()

    async def go(p):
        first = None
        async for ch in eng.astream(p, params):
            if first is None and ch.token_ids:
                first = time.perf_counter() - t0
        return first

    ttft = sorted(await asyncio.gather(*(go(p) for p in prompts)))
    return {"all_first_s": round(ttft[-1], 3), "ttft_p50_ms": round(1000 * statistics.median(ttft), 1),
            "ttft_max_ms": round(1000 * ttft[-1], 1), "wall_s": round(time.perf_counter() - t0, 3)}


def wire_costs(requests: int, prompt_len: int, repeat: int = 2000) -> dict:
    """Microseconds to send (build and pickle, as the pipe does) and receive (unpickle, the prompt ids as a list)
    an Add of a prompt_len-id prompt, and one decode step's Outputs for `requests` requests; best of 5 rounds."""
    import pickle
    from multiprocessing.reduction import ForkingPickler

    from prefixrt.engine.process import messages as M
    from prefixrt.engine.stream import StepOutput
    from prefixrt.params import SamplingParams

    ids = workload(1, prompt_len, 0, 128_000)[0]
    params = SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True, request_id=f"gen-{'0' * 32}")
    make = getattr(M.Add, "of", M.Add)  # (Add.of packs the ids; an Add without it carries the list itself)
    outputs = M.Outputs([(f"gen-{k:032x}", StepOutput(index=0, token_ids=[1234], text=None, prompt_tokens=prompt_len,
                                                      cached_tokens=3500)) for k in range(requests)])
    # The Add from the ids to bytes, and from bytes to the ids as a list; a step's Outputs to bytes and back.
    ops = {"add_send": lambda: ForkingPickler.dumps(make(None, params.request_id, ids, params)),
           "add_receive": lambda: pickle.loads(add_data).prompt_ids,
           "outputs_send": lambda: ForkingPickler.dumps(outputs),
           "outputs_receive": lambda: pickle.loads(outputs_data)}
    add_data = bytes(ops["add_send"]())
    outputs_data = bytes(ops["outputs_send"]())
    out: dict = {"add_bytes": len(add_data), "outputs_bytes": len(outputs_data)}
    for name, fn in ops.items():
        out[f"{name}_us"] = round(1e6 * _best_seconds(fn, repeat), 1)
    return out


def _best_seconds(fn, repeat: int) -> float:
    """Seconds per call of fn, the best of 5 rounds of `repeat` calls."""
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - t0) / repeat)
    return best


def check_costs(lengths: list[int], repeat_ids: int = 2_000_000) -> dict:
    """Milliseconds (best of 5) of what the server's event loop does with a /v1/completions token-id prompt before
    it crosses the pipe: check_body, the request's lowering, EngineAPI.encode, then ProcessEngine._submit's
    tokenize / pack / range / validate, on real code with a stand-in EngineAPI (the limits only)."""
    from prefixrt.engine.api import EngineAPI
    from prefixrt.engine.process import client
    from prefixrt.params import SamplingParams
    try:
        from prefixrt.engine.process.messages import PackedIds
        from prefixrt.lowering.completion import lower_completion_request

        def lowered_prompt(body):  # as the /v1/completions route does
            fields = {k: getattr(body, k) for k in type(body).model_fields if k != "prompt"}
            return PackedIds.of(lower_completion_request(fields, body.prompt)[0][0])
    except ImportError:  # a checkout from before prefixrt/lowering/ (for a before / after)
        from prefixrt.server import convert

        def lowered_prompt(body):
            return convert.completion_params(body)[0][0]
    from prefixrt.server.protocol import CompletionRequest
    from prefixrt.server.validate import check_body

    api = EngineAPI.__new__(EngineAPI)
    api.vocab_size, api.max_context, api.kv_total_tokens = 128_256, 1 << 22, 1 << 22
    params = SamplingParams(max_new_tokens=1)
    out = {}
    for n in lengths:
        body = CompletionRequest.model_validate({"model": "m", "prompt": workload(1, n, 0, 128_000)[0],
                                                 "max_tokens": 1})

        def checks(body=body):
            check_body(body)
            ids = api.encode(lowered_prompt(body))
            ids = api._tokenize(ids)
            packed = client._pack_if_int32(ids)
            api._validate_ids(ids, params, client.packed_id_range(packed))

        out[f"checks_{n}_ids_ms"] = round(1e3 * _best_seconds(checks, max(1, repeat_ids // n)), 3)
    return out


def main() -> None:
    ap = script_parser(__doc__)
    int_flags(ap, requests=64, prefix=3500, unique=80, output=4)
    ap.add_argument("--cold", action="store_true",
                    help="flush the prefix cache before each round (default: a first, unmeasured round fills it, "
                         "so each measured request prefills one token and the model's cost stays out of the figures)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-cache-tokens", type=int, default=32768)
    ap.add_argument("--inprocess", action="store_true", help="add the in-process row (Engine.astream)")
    ap.add_argument("--hold", type=float, default=0.0,
                    help="seconds to wait after start-up before the rounds (to attach a profiler)")
    ap.add_argument("--wire", action="store_true", help="only the pipe messages' pickling costs (no server)")
    ap.add_argument("--checks", default=None, metavar="N,M", help="only the event-loop checks of token-id prompts "
                    "of these lengths (no server)")
    args = ap.parse_args()
    if args.checks:
        print(json.dumps(check_costs([int(x) for x in args.checks.split(",")]), indent=1))
        return
    if args.wire:
        print(json.dumps(wire_costs(args.requests, args.prefix + args.unique), indent=1))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = str(long_context_model(Path(tmp)))
        prompts = workload(args.requests, args.prefix, args.unique, 320)
        proc, port = start_server(model, args)
        try:
            # The engine process: the server's child that is not multiprocessing's resource tracker (no parser
            # process is started: these bodies are below body.OFFLOAD_BYTES).
            engine = [c for c in child_pids(proc.pid) if "resource_tracker" not in Path(f"/proc/{c}/cmdline").read_text()]
            pids = {"server": proc.pid, "engine": engine[0]}
            post(port, "/generate", {"prompt": prompts[0][:8], "sampling_params": {"max_new_tokens": 2}})
            time.sleep(args.hold)
            bodies = [request_bytes(port, p, args.output) for p in prompts]
            if not args.cold:  # fill the cache: the measured rounds then prefill one token per request
                asyncio.run(http_round(port, bodies, pids, cold=False))
            for _ in range(args.rounds):
                rows.append({"mode": "HTTP /generate, engine process",
                             **asyncio.run(http_round(port, bodies, pids, args.cold))})
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        if args.inprocess:
            from prefixrt.engine.engine import Engine

            eng = Engine(model, device="cpu", kv_cache_tokens=args.kv_cache_tokens,
                         max_running_requests=args.requests)
            eng.generate(prompts[0][:8], {"max_new_tokens": 2})
            if not args.cold:
                asyncio.run(inprocess_round(eng, prompts, args.output, cold=False))
            for _ in range(args.rounds):
                rows.append({"mode": "in-process Engine.astream",
                             **asyncio.run(inprocess_round(eng, prompts, args.output, args.cold))})
            eng.shutdown()
    body_kb = len(request_bytes(0, prompts[0], args.output)) / 1024
    print(json.dumps({"workload": {**vars(args), "body_kib": round(body_kb, 1)}, "rounds": rows}, indent=1))


if __name__ == "__main__":
    main()
