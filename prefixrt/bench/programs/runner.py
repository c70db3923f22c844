"""Runs a ProgramWorkload under one ablation and measures it: programs/s, tokens/s, program latency, the cache
hit rate and the ideal hit rate of the same request trace (workloads.ideal_hit_rate).

The trace is what the engine saw. In-process (`RequestTrace`), every request handed to the engine's loop is
recorded through the front's `_hand_over` hook, internal ones included (a fork's prefix hint, the prefill and
per-choice extends of a `select`), with the prompt tokens it reused at admission: the hit rate and the optimum
are over the same requests. Over HTTP (`ClientTrace`), the requests the client sent are recorded with the cached
tokens the server reported (a select is one request there).

Ablations (ABLATIONS), each a real mode of the engine or the frontend:
  full         radix cache, lpm scheduling, frontend hints and parallelism on
  no-cache     radix_cache=False: nothing is reused
  block-cache  prefix_cache="block": vLLM-style hash-block table cache (cache/block.py)
  fcfs         schedule_policy="fcfs": arrival order instead of longest-prefix-match (set on the running engine's
               scheduler, the field the builder fills from EngineConfig.schedule_policy: one engine serves full
               and fcfs)
  no-hint      ProviderBackend(prefix_hints=False): no fork / run_batch prefix pre-caching
  no-parallel  ProviderBackend(parallel=False): a program's calls one at a time (forks serialised)
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import threading
import time
from dataclasses import dataclass, field

from prefixrt.bench.programs.base import ProgramWorkload
from prefixrt.bench.workloads import ideal_hit_rate, trace_working_set


@dataclass(frozen=True)
class Ablation:
    name: str
    label: str
    engine: dict = field(default_factory=dict)  # EngineConfig fields this run needs
    scheduler: dict = field(default_factory=dict)  # SchedulerSettings fields set on the running engine for the run
    backend: dict = field(default_factory=dict)  # ProviderBackend options

    def applies(self, w: ProgramWorkload) -> bool:
        if "prefix_hints" in self.backend:
            return w.frontend_ablations and w.program is not None
        if "parallel" in self.backend:
            return w.uses_fork
        return True


ABLATIONS = {a.name: a for a in (
    Ablation("full", "full (radix, lpm, hints, parallel)"),
    Ablation("no-cache", "no cache", engine={"radix_cache": False}),
    Ablation("block-cache", "table (block) cache", engine={"prefix_cache": "block"}),
    Ablation("fcfs", "FCFS scheduling", scheduler={"schedule_policy": "fcfs"}),
    Ablation("no-hint", "no frontend hint", backend={"prefix_hints": False}),
    Ablation("no-parallel", "no frontend parallelism", backend={"parallel": False}),
)}


@dataclass
class ProgramResult:
    workload: str
    ablation: str
    num_programs: int
    duration_s: float
    num_requests: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ideal_hit_rate: float
    latency_s: list[float] = field(default_factory=list, repr=False)
    sizes: dict = field(default_factory=dict)
    trace: str = "engine"  # "engine" (in-process) or "client" (over HTTP)
    outputs: list = field(default_factory=list, repr=False)  # each program's final text (dspy: its answer)
    working_set_tokens: int = 0  # tokens an exact never-evicting cache holds after the trace (its footprint)

    @property
    def programs_per_s(self) -> float:
        return self.num_programs / self.duration_s

    @property
    def tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.duration_s

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def latency_ms(self) -> dict:
        if not self.latency_s:
            return {}
        xs = sorted(self.latency_s)
        return {"p50": round(1000 * xs[len(xs) // 2], 1), "p99": round(1000 * xs[min(len(xs) - 1, int(0.99 * len(xs)))], 1),
                "mean": round(1000 * statistics.fmean(xs), 1)}

    def to_dict(self) -> dict:
        return {"workload": self.workload, "ablation": self.ablation, "num_programs": self.num_programs,
                "duration_s": round(self.duration_s, 3), "programs_per_s": round(self.programs_per_s, 3),
                "tokens_per_s": round(self.tokens_per_s, 1), "num_requests": self.num_requests,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "output_tokens": self.output_tokens, "hit_rate": round(self.hit_rate, 4),
                "ideal_hit_rate": round(self.ideal_hit_rate, 4),
                "working_set_tokens": self.working_set_tokens, "latency_ms": self.latency_ms(),
                "sizes": self.sizes, "trace": self.trace}


# ---------------------------------------------------------------------- traces
class RequestTrace:
    """Records every request an in-process Engine hands to its loop while attached (`with RequestTrace(eng)`):
    the Req objects themselves, read once they have finished (prompt, output, tokens reused at admission)."""

    def __init__(self, engine):
        self.engine = engine
        self.reqs: list = []
        self._lock = threading.Lock()
        self._orig = None

    def __enter__(self) -> RequestTrace:
        orig = self.engine._hand_over  # the front's hook between a prepared request and the loop

        def hand_over(prepared):
            with self._lock:
                self.reqs.extend(prepared.reqs)
            orig(prepared)

        self._orig = orig
        self.engine._hand_over = hand_over
        return self

    def __exit__(self, *exc) -> None:
        del self.engine._hand_over  # the class's method again

    def requests(self) -> list[tuple[list[int], list[int], int]]:
        out = []
        for r in self.reqs:
            cap = len(r.prompt_ids) - 1
            if r.input_logprobs_from is not None:
                cap = min(cap, r.input_logprobs_from - 1)
            out.append((list(r.prompt_ids), list(r.output_ids), cap))
        return out

    def totals(self) -> tuple[int, int, int]:
        """(prompt tokens, prompt tokens reused from the cache, output tokens) of the requests that ran."""
        ran = [r for r in self.reqs if r.num_cached_tokens is not None]
        return (sum(len(r.prompt_ids) for r in ran), sum(r.num_cached_tokens for r in ran),
                sum(len(r.output_ids) for r in ran))


class ClientTrace:
    """A Provider that forwards to another (a RemoteEngine) and records each request it sends as token ids with
    its outputs and the cached tokens the server reported. Prompts must be token ids (ProviderBackend with a
    tokenizer sends them so)."""

    def __init__(self, inner):
        self.inner = inner
        self.records: list[tuple[list[int], list[int], int, int]] = []  # (prompt, output, cap, cached)
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _add(self, prompt, output, cached) -> None:
        if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
            with self._lock:
                self.records.append((list(prompt), list(output or []), len(prompt) - 1, cached or 0))

    def generate(self, prompt, params=None):
        out = self.inner.generate(prompt, params)
        if isinstance(out, list):
            for p, c in zip(prompt, out):
                self._add(p, c.token_ids, c.cached_tokens)
        else:
            self._add(prompt, out.token_ids if not out.choice_scores else [], out.cached_tokens)
        return out

    def stream(self, prompt, params=None):
        output, last = [], None
        for chunk in self.inner.stream(prompt, params):
            output.extend(chunk.token_ids or [])
            last = chunk
            yield chunk
        self._add(prompt, output, last.cached_tokens if last is not None else 0)

    def cache_prefix(self, prompt, cache_salt=None):
        c = self.inner.generate(prompt, {"max_new_tokens": 0, "cache_salt": cache_salt})
        self._add(prompt, [], c.cached_tokens)
        return c.prompt_tokens

    def requests(self):
        return [(p, o, cap) for p, o, cap, _ in self.records]

    def totals(self) -> tuple[int, int, int]:
        return (sum(len(p) for p, *_ in self.records), sum(c for *_, c in self.records),
                sum(len(o) for _, o, *_ in self.records))


# ---------------------------------------------------------------------- running
def _timed(program, latencies: list[float]):
    """program with each run's latency (body start to every branch done) appended to latencies."""
    from prefixrt.frontend import Program

    def body(s, **kwargs):
        t0 = time.perf_counter()
        program.fn(s, **kwargs)
        s.sync()
        latencies.append(time.perf_counter() - t0)

    body.__name__ = program.fn.__name__
    return Program(body, **program.defaults)


def run_workload(provider, w: ProgramWorkload, ablation: Ablation, sizes: dict, args: list[dict] | None = None,
                 num_threads: int = 64, tokenizer=None) -> ProgramResult:
    """Run w's programs (args: from w.make_args(sizes, 0) unless given) on provider under ablation. The
    engine-side switches of the ablation (ablation.engine) must already be the provider's configuration.
    In-process providers (an Engine) are traced through the engine; others through the client (tokenizer:
    for a provider without one, e.g. a RemoteEngine, so prompts go out as token ids)."""
    from prefixrt.frontend import ProviderBackend

    args = w.make_args(sizes, 0) if args is None else args
    in_process = hasattr(provider, "_hand_over")
    if not in_process:
        if ablation.scheduler:
            raise ValueError(f"ablation {ablation.name} switches the engine's scheduler: run it in-process")
        provider = ClientTrace(provider)
    provider.flush_cache()
    latencies: list[float] = []
    trace = RequestTrace(provider) if in_process else provider
    with trace if in_process else contextlib.nullcontext(), _scheduler(provider, ablation.scheduler):
        t0 = time.perf_counter()
        if w.program is not None:
            backend = ProviderBackend(provider, tokenizer=tokenizer, **ablation.backend)
            states = _timed(w.program, latencies).run_batch(
                args, backend=backend, num_threads=num_threads, prefix_hint=backend.prefix_hints, **w.sampling)
            outputs = [st.text() for st in states]
        else:
            outputs = [p.answer for p in w.run(provider, args, sizes, num_threads, latencies)]
        duration = time.perf_counter() - t0
    if in_process:
        provider.wait_idle()
    prompt, cached, output = trace.totals()
    reqs = trace.requests()
    return ProgramResult(w.name, ablation.name, len(args), duration, len(reqs), prompt, cached, output,
                         ideal_hit_rate(reqs), latencies, dict(sizes), "engine" if in_process else "client", outputs,
                         trace_working_set(reqs))


@contextlib.contextmanager
def _scheduler(engine, fields: dict):
    """engine's scheduler settings with `fields` set for the duration (restored after)."""
    if not fields:
        yield
        return
    scheduler = engine.core.scheduler
    old = scheduler.settings
    scheduler.settings = dataclasses.replace(old, **fields)
    try:
        yield
    finally:
        scheduler.settings = old


def format_results(results: list[ProgramResult]) -> str:
    """One table: a row per (workload, ablation), throughput also relative to the workload's no-cache run."""
    head = (f"{'workload':<20} {'ablation':<12} {'progs':>6} {'prog/s':>8} {'tok/s':>9} {'x no-cache':>10} "
            f"{'hit':>6} {'ideal':>6} {'hit/ideal':>9} {'lat p50':>9} {'lat p99':>9}")
    lines = [head, "-" * len(head)]
    base = {r.workload: r.programs_per_s for r in results if r.ablation == "no-cache"}
    for r in results:
        rel = f"{r.programs_per_s / base[r.workload]:.2f}" if r.workload in base else "-"
        lat = r.latency_ms()
        ratio = f"{r.hit_rate / r.ideal_hit_rate:.1%}" if r.ideal_hit_rate else "-"
        lines.append(f"{r.workload:<20} {r.ablation:<12} {r.num_programs:>6} {r.programs_per_s:>8.2f} "
                     f"{r.tokens_per_s:>9.0f} {rel:>10} {r.hit_rate:>6.1%} {r.ideal_hit_rate:>6.1%} {ratio:>9} "
                     f"{lat.get('p50', '-'):>9} {lat.get('p99', '-'):>9}")
    lines.append("(tok/s: prompt + generated tokens the engine processed per second; hit: prompt tokens reused; "
                 "ideal: an unbounded exact cache's hit rate on the same request trace; latency in ms per program)")
    return "\n".join(lines)
