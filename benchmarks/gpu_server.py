"""`prefixrt serve` against the in-process engine, and a cold start against a warm one (Llama-3-8B shape, dummy bf16).

Two phases, each one command (run `cold` first, on a freshly started machine, so its first start is really cold):

    PYTHONPATH=$PWD python benchmarks/gpu_server.py --phase cold      # ~2.5 min on an H200
    PYTHONPATH=$PWD python benchmarks/gpu_server.py --phase compare   # ~3 min on an H200
    PYTHONPATH=$PWD python benchmarks/gpu_server.py --phase cold --smoke   # tiny shapes on the CPU (tests the script)

cold: `prefixrt serve` started as users start it (a subprocess; the engine in its own process) with an empty
--compile-cache-dir (COMPILE_CACHE, default /tmp/prefixrt-gpu-server-cache, emptied first): start-up time (spawn
to /health answering) and its Triton kernel builds (count, seconds: the start-up log's "compiled:" line); the
first RAG batch (64 x (3500 shared + 80 unique), 200 out, 64 concurrent streaming clients on /v1/completions,
the cache flushed before) against a warm one; a mixed workload after it (hot-prefix requests, odd batch sizes and
lengths, a prompt longer than one prefill chunk) and the Triton builds counted while serving (the
prefixrt_triton_kernel_builds metric, phase="serving": should be 0); then the server stopped and started again
on the filled cache: start-up time and builds.
compare: in the same run, the RAG case in-process (Engine.astream with text, as benchmarks/gpu_engine.py) and
through `prefixrt serve` with 64 streaming clients (httpx), a warm-up batch each then the measured one: out tok/s
and TTFT p50 both, the ratio; hot-prefix TTFT (3500 cached + 80 new, one request at a time, 20 requests) p50 /
p99 in-process and through HTTP. The server starts on the cache `cold` filled. `--trace-engine` adds one more
batch with the engine's loop steps and each request's arrival, admission and first token recorded (the `traced`
entry: when the requests reached the engine, against the clients' sends).

Prints a table last and writes benchmarks/results/gpu_server_<phase>.json (or $OUT/gpu_server_<phase>.json).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import free_port, log, script_parser

REPO = Path(__file__).resolve().parents[1]
RESULTS: dict = {}
# sitecustomize for --profile-server: yappi (CPU clock, every thread) between SIGUSR1 and SIGUSR2, saved as
# <dir>/<pid>.pstat plus, in <dir>/<pid>.txt, per-thread CPU totals and the 40 functions of most own CPU time and
# of most CPU time with callees (readable without the pstat file).
PROFILE_BOOT = """
import os, signal, sys
_dir = os.environ.get("GPU_SERVER_PROFILE_DIR")
if _dir:
    def _start(*_):
        import yappi
        yappi.set_clock_type("cpu")
        yappi.start(profile_threads=True)
    def _save(*_):
        import yappi
        yappi.stop()
        base = os.path.join(_dir, str(os.getpid()))
        yappi.get_func_stats().save(base + ".pstat", "pstat")
        with open(base + ".txt", "w") as f:
            f.write(" ".join(sys.argv) + "\\n")
            yappi.get_thread_stats().print_all(out=f)
            import pstats
            for key in ("tottime", "cumulative"):
                f.write(f"\\n=== functions by {key}\\n")
                pstats.Stats(base + ".pstat", stream=f).sort_stats(key).print_stats(40)
        yappi.clear_stats()
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _save)
"""
# sitecustomize for --trace-engine: in the engine process, every loop step (monotonic start and end, waiting and
# running counts before it) and every finished request (arrival at the engine, admission, first token, finish)
# between SIGUSR1 and SIGUSR2, saved as <dir>/<pid>.trace.json with a (time.time, time.monotonic) pair so the
# client's send times line up. Benchmark-only instrumentation: the engine is patched here, not changed.
TRACE_BOOT = """
import json, os, signal, time
_dir = os.environ.get("GPU_SERVER_TRACE_DIR")
if _dir:
    _trace = {"on": False, "steps": [], "requests": []}
    def _install():
        from prefixrt.engine.loop import core, postprocess
        step, timing = core.EngineCore.step, postprocess.request_timing
        def traced_step(self):
            if not _trace["on"]:
                return step(self)
            w, r, t0 = len(self.scheduler.waiting), len(self.scheduler.running), time.monotonic()
            ran = step(self)
            if ran:
                _trace["steps"].append((t0, time.monotonic(), w, r))
            return ran
        def traced_timing(req):
            if _trace["on"]:
                _trace["requests"].append((req.arrival, req.admitted_time, req.first_token_time, time.monotonic()))
            return timing(req)
        core.EngineCore.step, postprocess.request_timing = traced_step, traced_timing
    def _start(*_):
        _install() if not _trace.get("installed") else None
        _trace.update(installed=True, on=True, steps=[], requests=[])
    def _save(*_):
        _trace["on"] = False
        if _trace["steps"] or _trace["requests"]:
            with open(os.path.join(_dir, f"{os.getpid()}.trace.json"), "w") as f:
                json.dump({"wall_minus_monotonic": time.time() - time.monotonic(), "steps": _trace["steps"],
                           "requests": _trace["requests"]}, f)
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _save)
"""


def shape(smoke: bool) -> dict:
    if smoke:
        return dict(requests=4, shared=64, unique=8, output=6, hot_shared=64, hot_new=8, hot_n=5, vocab=300,
                    long_prompt=100, mixed_lens=[3, 10, 40])
    return dict(requests=64, shared=3500, unique=80, output=200, hot_shared=3500, hot_new=80, hot_n=20,
                vocab=32000, long_prompt=8100, mixed_lens=[5, 17, 100, 700, 2000])


def rag_prompts(s: dict, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(16, s["vocab"]) for _ in range(s["shared"])]
    return [shared + [rng.randrange(16, s["vocab"]) for _ in range(s["unique"])] for _ in range(s["requests"])]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


# ------------------------------------------------------------------------------------------------ the server
class Server:
    """`python -m prefixrt.cli serve ...` in a subprocess; start-up timed from spawn to /health answering."""

    def __init__(self, model: str, engine_args: list[str], log_path: Path, profile_dir: Path | None = None,
                 trace_dir: Path | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
        if profile_dir is not None and trace_dir is not None:
            raise ValueError("--profile-server and --trace-engine each install a sitecustomize: one at a time")
        if profile_dir is not None or trace_dir is not None:  # SIGUSR1 starts, SIGUSR2 saves (both processes)
            boot = Path(tempfile.mkdtemp(prefix="gpu-server-boot-"))
            (boot / "sitecustomize.py").write_text(PROFILE_BOOT if profile_dir is not None else TRACE_BOOT)
            env["PYTHONPATH"] = f"{boot}{os.pathsep}{env['PYTHONPATH']}"
            env["GPU_SERVER_PROFILE_DIR" if profile_dir is not None else "GPU_SERVER_TRACE_DIR"] = str(
                profile_dir if profile_dir is not None else trace_dir)
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "prefixrt.cli", "serve", "--model", model, "--port", str(self.port),
             "--log-level", "warning", "--any-model-name", *engine_args],
            env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 240) -> float:
        import httpx

        while time.perf_counter() - self.t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.log()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.perf_counter() - self.t0
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the server did not answer in {timeout}s:\n{self.log()[-3000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def compiled(self) -> dict:
        """The start-up log's 'compiled: N Triton kernel builds in Xs' line."""
        m = re.search(r"compiled: (\d+) Triton kernel builds in ([\d.]+)s", self.log())
        return {"builds": int(m.group(1)), "seconds": float(m.group(2))} if m else {}

    def startup_lines(self) -> dict:
        """The engine's own start-up figure and the parallel builds' line, from the start-up log."""
        text, out = self.log(), {}
        m = re.search(r"start-up: ([\d.]+)s: (.*) \(\d+% named\)", text)
        if m:  # stages in the order they ran; the weights are loaded once "load weights" ends
            stages = [(name, float(s)) for name, s in re.findall(r"([^,]+?) ([\d.]+)s(?:, |$)", m.group(2))]
            names = [name for name, _ in stages]
            upto = names.index("load weights") + 1 if "load weights" in names else 0
            out.update(engine_startup_s=float(m.group(1)), startup_stages=dict(stages),
                       weights_s=round(sum(s for _, s in stages[:upto]), 1))
        m = re.search(r"parallel Triton builds: (\d+) of (\d+) kernel variants built by (\d+) worker processes in "
                      r"([\d.]+)s", text)
        if m:
            out.update(parallel_built=int(m.group(1)), parallel_variants=int(m.group(2)),
                       parallel_workers=int(m.group(3)), parallel_s=float(m.group(4)))
        return out

    def serving_builds(self) -> float | None:
        import httpx

        try:
            text = httpx.get(self.url + "/metrics", timeout=30).text
        except httpx.HTTPError:
            return None
        m = re.search(r'prefixrt_triton_kernel_builds_total\{phase="serving"\} ([0-9.e+]+)', text)
        return float(m.group(1)) if m else None

    def pids(self) -> dict[str, int]:
        """The server process and its engine process."""
        from benchmarks.common import child_pids

        engines = [c for c in child_pids(self.proc.pid) if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
        return {"server": self.proc.pid, **({"engine": engines[0]} if engines else {})}

    def signal_all(self, sig: int) -> None:
        for pid in self.pids().values():
            os.kill(pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


async def _stream_requests(url: str, prompts: list[list[int]], max_tokens: int, start_at: float | None = None
                           ) -> dict:
    """One client process's share: a streaming OpenAI-style client per prompt on /v1/completions (httpx, as the
    openai SDK uses), all at once. With start_at (a time.time()), the connections are opened first and the
    requests go at that moment, so that several processes start together. Per request: send, first streamed event
    and end as time.time(); the process's CPU seconds while streaming."""
    import httpx

    reqs: list[dict] = []

    async def one(http, p):
        body = {"model": "m", "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        r = {"send": time.time(), "first": None, "tokens": 0, "chars": 0}
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:500]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                ev = json.loads(line[6:])
                if ev.get("choices"):
                    if r["first"] is None:
                        r["first"] = time.time()
                    r["chars"] += len(ev["choices"][0].get("text") or "")
                if ev.get("usage"):
                    r["tokens"] += ev["usage"]["completion_tokens"]
        r["end"] = time.time()
        r["first"] = r["first"] or r["end"]
        reqs.append(r)

    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        if start_at is not None:  # one open connection per request, as a long-lived client has
            await asyncio.gather(*(http.get("/health") for _ in prompts))
            await asyncio.sleep(max(0.0, start_at - time.time()))
        cpu0 = time.process_time()
        await asyncio.gather(*(one(http, p) for p in prompts))
        cpu = time.process_time() - cpu0
    return {"requests": reqs, "cpu_s": cpu}


def _client_process(url: str, prompts: list[list[int]], max_tokens: int, start_at: float) -> dict:
    return asyncio.run(_stream_requests(url, prompts, max_tokens, start_at))


class Clients:
    """`procs` client processes (spawned once, reused), each streaming its share of a batch: 64 users are not one
    Python process, and one httpx process cannot parse 8,000 SSE events a second (it was the bottleneck)."""

    def __init__(self, procs: int):
        import concurrent.futures
        import multiprocessing

        self.procs = procs
        self.pool = concurrent.futures.ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn"))
        list(self.pool.map(_ping, range(procs)))  # started and importing before the first batch

    def batch(self, url: str, prompts: list[list[int]], max_tokens: int) -> dict:
        return batch_summary(self.parts(url, prompts, max_tokens))

    def parts(self, url: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:
        """Each process's requests (send, first event, end as time.time()) and CPU seconds."""
        shares = [prompts[i::self.procs] for i in range(self.procs)]
        start_at = time.time() + 0.5
        return list(self.pool.map(_client_process, [url] * len(shares), shares, [max_tokens] * len(shares),
                                  [start_at] * len(shares)))

    def close(self) -> None:
        self.pool.shutdown()


def _ping(_: int) -> int:
    import httpx  # noqa: F401  (imported before the first batch)

    return os.getpid()


def batch_summary(parts: list[dict]) -> dict:
    """Out tok/s over the batch (first send to last end), TTFT p50 (send to first streamed event), and the
    busiest client process's CPU use (a value near 1.0 means the clients, not the server, set the pace)."""
    reqs = [r for part in parts for r in part["requests"]]
    t0, t1 = min(r["send"] for r in reqs), max(r["end"] for r in reqs)
    toks = sum(r["tokens"] for r in reqs)
    ttfts = [r["first"] - r["send"] for r in reqs]
    return {"seconds": round(t1 - t0, 3), "out_tok_s": round(toks / (t1 - t0), 1),
            "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1), "output_tokens": toks,
            "text_chars": sum(r["chars"] for r in reqs), "client_procs": len(parts),
            "busiest_client_cpu": round(max(part["cpu_s"] for part in parts) / (t1 - t0), 2)}


def trace_summary(parts: list[dict], trace: dict, window_s: float = 0.8) -> dict:
    """A traced batch, in ms from the first client send: when the requests reached the engine, were admitted and
    got their first token (p0 / p50 / p100), the engine's own TTFT (arrival to first token) against the client's,
    and the loop steps of the first window_s (start, length, waiting and running before it)."""
    reqs = [r for part in parts for r in part["requests"]]
    t0 = min(r["send"] for r in reqs)
    shift = trace["wall_minus_monotonic"]
    rows = [q for q in trace["requests"] if q[0] + shift >= t0 - 1.0]

    def ms(xs):
        xs = sorted((x + shift - t0) * 1000 for x in xs if x is not None)
        return [round(xs[0], 1), round(statistics.median(xs), 1), round(xs[-1], 1)] if xs else None

    steps = [(round((a + shift - t0) * 1000, 1), round((b - a) * 1000, 1), w, r)
             for a, b, w, r in trace["steps"] if -0.05 <= a + shift - t0 <= window_s]
    return {"requests": len(rows), "client_send_ms": ms([r["send"] - shift for r in reqs]),
            "engine_arrival_ms": ms([q[0] for q in rows]), "admitted_ms": ms([q[1] for q in rows]),
            "first_token_ms": ms([q[2] for q in rows]),
            "client_first_event_ms": ms([r["first"] - shift for r in reqs]),
            "engine_ttft_p50_ms": round(statistics.median((q[2] - q[0]) * 1000 for q in rows if q[2]), 1),
            "client_ttft_p50_ms": round(statistics.median((r["first"] - r["send"]) * 1000 for r in reqs), 1),
            "steps_start_len_waiting_running": steps}


def measured_batch(srv: Server, prompts, max_tokens, clients: Clients | None = None) -> dict:
    """http_batch with the CPU use (CPU seconds / batch seconds) of the server and engine processes."""
    from benchmarks.common import cpu_seconds

    pids = srv.pids()
    cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
    out = http_batch(srv.url, prompts, max_tokens, clients)
    for k, p in pids.items():
        out[f"{k}_cpu"] = round((cpu_seconds(p) - cpu0[k]) / out["seconds"], 2)
    return out


def http_batch(url, prompts, max_tokens, clients: Clients | None = None) -> dict:
    """A batch from `clients` (several processes), or from this process alone."""
    if clients is not None:
        return clients.batch(url, prompts, max_tokens)
    return batch_summary([asyncio.run(_stream_requests(url, prompts, max_tokens))])


def hot_request_windows(url: str, shared_len: int, new_len: int, n: int, vocab: int, seed: int = 5,
                        pause_s: float = 0.0) -> list[tuple[float, float, float]]:
    """The hot-prefix case through HTTP: the prefix cached (/cache_prefix, then 3 warm requests), then n requests
    of prefix + new_len fresh tokens one at a time (pause_s between them), each read to the end. Per request,
    time.monotonic at its send, its first streamed event and its end."""
    import httpx

    rng = random.Random(seed)
    shared = [rng.randrange(16, vocab) for _ in range(shared_len)]
    with httpx.Client(base_url=url, timeout=120) as http:
        http.post("/flush_cache").raise_for_status()
        http.post("/cache_prefix", json={"prompt": shared}).raise_for_status()

        def once() -> tuple[float, float, float]:
            body = {"model": "m", "prompt": shared + [rng.randrange(16, vocab) for _ in range(new_len)],
                    "max_tokens": 1, "temperature": 0, "ignore_eos": True, "stream": True}
            t0, first = time.monotonic(), None
            with http.stream("POST", "/v1/completions", json=body) as resp:
                for line in resp.iter_lines():  # read to the end: the next request finds the engine idle
                    if first is None and line.startswith("data: {"):
                        first = time.monotonic()
            if first is None:
                raise RuntimeError("no event")
            end = time.monotonic()
            time.sleep(pause_s)
            return t0, first, end

        for _ in range(3):
            once()
        return [once() for _ in range(n)]


def http_hot_ttft(url: str, s: dict, seed: int = 5) -> dict:
    """hot_request_windows with the benchmark's shape: TTFT to the first streamed event, p50 / p99."""
    xs = [first - t0 for t0, first, _ in
          hot_request_windows(url, s["hot_shared"], s["hot_new"], s["hot_n"], s["vocab"], seed)]
    return {"p50_ms": round(pct(xs, 0.5) * 1000, 2), "p99_ms": round(pct(xs, 0.99) * 1000, 2), "n": len(xs)}


def flush(url: str) -> None:
    import httpx

    httpx.post(url + "/flush_cache", timeout=120).raise_for_status()


def mixed_workload(url: str, s: dict) -> None:
    """Shapes a served mix reaches beyond the RAG batch: single requests, odd batch sizes (1..63) with prompts
    of many lengths, and one prompt near the context (8192 on the 8B shape)."""
    rng = random.Random(11)
    for n in (1, 3, 7, 13, 31, 63):
        prompts = [[rng.randrange(16, s["vocab"]) for _ in range(rng.choice(s["mixed_lens"]))] for _ in range(n)]
        http_batch(url, prompts, rng.choice([1, 5, 33]))
    http_batch(url, [[rng.randrange(16, s["vocab"]) for _ in range(s["long_prompt"])]], 4)


# --------------------------------------------------------------------------------------------------- phases
def engine_setup(args) -> tuple[str, list[str], dict]:
    s = shape(args.smoke)
    if args.smoke:
        from benchmarks.common import tiny_model_dir

        model = str(args.model or tiny_model_dir(Path(tempfile.mkdtemp(prefix="gpu-server-smoke-"))))
        return model, ["--device", "cpu", "--kv-cache-tokens", "20000"], s
    return args.model or "llama-3-8b", ["--load-format", "dummy", "--kv-cache-tokens", "330000"], s


def phase_cold(args, out: Path) -> list[tuple]:
    model, eng_args, s = engine_setup(args)
    cache = Path(args.compile_cache)
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    rows = []
    t = time.perf_counter()
    from prefixrt.hub.registry import resolve_model

    resolve_model(model)  # a built-in shape's folder (config, tokenizer) is written once: a deployment has its own
    log(f"model folder ready in {time.perf_counter() - t:.1f}s (not part of the start-up below)")
    clients = Clients(args.client_procs)
    srv = Server(model, [*eng_args, "--compile-cache-dir", str(cache)], out / "gpu_server_cold_serve1.log")
    try:
        start1 = srv.wait_ready()
        comp1 = {**srv.compiled(), **srv.startup_lines()}
        log(f"start-up, empty compile cache: {start1:.1f}s; {comp1}")
        prompts = rag_prompts(s)
        first = measured_batch(srv, prompts, s["output"], clients)
        log(f"first RAG batch: {first}")
        flush(srv.url)
        warm = measured_batch(srv, prompts, s["output"], clients)
        log(f"warm RAG batch: {warm}")
        hot = http_hot_ttft(srv.url, s)
        mixed_workload(srv.url, s)
        serving = srv.serving_builds()
        log(f"Triton builds while serving (RAG, hot prefix, mixed): {serving}")
    finally:
        srv.stop()
    srv2 = Server(model, [*eng_args, "--compile-cache-dir", str(cache)], out / "gpu_server_cold_serve2.log")
    try:
        start2 = srv2.wait_ready()
        comp2 = {**srv2.compiled(), **srv2.startup_lines()}
        log(f"start-up, filled compile cache: {start2:.1f}s; {comp2}")
    finally:
        srv2.stop()
        clients.close()
    ratio = first["out_tok_s"] / warm["out_tok_s"] if warm["out_tok_s"] else 0.0
    RESULTS.update(startup_empty_cache_s=round(start1, 1), startup_empty_cache_compile=comp1,
                   first_batch=first, warm_batch=warm, first_over_warm=round(ratio, 3), http_hot_ttft=hot,
                   serving_triton_builds=serving, startup_filled_cache_s=round(start2, 1),
                   startup_filled_cache_compile=comp2, compile_cache=str(cache))
    rows += [("start-up, empty compile cache (s)", f"{start1:.1f}", "<= 30 (spawn to /health)"),
             ("  engine start-up (s)", f"{comp1.get('engine_startup_s', '?')}", ""),
             ("  parallel builds (variants, s, workers)",
              f"{comp1.get('parallel_variants', '-')}, {comp1.get('parallel_s', '-')}, {comp1.get('parallel_workers', '-')}",
              ""),
             ("  of which Triton builds (s, count)", f"{comp1.get('seconds', '?')}, {comp1.get('builds', '?')}", ""),
             ("start-up, filled cache (s)", f"{start2:.1f}", "<= 15"),
             ("  engine start-up (s)", f"{comp2.get('engine_startup_s', '?')}", ""),
             ("  of which Triton builds (s, count)", f"{comp2.get('seconds', '?')}, {comp2.get('builds', '?')}", ""),
             ("first RAG batch out tok/s / TTFT p50 ms", f"{first['out_tok_s']} / {first['ttft_p50_ms']}", ""),
             ("warm RAG batch out tok/s / TTFT p50 ms", f"{warm['out_tok_s']} / {warm['ttft_p50_ms']}", ""),
             ("first / warm", f"{ratio:.2f}", ">= 0.9"),
             ("  busiest client process CPU (first, warm)",
              f"{first['busiest_client_cpu']}, {warm['busiest_client_cpu']}", ""),
             ("Triton builds while serving", f"{serving}", "0"),
             ("hot-prefix TTFT via HTTP p50 / p99 ms", f"{hot['p50_ms']} / {hot['p99_ms']}", "p50 <= 12")]
    return rows


def phase_compare(args, out: Path) -> list[tuple]:
    import prefixrt
    from benchmarks.common import HotPrefix, stream_text

    model, eng_args, s = engine_setup(args)
    prompts = rag_prompts(s)
    kw = dict(device="cpu", kv_cache_tokens=20000) if args.smoke else dict(load_format="dummy",
                                                                           kv_cache_tokens=330_000)
    if args.compile_cache and Path(args.compile_cache).is_dir():
        kw["compile_cache_dir"] = args.compile_cache
    eng = prefixrt.Engine(model, **kw)
    try:
        stream_text(eng, prompts, s["output"], len(prompts))  # warm-up batch
        eng.flush_cache()
        inproc = stream_text(eng, prompts, s["output"], len(prompts))
        log(f"in-process RAG: {inproc}")
        hp = HotPrefix(eng, s["vocab"], s["hot_shared"], s["hot_new"])
        xs = hp.hot(s["hot_n"])
        hot_in = {"p50_ms": round(pct(xs, 0.5) * 1000, 2), "p99_ms": round(pct(xs, 0.99) * 1000, 2), "n": len(xs)}
        log(f"in-process hot-prefix TTFT: {hot_in}")
    finally:
        eng.shutdown()
        del eng
        import gc

        gc.collect()
        try:
            import torch

            torch.cuda.empty_cache()
        except Exception:
            pass
    extra = ["--compile-cache-dir", args.compile_cache] if Path(args.compile_cache).is_dir() else []
    profile = out / "gpu_server_profile" if args.profile_server else None
    if profile is not None:
        profile.mkdir(exist_ok=True)
    trace_dir = Path(tempfile.mkdtemp(prefix="gpu-server-trace-")) if args.trace_engine else None
    srv = Server(model, [*eng_args, *extra], out / "gpu_server_compare_serve.log", profile_dir=profile,
                 trace_dir=trace_dir)
    clients = Clients(args.client_procs)
    try:
        start = srv.wait_ready()
        measured_batch(srv, prompts, s["output"], clients)  # warm-up batch
        flush(srv.url)
        http = measured_batch(srv, prompts, s["output"], clients)
        log(f"HTTP RAG, {args.client_procs} client processes: {http}")
        flush(srv.url)
        http_one = measured_batch(srv, prompts, s["output"])
        log(f"HTTP RAG, one client process: {http_one}")
        hot_http = http_hot_ttft(srv.url, s)
        log(f"HTTP hot-prefix TTFT: {hot_http}")
        if profile is not None:  # one more batch under yappi (slower: for where the time goes, not for speed)
            flush(srv.url)
            srv.signal_all(signal.SIGUSR1)
            time.sleep(0.5)
            log(f"HTTP RAG under the profiler: {measured_batch(srv, prompts, s['output'], clients)}")
            srv.signal_all(signal.SIGUSR2)
            time.sleep(3)
        if trace_dir is not None:  # one more batch with the engine's steps and requests recorded
            flush(srv.url)
            srv.signal_all(signal.SIGUSR1)
            time.sleep(0.5)
            parts = clients.parts(srv.url, prompts, s["output"])
            srv.signal_all(signal.SIGUSR2)
            time.sleep(1)
            traces = [json.loads(f.read_text()) for f in trace_dir.glob("*.trace.json")]
            RESULTS["traced"] = {"batch": batch_summary(parts), **trace_summary(parts, max(
                traces, key=lambda t: len(t["requests"])))} if traces else {"error": "no trace written"}
            log(f"HTTP RAG traced: {RESULTS['traced']}")
    finally:
        srv.stop()
        clients.close()
    ratio = http["out_tok_s"] / inproc["out_tok_s"] if inproc["out_tok_s"] else 0.0
    RESULTS.update(inprocess=inproc, http=http, http_one_client_process=http_one, http_over_inprocess=round(ratio, 3),
                   ttft_p50_gap_ms=round(http["ttft_p50_ms"] - inproc["ttft_p50_ms"], 1), hot_inprocess=hot_in,
                   hot_http=hot_http, server_startup_s=round(start, 1))
    return [("RAG in-process out tok/s / TTFT p50 ms", f"{inproc['out_tok_s']} / {inproc['ttft_p50_ms']}", ""),
            ("RAG via serve out tok/s / TTFT p50 ms", f"{http['out_tok_s']} / {http['ttft_p50_ms']}",
             f"{args.client_procs} client procs, busiest at {http['busiest_client_cpu']} CPU"),
            ("  CPU use: server / engine process", f"{http.get('server_cpu')} / {http.get('engine_cpu')}", ""),
            ("  one client process: out tok/s / TTFT p50 ms", f"{http_one['out_tok_s']} / {http_one['ttft_p50_ms']}",
             f"client at {http_one['busiest_client_cpu']} CPU"),
            ("serve / in-process", f"{ratio:.3f}", ">= 0.95"),
            ("TTFT p50 gap ms", f"{http['ttft_p50_ms'] - inproc['ttft_p50_ms']:.1f}", "<= 40"),
            ("hot-prefix TTFT in-process p50 / p99 ms", f"{hot_in['p50_ms']} / {hot_in['p99_ms']}", "p50 <= 6"),
            ("hot-prefix TTFT via serve p50 / p99 ms", f"{hot_http['p50_ms']} / {hot_http['p99_ms']}", "p50 <= 12")]


def main() -> None:
    ap = script_parser(__doc__, smoke="tiny shapes on the CPU, to test the script")
    ap.add_argument("--phase", choices=["cold", "compare"], required=True)
    ap.add_argument("--client-procs", type=int, default=8, help="client processes the 64 streams are spread over")
    ap.add_argument("--profile-server", action="store_true",
                    help="compare: one more batch with yappi in the server and engine processes (needs yappi)")
    ap.add_argument("--trace-engine", action="store_true",
                    help="compare: one more batch with the engine's steps and request times recorded (traced)")
    ap.add_argument("--model", default=None, help="default: llama-3-8b (dummy weights); --smoke: a tiny Llama")
    ap.add_argument("--compile-cache", default=os.environ.get("COMPILE_CACHE", "/tmp/prefixrt-gpu-server-cache"),
                    help="the --compile-cache-dir `cold` empties and fills, and `compare` starts on")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT") or REPO / "benchmarks" / "results")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = phase_cold(args, out) if args.phase == "cold" else phase_compare(args, out)
    RESULTS["phase"], RESULTS["smoke"], RESULTS["wall_s"] = args.phase, args.smoke, round(time.perf_counter() - t0, 1)
    path = out / f"gpu_server_{args.phase}{'_smoke' if args.smoke else ''}.json"
    path.write_text(json.dumps(RESULTS, indent=1))
    log(f"\ngpu_server.py --phase {args.phase}{' (smoke, CPU)' if args.smoke else ''}: {RESULTS['wall_s']}s; {path}")
    w = max(len(r[0]) for r in rows)
    log(f"{'measure':<{w}}  {'value':>24}  target")
    for name, value, target in rows:
        log(f"{name:<{w}}  {value:>24}  {target}")


if __name__ == "__main__":
    main()
