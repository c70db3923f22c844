"""Agent sessions through `prefixrt serve` with the real openai and anthropic clients: time in tools between turns,
staggered starts, sessions that end and new ones that start, under pools of 1, 1/2 and 1/3 of the working set,
with and without the host tier; per-turn TTFT p50 / p90 and the cache hit rate, every run's baseline (pool 1) in
the same invocation.

Each session: a system prompt shared by all sessions (--shared-tokens), its own task (--own-tokens), then
--turns turns; each turn streams one reply of exactly --output-tokens tokens (ignore_eos), then the session
spends an exponential time in its tool (mean --tool-mean-s) and appends the tool's result (--append-tokens)
before the next turn. --concurrent sessions run at once, started --stagger-s apart; when one ends a new one
starts, until --sessions have run. Clients alternate: even sessions use openai.AsyncOpenAI (Chat Completions,
`prompt_cache_key`), odd ones anthropic.AsyncAnthropic (Messages API, `metadata.user_id`); with --keep, every
turn also keeps its prompt (OpenAI `prompt_cache_options`, Anthropic `cache_control` on its last block).
Text lengths are set in tokens through /v1/messages/count_tokens (the served tokenizer); reported counts are
the server's usage. One server per run (`python -m prefixrt.cli serve`, the engine in its own process); the
trace (tool times, texts) is the same in every run (--seed).

    # the GPU host (Llama-3.1-8B shape, dummy bf16 weights; wheels: see the module's notes in docs/benchmarks.md)
    PYTHONPATH=$PWD python benchmarks/agent_sessions.py --model llama-3.1-8b --load-format dummy --shape agents16
    # the CPU, a tiny model folder (tests/helpers builds one), tiny shapes
    PYTHONPATH=$PWD python benchmarks/agent_sessions.py --smoke /path/to/tiny-hf-folder
Writes $OUT/agent-sessions-<shape>.json when $OUT (or --json) is set.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path

import httpx

SHAPES = {  # concurrent, sessions, turns, shared, own, append, output, tool mean s, stagger s
    "agents16": (16, 24, 6, 16384, 8192, 2048, 64, 3.0, 0.5),  # contexts to ~35k
    "agents12": (12, 16, 4, 49152, 24576, 3072, 64, 3.0, 1.0),  # contexts to ~84k
    "smoke": (4, 6, 3, 96, 48, 24, 4, 0.05, 0.02),
}
DEFAULT_RUNS = "1,1/2+host,1/2,1/3+host,1/3"
WORDS = ("alpha beta gamma delta omega river stone cloud forest ember lantern quartz meadow harbor signal "
         "copper violet thunder saddle marble canyon orbit falcon pepper summit willow").split()


def log(*a):
    print(*a, file=sys.stderr, flush=True)


@dataclass
class Trace:
    """What every run replays: per session its start, texts and tool times."""

    shared: str
    own: list[str]
    appends: list[list[str]]
    tool_s: list[list[float]]
    start_s: list[float]


@dataclass
class TurnRecord:
    session: int
    turn: int
    client: str
    ttft_s: float
    e2e_s: float
    prompt_tokens: int
    cached_tokens: int


@dataclass
class RunResult:
    label: str
    pool_tokens: int
    host_tokens: int
    wall_s: float
    turns: list[TurnRecord] = field(default_factory=list)
    server_stats: dict = field(default_factory=dict)


def words_text(rng: random.Random, n_words: int) -> str:
    return " ".join(f"{rng.choice(WORDS)}{rng.randrange(100)}" for _ in range(n_words))


def make_trace(shape, tokens_per_word: float, seed: int) -> Trace:
    concurrent, sessions, turns, shared, own, append, _, tool_mean, stagger = shape
    rng = random.Random(seed)
    w = lambda n: max(1, round(n / tokens_per_word))  # noqa: E731
    starts = [k * stagger for k in range(concurrent)] + [None] * (sessions - concurrent)
    return Trace(shared=words_text(rng, w(shared)),
                 own=[words_text(rng, w(own)) for _ in range(sessions)],
                 appends=[[words_text(rng, w(append)) for _ in range(turns - 1)] for _ in range(sessions)],
                 tool_s=[[rng.expovariate(1 / tool_mean) if tool_mean > 0 else 0.0 for _ in range(turns - 1)]
            for _ in range(sessions)],
                 start_s=starts)


class Server:
    """`python -m prefixrt.cli serve ...` in a subprocess (its own process group), ready once /health answers."""

    def __init__(self, args: list[str], port: int, log_path: Path):
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen([sys.executable, "-m", "prefixrt.cli", "serve", *args, "--port", str(port)],
                                     stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.log_path = log_path

    def wait_ready(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited:\n" + self.log_path.read_text()[-4000:])
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("server did not come up:\n" + self.log_path.read_text()[-4000:])

    def stop(self) -> None:
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


async def _openai_turn(client, model, messages, out_tokens, key, keep):
    extra = {"ignore_eos": True}
    kwargs = {"prompt_cache_key": key}
    if keep:
        kwargs["prompt_cache_options"] = {"mode": "implicit", "ttl": "30m"}
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=out_tokens, stream=True, stream_options={"include_usage": True},
        extra_body=extra, **kwargs)
    async for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            text.append(ch.choices[0].delta.content)
        if ch.usage is not None:
            usage = ch.usage
    e2e = time.perf_counter() - t0
    return ("".join(text), ttft if ttft is not None else e2e, e2e, usage.prompt_tokens,
            usage.prompt_tokens_details.cached_tokens)


async def _anthropic_turn(client, model, system, messages, out_tokens, key, keep):
    if keep:  # the whole prompt: the breakpoint on the last block
        last = messages[-1]
        messages = messages[:-1] + [{"role": last["role"], "content": [
            {"type": "text", "text": last["content"], "cache_control": {"type": "ephemeral"}}]}]
    t0 = time.perf_counter()
    ttft, text = None, []
    async with client.messages.stream(model=model, max_tokens=out_tokens, system=system, messages=messages,
                                      metadata={"user_id": key}, extra_body={"ignore_eos": True}) as stream:
        async for piece in stream.text_stream:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            text.append(piece)
        final = await stream.get_final_message()
    e2e = time.perf_counter() - t0
    u = final.usage
    prompt = u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)
    return "".join(text), ttft if ttft is not None else e2e, e2e, prompt, u.cache_read_input_tokens or 0


async def run_trace(url: str, model: str, trace: Trace, shape, keep: bool) -> tuple[list[TurnRecord], float]:
    import anthropic
    import openai

    concurrent, sessions, turns, *_ = shape
    out_tokens = shape[6]
    oai = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    ant = anthropic.AsyncAnthropic(base_url=url, api_key="none", max_retries=0, timeout=3600)
    records: list[TurnRecord] = []
    t_start = time.perf_counter()

    async def session(s: int) -> None:
        key = f"session-{s}"
        if s % 2 == 0:
            messages = [{"role": "system", "content": trace.shared}, {"role": "user", "content": trace.own[s]}]
        else:
            messages = [{"role": "user", "content": trace.own[s]}]
        for t in range(turns):
            if s % 2 == 0:
                text, ttft, e2e, prompt, cached = await _openai_turn(oai, model, messages, out_tokens, key, keep)
            else:
                text, ttft, e2e, prompt, cached = await _anthropic_turn(ant, model, trace.shared, messages,
                                                                        out_tokens, key, keep)
            records.append(TurnRecord(s, t, "openai" if s % 2 == 0 else "anthropic", ttft, e2e, prompt, cached))
            if t == turns - 1:
                break
            await asyncio.sleep(trace.tool_s[s][t])
            messages = messages + [{"role": "assistant", "content": text or "."},
                                   {"role": "user", "content": trace.appends[s][t]}]

    queue = list(range(sessions))
    slots = asyncio.Semaphore(concurrent)

    async def slot(s: int) -> None:
        async with slots:
            if trace.start_s[s] is not None:
                await asyncio.sleep(trace.start_s[s])
            await session(s)

    await asyncio.gather(*(slot(s) for s in queue))
    wall = time.perf_counter() - t_start
    await oai.close()
    await ant.close()
    return records, wall


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def summary(r: RunResult, turns: int) -> dict:
    recs = r.turns
    prompt = sum(x.prompt_tokens for x in recs)
    out = {"label": r.label, "pool_tokens": r.pool_tokens, "host_tokens": r.host_tokens, "wall_s": round(r.wall_s, 2),
           "hit_rate": round(sum(x.cached_tokens for x in recs) / prompt, 4) if prompt else 0.0,
           "ttft_p50_ms": round(statistics.median(x.ttft_s for x in recs) * 1000, 1),
           "ttft_p90_ms": round(pct([x.ttft_s for x in recs], 0.9) * 1000, 1), "by_turn": []}
    for t in range(turns):
        xs = [x.ttft_s for x in recs if x.turn == t]
        if xs:
            out["by_turn"].append({"turn": t, "n": len(xs), "p50_ms": round(statistics.median(xs) * 1000, 1),
                                   "p90_ms": round(pct(xs, 0.9) * 1000, 1)})
    s = r.server_stats
    for k in ("retracted_requests_total", "host_hit_tokens_total", "host_prefetch_tokens_total",
              "host_prefetch_hits_total", "host_load_failures_total", "pins", "pins_refused_total",
              "session_prefetch_tokens_total", "session_prefetch_used_tokens_total",
              "session_prefetch_wasted_tokens_total", "session_prefetch_arrivals_total",
              "session_prefetch_lead_seconds_total"):
        if k in s:
            out[k] = s[k]
    return out


def warm_up(url: str, model: str) -> None:
    """One short request through each API, then an empty cache: every run starts alike."""
    msgs = [{"role": "user", "content": "warm up"}]
    httpx.post(url + "/v1/chat/completions", timeout=600, json={"model": model, "messages": msgs, "max_tokens": 2}
               ).raise_for_status()
    httpx.post(url + "/v1/messages", timeout=600, json={"model": model, "messages": msgs, "max_tokens": 2}
               ).raise_for_status()
    httpx.post(url + "/flush_cache", timeout=600).raise_for_status()


def count_tokens(url: str, model: str, text: str) -> int:
    r = httpx.post(url + "/v1/messages/count_tokens", timeout=60,
                   json={"model": model, "messages": [{"role": "user", "content": text}]})
    r.raise_for_status()
    return r.json()["input_tokens"]


def parse_run(spec: str) -> tuple[str, Fraction, bool, bool]:
    """'1/3' (the pool alone), '1/3+host' (with the host tier and session prefetch, the server's default) or
    '1/3+host-noprefetch' (the host tier, --no-session-prefetch) -> (label, pool fraction, host tier, prefetch off)."""
    frac, _, tier = spec.partition("+")
    if tier not in ("", "host", "host-noprefetch"):
        raise argparse.ArgumentTypeError(f"bad run {spec!r}: the suffix is +host or +host-noprefetch")
    return spec, Fraction(frac), tier.startswith("host"), tier == "host-noprefetch"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b", help="a config-only shape with a context that holds the shape's sessions")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--smoke", metavar="FOLDER", help="a tiny HF folder: the smoke shape on the CPU")
    p.add_argument("--shape", default="agents16", choices=sorted(SHAPES))
    p.add_argument("--runs", default=DEFAULT_RUNS,
                   help=f"pool fractions, +host for the host tier, +host-noprefetch for it without session prefetch "
                        f"({DEFAULT_RUNS})")
    p.add_argument("--tool-mean-s", type=float, default=None, help="mean time in tools between turns (exponential)")
    p.add_argument("--stagger-s", type=float, default=None, help="seconds between the first sessions' starts")
    p.add_argument("--keep", action="store_true", help="every turn keeps its prompt (prompt-cache fields)")
    p.add_argument("--port", type=int, default=30170)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--serve-arg", action="append", default=[], help="an extra `prefixrt serve` argument")
    a = p.parse_args(argv)
    shape_name = "smoke" if a.smoke else a.shape
    shape = list(SHAPES[shape_name])
    if a.tool_mean_s is not None:
        shape[7] = a.tool_mean_s
    if a.stagger_s is not None:
        shape[8] = a.stagger_s
    shape = tuple(shape)
    model = a.smoke or a.model
    base = ["--model", model, "--log-level", "warning"]
    base += ["--device", "cpu"] if a.smoke else ["--load-format", a.load_format]
    out_dir = Path(os.environ.get("OUT", "/tmp"))
    runs = [parse_run(s) for s in a.runs.split(",")]
    concurrent, sessions, turns, shared, own, append, output = shape[:7]
    results = []
    trace = None
    for label, frac, host, no_prefetch in runs:
        # the working set: every concurrent session's whole history at once, the shared prompt counted once (a
        # reply is re-tokenized from its text and each turn adds the template's markers: allowed for, generously)
        session_tokens = own + turns * (append + 2 * output + 16)
        working = int((shared + concurrent * session_tokens) * 1.1)
        # (a pool always holds one session's last prompt and its reply with room to spare)
        pool = max(int(working * frac), int((shared + session_tokens) * 1.5))
        args = base + ["--kv-cache-tokens", str(pool), "--max-pinned-fraction-per-salt", "1"]
        if host:
            args += ["--host-kv-cache-tokens", str(working)]
        if no_prefetch:
            args += ["--no-session-prefetch"]
        args += a.serve_arg
        log(f"[{label}] pool {pool} tokens{f', host {working}' if host else ''}: starting the server")
        srv = Server(args, a.port, out_dir / f"agent-sessions-{label.replace('/', '_')}.log")
        try:
            srv.wait_ready()
            served = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["id"]
            if trace is None:  # the served tokenizer's tokens per word
                sample = words_text(random.Random(1), 40)
                per_word = (count_tokens(srv.url, served, sample) - count_tokens(srv.url, served, "x")) / 40
                trace = make_trace(shape, per_word, a.seed)
                log(f"{per_word:.2f} tokens a word")
            warm_up(srv.url, served)
            records, wall = asyncio.run(run_trace(srv.url, served, trace, shape, a.keep))
            stats = httpx.get(srv.url + "/stats", timeout=30).json()
        finally:
            srv.stop()
        r = RunResult(label, pool, working if host else 0, wall, records, stats)
        results.append(r)
        s = summary(r, turns)
        log(f"[{label}] wall {s['wall_s']} s, hit {s['hit_rate']:.3f}, TTFT p50 {s['ttft_p50_ms']} ms, "
            f"p90 {s['ttft_p90_ms']} ms; by turn " + " / ".join(f"{x['p50_ms']:.0f}" for x in s["by_turn"]))
    base_sum = summary(results[0], turns)
    table = []
    for r in results:
        s = summary(r, turns)
        s["hit_vs_first"] = round(s["hit_rate"] / base_sum["hit_rate"], 3) if base_sum["hit_rate"] else None
        s["wall_vs_first"] = round(s["wall_s"] / base_sum["wall_s"], 3)
        s["ttft_p50_vs_first"] = round(s["ttft_p50_ms"] / base_sum["ttft_p50_ms"], 2)
        s["ttft_p90_vs_first"] = round(s["ttft_p90_ms"] / base_sum["ttft_p90_ms"], 2)
        table.append(s)
    print(f"{'run':<12} {'hit':>6} {'x1':>6} {'wall s':>8} {'x1':>6} {'TTFT p50':>9} {'x1':>6} {'p90':>8} {'x1':>6}")
    for s in table:
        print(f"{s['label']:<12} {s['hit_rate']:>6.3f} {s['hit_vs_first']:>6} {s['wall_s']:>8.1f} "
              f"{s['wall_vs_first']:>6} {s['ttft_p50_ms']:>9.0f} {s['ttft_p50_vs_first']:>6} "
              f"{s['ttft_p90_ms']:>8.0f} {s['ttft_p90_vs_first']:>6}")
    doc = {"shape": shape_name, "params": dict(zip(("concurrent", "sessions", "turns", "shared", "own", "append",
                                                    "output", "tool_mean_s", "stagger_s"), shape)),
           "keep": a.keep, "runs": table, "turns": {r.label: [asdict(x) for x in r.turns] for r in results}}
    path = a.json or (str(out_dir / f"agent-sessions-{shape_name}.json") if os.environ.get("OUT") else None)
    if path:
        Path(path).write_text(json.dumps(doc, indent=1))
        log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
