"""Runs a Workload against a Provider (in-process Engine or RemoteEngine) and measures it.

Sessions run concurrently (bounded by `concurrency` requests in flight); the turns of a session run in
order, each prompt extending the session's history. Every request streams, so TTFT and inter-token
latencies are observed as a client sees them.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field

from prefixrt.bench.workloads import Workload, optimal_hit_rate


@dataclass
class RequestRecord:
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: float
    latency_s: float
    itl_s: list[float] = field(default_factory=list)
    turn: int = 0  # the turn's index in its session


@dataclass
class Result:
    label: str
    workload: str
    num_requests: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    optimal_hit_rate: float
    ttft_ms: dict = field(default_factory=dict)
    tpot_ms: dict = field(default_factory=dict)
    itl_ms: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    records: list[RequestRecord] = field(default_factory=list, repr=False)  # per request; not in to_dict

    @property
    def request_throughput(self) -> float:
        return self.num_requests / self.duration_s

    @property
    def input_throughput(self) -> float:
        return self.input_tokens / self.duration_s

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.input_tokens if self.input_tokens else 0.0

    def to_dict(self) -> dict:
        return {
            "label": self.label, "workload": self.workload, "num_requests": self.num_requests,
            "duration_s": round(self.duration_s, 4), "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens, "cached_tokens": self.cached_tokens,
            "request_throughput": round(self.request_throughput, 3),
            "input_throughput": round(self.input_throughput, 1),
            "output_throughput": round(self.output_throughput, 1),
            "cache_hit_rate": round(self.cache_hit_rate, 4), "optimal_hit_rate": round(self.optimal_hit_rate, 4),
            "ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "itl_ms": self.itl_ms, **self.extra,
        }


def _pcts(xs: list[float]) -> dict:
    if not xs:
        return {}
    xs = sorted(xs)

    def q(p):
        return xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))] * 1000

    return {"p50": round(q(0.5), 2), "p99": round(q(0.99), 2), "mean": round(statistics.fmean(xs) * 1000, 2)}


async def _run_async(provider, workload: Workload, concurrency: int, progress, text: bool = False
                     ) -> tuple[list, float, list, int]:
    sem = asyncio.Semaphore(concurrency)
    records: list[RequestRecord] = []
    prompts: list[list[int]] = []
    chars = [0]

    async def one(prompt: list[int], max_new: int, turn: int) -> list[int]:
        async with sem:
            params = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True, "detokenize": text}
            t0 = time.perf_counter()
            first = last = None
            itl, out, cached = [], [], 0
            async for ch in provider.astream(prompt, params):
                now = time.perf_counter()
                if ch.token_ids:
                    if first is None:
                        first = now
                    elif last is not None:
                        itl.append((now - last) / len(ch.token_ids))
                    last = now
                    out.extend(ch.token_ids)
                chars[0] += len(ch.text or "")
                cached = ch.cached_tokens
            end = time.perf_counter()
            records.append(RequestRecord(len(prompt), cached, len(out), (first or end) - t0, end - t0, itl, turn))
            prompts.append(prompt)
            if progress is not None:
                progress.update(1)
            return out

    async def session(turns):
        history: list[int] = []
        for i, turn in enumerate(turns):
            prompt = history + turn.new_tokens
            out = await one(prompt, turn.max_new_tokens, i)
            history = prompt + out

    t0 = time.perf_counter()
    await asyncio.gather(*(session(s) for s in workload.sessions))
    return records, time.perf_counter() - t0, prompts, chars[0]


def run_workload(provider, workload: Workload, label: str, concurrency: int = 1024, show_progress: bool = True,
                 text: bool = False) -> Result:
    """Run every session of workload through provider (at most `concurrency` requests in flight), streamed.
    text: streamed as text (detokenize on, what an OpenAI client receives), the characters counted in
    extra["text_chars"]; else token ids only."""
    progress = None
    if show_progress:
        from tqdm import tqdm

        progress = tqdm(total=workload.num_requests, desc=label, unit="req", leave=False)
    try:
        records, duration, prompts, chars = asyncio.run(_run_async(provider, workload, concurrency, progress, text))
    finally:
        if progress is not None:
            progress.close()
    tpot = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in records if r.output_tokens > 1]
    return Result(
        label=label, workload=workload.name, num_requests=len(records), duration_s=duration,
        input_tokens=sum(r.prompt_tokens for r in records), output_tokens=sum(r.output_tokens for r in records),
        cached_tokens=sum(r.cached_tokens for r in records), optimal_hit_rate=optimal_hit_rate(prompts),
        ttft_ms=_pcts([r.ttft_s for r in records]), tpot_ms=_pcts(tpot),
        itl_ms=_pcts([x for r in records for x in r.itl_s]), records=records,
        extra={"streamed": "text", "text_chars": chars} if text else {"streamed": "token ids"},
    )


def run_hf_generate(model_path: str, workload: Workload, *, load_format: str, dtype, device, batch_size: int,
                    show_progress: bool = True) -> Result:
    """Baseline: transformers `generate` (sdpa attention, left-padded batches, greedy, fixed output length).
    Single-turn workloads only. TTFT is the batch's time to its first token (a 1-token generate)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if any(len(s) != 1 for s in workload.sessions):
        raise ValueError("the transformers baseline runs single-turn workloads only")
    if load_format == "dummy":
        cfg = AutoConfig.from_pretrained(model_path, local_files_only=True)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="sdpa",
                                                     local_files_only=True).to(device)
    model.eval()
    turns = [s[0] for s in workload.sessions]
    batches = [turns[i : i + batch_size] for i in range(0, len(turns), batch_size)]

    def gen(batch, n):
        width = max(len(t.new_tokens) for t in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, t in enumerate(batch):
            ids[i, width - len(t.new_tokens):] = torch.tensor(t.new_tokens)
            mask[i, width - len(t.new_tokens):] = 1
        with torch.no_grad():
            out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
        return out.shape[1] - width

    gen(batches[0][:1], 2)  # warm-up
    ttfts = []
    t0 = time.perf_counter()
    out_tokens = 0
    for b in batches:
        s = time.perf_counter()
        gen(b, 1)
        ttfts.append(time.perf_counter() - s)
        out_tokens += gen(b, b[0].max_new_tokens) * len(b)
    duration = time.perf_counter() - t0 - sum(ttfts)
    return Result("transformers generate", workload.name, len(turns), duration,
                  sum(len(t.new_tokens) for t in turns), out_tokens, 0,
                  optimal_hit_rate([t.new_tokens for t in turns]), ttft_ms=_pcts(ttfts),
                  extra={"batch_size": batch_size})


def format_table(results: list[Result]) -> str:
    head = (f"{'run':<28} {'req/s':>8} {'in tok/s':>10} {'out tok/s':>10} {'hit':>6} {'opt':>6} "
            f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'ITL p99':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        def g(d, k):
            return f"{d[k]:.1f}" if k in d else "-"

        lines.append(f"{r.label:<28} {r.request_throughput:>8.2f} {r.input_throughput:>10.0f} "
                     f"{r.output_throughput:>10.1f} {r.cache_hit_rate:>6.1%} {r.optimal_hit_rate:>6.1%} "
                     f"{g(r.ttft_ms, 'p50'):>9} {g(r.ttft_ms, 'p99'):>9} {g(r.tpot_ms, 'p50'):>9} "
                     f"{g(r.itl_ms, 'p99'):>8}")
    lines.append("(times in ms; hit = prompt tokens reused from the cache; opt = an ideal cache's hit rate)")
    return "\n".join(lines)
