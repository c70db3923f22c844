"""HTTP serving overhead and GIL check: the same shared-prefix workload in-process vs through `prefixrt serve`.

    PYTHONPATH=$PWD python benchmarks/server_overhead.py [--model PATH] [--load-format dummy] [--requests 256] ...

Without --model, a tiny random Llama (2 layers, hidden 64, vocab 320) with a byte-level tokenizer is built in
a temp folder: the model step is then so cheap that any HTTP/GIL cost shows. Each request: a shared prefix
of --prefix tokens + --unique tokens of its own, --output tokens out (greedy, ignore_eos), all submitted at
once (concurrency = --requests) and streamed as text. The server runs in its own process (as users run it):
as `prefixrt serve` runs by default (the engine in a process of its own) and with --engine-in-process (the
scheduler loop on a thread of the server process); --modes picks the rows. The client streams every request
from /v1/completions SSE, with httpx.AsyncClient or (--client openai) the openai SDK's AsyncOpenAI; --client
bench streams token ids from /generate through RemoteEngine, as `prefixrt bench --url` does.

Besides throughput, each HTTP row gives the server process's CPU time per streamed token (user + system, from
/proc, over the timed run) and the number of SSE events the client received (fewer than tokens when the server
sent several tokens in one event).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import child_pids, cpu_seconds, free_port, int_flags, script_parser, tiny_model_dir

REPO = Path(__file__).resolve().parents[1]


def workload(n: int, prefix: int, unique: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    shared = [1] + [rng.randrange(3, vocab) for _ in range(prefix - 1)]
    return [shared + [rng.randrange(3, vocab) for _ in range(unique)] for _ in range(n)]


def process_cpu(pids: dict[str, int]) -> dict[str, float]:
    return {name: cpu_seconds(pid) for name, pid in pids.items()}


def summarize(name: str, wall: float, ttfts: list[float], tokens: int, passes: int) -> dict:
    ttfts = sorted(ttfts)
    return {"mode": name, "wall_s": round(wall, 3), "output_tok_s": round(tokens / wall, 1),
            "forward_passes_per_s": round(passes / wall, 1),
            "ttft_p50_s": round(ttfts[len(ttfts) // 2], 3), "ttft_p99_s": round(ttfts[int(len(ttfts) * 0.99) - 1], 3)}


async def run_inprocess(model: str, prompts, output: int, engine_kw: dict, text: bool = True) -> dict:
    from prefixrt.engine.engine import Engine

    eng = Engine(model, **engine_kw)
    params = {"max_new_tokens": output, "temperature": 0, "ignore_eos": True, "detokenize": text}
    eng.generate(prompts[0][:8], {"max_new_tokens": 2})  # warm up
    eng.flush_cache()
    passes0 = eng.stats().forward_passes_total
    cpu0 = cpu_seconds(os.getpid())
    t0 = time.perf_counter()

    async def one(p):
        first, n = None, 0
        async for ch in eng.astream(p, params):
            if first is None and ch.token_ids:
                first = time.perf_counter() - t0
            n += len(ch.token_ids)
        return first, n

    res = await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - t0
    cpu = {"client+engine": round(cpu_seconds(os.getpid()) - cpu0, 2)}
    passes = eng.stats().forward_passes_total - passes0
    eng.shutdown()
    return {**summarize("in-process (Engine.astream)", wall, [r[0] for r in res], sum(r[1] for r in res), passes),
            "cpu_s": cpu}


async def run_http(model: str, prompts, output: int, engine_args: list[str], label: str,
                   client: str = "httpx") -> dict:
    import httpx

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "prefixrt.cli", "serve", "--model", model, "--port", str(port),
                             "--log-level", "warning", *engine_args], env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=1024)) as http:
            while True:
                try:
                    if (await http.get("/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    await asyncio.sleep(0.3)
            await http.post("/generate", json={"prompt": prompts[0][:8], "sampling_params": {"max_new_tokens": 2}})
            await http.post("/flush_cache")
            passes0 = (await http.get("/stats")).json()["forward_passes_total"]
            # CPU seconds per process over the run: where the time goes on a small machine.
            pids = {"client": os.getpid(), "server": proc.pid}
            pids.update({f"engine{'' if k == 0 else k}": c for k, c in
                         enumerate(c for c in child_pids(proc.pid) if "resource_tracker" not in
                                   Path(f"/proc/{c}/cmdline").read_text())})
            cpu0 = process_cpu(pids)
            t0 = time.perf_counter()

            events = 0

            async def one_httpx(p):
                nonlocal events
                body = {"model": "m", "prompt": p, "max_tokens": output, "temperature": 0, "ignore_eos": True,
                        "stream": True, "stream_options": {"include_usage": True}}
                first, n = None, 0
                async with http.stream("POST", "/v1/completions", json=body) as resp:
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        d = json.loads(line[6:])
                        if d["choices"] and first is None:
                            first = time.perf_counter() - t0
                        events += bool(d["choices"])
                        if d.get("usage"):
                            n = d["usage"]["completion_tokens"]
                return first, n

            async def one_openai(p):
                nonlocal events
                first, n = None, 0
                stream = await oai.completions.create(
                    model="m", prompt=p, max_tokens=output, temperature=0, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
                async for ev in stream:
                    if ev.choices and first is None:
                        first = time.perf_counter() - t0
                    events += bool(ev.choices)
                    if ev.usage is not None:
                        n = ev.usage.completion_tokens
                return first, n

            oai = None
            if client == "openai":
                import openai

                oai = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600,
                                         http_client=httpx.AsyncClient(timeout=600, limits=httpx.Limits(
                                             max_connections=1024)))
            async def one_remote(p):  # what `prefixrt bench --url` does: /generate SSE, token ids, no text
                nonlocal events
                first, n = None, 0
                async for ch in remote.astream(p, {"max_new_tokens": output, "temperature": 0,
                                                   "ignore_eos": True, "detokenize": False}):
                    if first is None and ch.token_ids:
                        first = time.perf_counter() - t0
                    events += bool(ch.token_ids)
                    n += len(ch.token_ids)
                return first, n

            if client == "bench":
                from prefixrt.remote import RemoteEngine

                remote = RemoteEngine(url)
            one = {"openai": one_openai, "bench": one_remote}.get(client, one_httpx)
            res = await asyncio.gather(*(one(p) for p in prompts))
            wall = time.perf_counter() - t0
            cpu = {k: round(v - cpu0[k], 2) for k, v in process_cpu(pids).items()}
            passes = (await http.get("/stats")).json()["forward_passes_total"] - passes0
            if oai is not None:
                await oai.close()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its engine/parser processes
        proc.wait(timeout=60)
    tokens = sum(r[1] for r in res)
    return {**summarize(label, wall, [r[0] for r in res], tokens, passes), "cpu_s": cpu, "sse_events": events,
            "server_cpu_us_per_token": round(1e6 * cpu["server"] / tokens, 1)}


def main() -> None:
    ap = script_parser(__doc__)
    ap.add_argument("--model", default=None, help="default: a tiny random Llama built in a temp folder")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    int_flags(ap, requests=256, prefix=64, unique=8, output=32, max_running_requests=256,
              kv_cache_tokens=65536)
    ap.add_argument("--client", default="httpx", choices=["httpx", "openai", "bench"],
                    help="the HTTP rows' client: httpx or openai stream /v1/completions text; bench streams "
                         "/generate token ids through RemoteEngine as `prefixrt bench --url` does (and the "
                         "in-process row then streams token ids too)")
    ap.add_argument("--modes", default="inprocess,process,thread",
                    help="rows, comma-separated: inprocess (Engine.astream), process (prefixrt serve), "
                         "thread (prefixrt serve --engine-in-process)")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(tiny_model_dir(Path(tmp)))
        if args.model is None:
            vocab = 320
        else:
            from transformers import AutoConfig

            vocab = min(AutoConfig.from_pretrained(model).vocab_size, 30000)
        prompts = workload(args.requests, args.prefix, args.unique, vocab)
        kw = {"device": "cpu", "kv_cache_tokens": args.kv_cache_tokens, "max_running_requests": args.max_running_requests,
              "load_format": args.load_format}
        flags = ["--device", "cpu", "--kv-cache-tokens", str(args.kv_cache_tokens), "--max-running-requests",
                 str(args.max_running_requests), "--load-format", args.load_format]
        rows = []
        for m in modes:
            if m == "inprocess":
                rows.append(asyncio.run(run_inprocess(model, prompts, args.output, kw, args.client != "bench")))
            elif m == "process":
                rows.append(asyncio.run(run_http(model, prompts, args.output, flags,
                                                 f"HTTP ({args.client}), engine process (default)", args.client)))
            elif m == "thread":
                rows.append(asyncio.run(run_http(model, prompts, args.output, [*flags, "--engine-in-process"],
                                                 f"HTTP ({args.client}), engine thread (--engine-in-process)",
                                                 args.client)))
            else:
                raise SystemExit(f"unknown mode {m!r}")
        if "inprocess" in modes:
            base = rows[modes.index("inprocess")]["output_tok_s"]
            for r in rows:
                r["vs_in_process"] = round(r["output_tok_s"] / base, 3)
    print(json.dumps({"workload": vars(args), "results": rows}, indent=2))


if __name__ == "__main__":
    main()
