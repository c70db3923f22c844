"""Long-context agents under memory pressure: many concurrent sessions whose KV outgrows the GPU pool.

The agent workload (bench/workloads.agent): S sessions x T turns over one shared repository context, each with
its own context, each turn appending a tool result to the whole history; every session in flight at once
(--concurrency, default all). One engine per run, one after another in this process, on the same workload:
  pool 1      kv_cache_tokens = the working set (every history cached at once): the baseline
  pool 1/2    half the working set, with the host tier (+host) and without
  pool 1/3    a third, with and without; and without the tier at concurrency 1 ("c1")
Per run: cache hit rate (all tiers) against the unbounded pool's, wall time, TTFT p50/p99 overall and per turn,
computed prompt tokens, retractions, host loads (GB, GB/s), prefetches; for runs without the tier, the time
the recomputation itself needs (the unbounded wall plus the extra computed tokens at the measured prefill
rate). Then the host<->GPU copy bandwidth of the tier's transfer path against a plain pinned copy of the same
size, and how many greedy probes of each run equal the unbounded pool's (bf16 with dummy weights: batching
differences may flip a few). Writes $OUT/agents-<shape>.json when $OUT is set.

    PYTHONPATH=$PWD python benchmarks/gpu_agents.py --shape agents16                # on the GPU host
    PYTHONPATH=$PWD python benchmarks/gpu_agents.py --shape agents12 --runs 1,1/2+host
    PYTHONPATH=$PWD python benchmarks/gpu_agents.py --smoke /path/to/tiny-hf-folder   # tiny shapes on the CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import time
from fractions import Fraction

SHAPES = {  # sessions, turns, shared, own, append, output
    "agents16": (16, 6, 16384, 8192, 2048, 64),  # contexts to ~35k, working set ~317k
    "agents12": (12, 4, 49152, 24576, 3072, 64),  # contexts to ~83k, working set ~458k
    "long128": (4, 4, 65536, 49152, 4096, 64),  # contexts to ~127k
    "smoke": (6, 5, 96, 64, 24, 8),
}
DEFAULT_RUNS = "1,1/2+host,1/2,1/3+host,1/3,1/3@c1"


def log(*a):
    print(*a, flush=True)


def parse_run(spec: str) -> tuple[str, Fraction, bool, int | None]:
    """'1/3+host@c4' -> (label, pool fraction, host tier, concurrency or None for all)."""
    body, _, conc = spec.partition("@c")
    frac, _, tier = body.partition("+")
    if tier not in ("", "host"):
        raise argparse.ArgumentTypeError(f"bad run {spec!r}: the suffix is +host")
    return spec, Fraction(frac), tier == "host", int(conc) if conc else None


def by_turn(records, turns: int) -> list[dict]:
    out = []
    for t in range(turns):
        xs = sorted(r.ttft_s for r in records if r.turn == t)
        if xs:
            out.append({"turn": t, "n": len(xs), "p50_ms": round(statistics.median(xs) * 1000, 1),
                        "p99_ms": round(xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))] * 1000, 1)})
    return out


def run_one(label, model, workload, concurrency, engine_kw, turns) -> tuple[dict, list]:
    from prefixrt.bench import runner as R
    from prefixrt.bench import workloads as W
    from prefixrt.engine.engine import Engine

    t0 = time.perf_counter()
    eng = Engine(model, **engine_kw)
    start_s = time.perf_counter() - t0
    R.run_workload(eng, W.random_prompts(eng.vocab_size, 4, 32, 4, seed=12345), "warm-up", show_progress=False)
    eng.flush_cache()
    before = eng.stats()
    r = R.run_workload(eng, workload, label, concurrency, show_progress=False)
    s = eng.stats()

    def delta(name):
        return getattr(s, name) - getattr(before, name)

    load_b, load_t = delta("host_load_bytes_total"), delta("host_load_seconds_total")
    row = {
        "label": label, "start_s": round(start_s, 1), "pool_tokens": engine_kw["kv_cache_tokens"],
        "host_tokens": engine_kw.get("host_kv_cache_tokens") or 0, "concurrency": concurrency,
        "hit_rate": round(r.cache_hit_rate, 4), "optimal_hit_rate": round(r.optimal_hit_rate, 4),
        "wall_s": round(r.duration_s, 2), "ttft_p50_ms": r.ttft_ms.get("p50"), "ttft_p99_ms": r.ttft_ms.get("p99"),
        "ttft_by_turn": by_turn(r.records, turns), "computed_tokens": r.input_tokens - r.cached_tokens,
        "input_tokens": r.input_tokens, "output_tok_s": round(r.output_throughput, 1),
        "retracted": delta("retracted_requests_total"), "preempted": delta("preempted_requests_total"),
        "evicted_tokens": delta("evicted_tokens_total"),
        "host_hit_tokens": delta("host_hit_tokens_total"), "host_load_gb": round(load_b / 1e9, 3),
        "host_load_gbps": round(load_b / load_t / 1e9, 2) if load_t else None,
        "host_backup_gb": round(delta("host_backup_bytes_total") / 1e9, 3),
        "host_load_failures": delta("host_load_failures_total"),
        "prefetch_tokens": delta("host_prefetch_tokens_total"), "prefetch_hits": delta("host_prefetch_hits_total"),
        "retracted_to_host_tokens": delta("retracted_to_host_tokens_total"),
    }
    probes, acc = [], []
    for turn in workload.sessions[0][:3]:  # session 0's first turns without the outputs, greedy
        acc = acc + turn.new_tokens
        probes.append(list(acc))
    outs = [eng.generate(p, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}).token_ids for p in probes]
    prefill_rate = None
    if engine_kw.get("host_kv_cache_tokens") is None and row["pool_tokens"] >= W.working_set_tokens(workload):
        eng.flush_cache()  # the prefill rate at this context: session 0's first prompt from nothing
        p = workload.sessions[0][0].new_tokens
        t1 = time.perf_counter()
        eng.generate(p, {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True})
        prefill_rate = len(p) / (time.perf_counter() - t1)
        row["prefill_tok_s"] = round(prefill_rate, 1)
    log(f"{label}: {json.dumps(row)}")
    eng.shutdown()
    del eng
    gc.collect()
    _empty_cuda_cache()
    return row, outs


def _empty_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def copy_bandwidth(model: str, engine_kw: dict, sizes_tokens: list[int]) -> list[dict]:
    """The tier's load and backup paths (KVTransfer over the model's pool layout) against a plain pinned copy of
    the same bytes, in GB/s (best of 3)."""
    import torch
    from transformers import AutoConfig

    from prefixrt.cache.host_pool import HostKVPool
    from prefixrt.cache.kv_pool import KVPool
    from prefixrt.cache.transfer import KVTransfer
    from prefixrt.hub.registry import resolve_model

    cfg = AutoConfig.from_pretrained(resolve_model(model).path, local_files_only=True)
    layers, kvh = cfg.num_hidden_layers, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    n_max = max(sizes_tokens)
    pool = KVPool(n_max * 2 + 16, layers, kvh, d, torch.bfloat16, "cuda")
    host = HostKVPool(n_max + 16, layers, kvh, d, torch.bfloat16, 16, pin=True)
    xfer = KVTransfer(pool, host)
    rows = []
    for n in sizes_tokens:
        nbytes = n * host.bytes_per_token
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        plain = []
        for _ in range(3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            plain.append(nbytes / (a.elapsed_time(b) / 1000) / 1e9)
        del src, dst
        pages = list(range((n_max + 16) // 16, (2 * n_max + 16) // 16))
        random.Random(n).shuffle(pages)  # scattered pool pages, as a loaded path's are
        gpu = [p * 16 + i for p in pages[: -(-n // 16)] for i in range(16)][:n]
        hs = list(range(16, 16 + n))
        rates = {"load": [], "backup": []}
        for _ in range(3):
            for kind in ("backup", "load"):
                t = xfer.backup(gpu, hs) if kind == "backup" else xfer.load(hs, gpu)
                t.wait()
                rates[kind].append(nbytes / t.seconds / 1e9)
        rows.append({"tokens": n, "mb": round(nbytes / 1e6, 1), "plain_gbps": round(max(plain), 1),
                     "load_gbps": round(max(rates["load"]), 1), "backup_gbps": round(max(rates["backup"]), 1)})
        log(f"copy {rows[-1]}")
    xfer.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="agents16")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--smoke", default=None, metavar="MODEL_DIR", help="the smoke shape on the CPU (a local HF folder)")
    ap.add_argument("--runs", default=DEFAULT_RUNS,
                    help="comma-separated: pool fraction of the working set, +host for the host tier, @cN for N "
                         f"requests in flight (default all sessions); default {DEFAULT_RUNS}")
    ap.add_argument("--concurrency", type=int, default=None, help="requests in flight unless a run says @cN")
    ap.add_argument("--host-ratio", type=float, default=1.1, help="host tier size / working set")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--preempt-after-s", type=float, default=-1.0,
                    help="host tier: a new request's wait before it preempts running ones (negative: never)")
    ap.add_argument("--copy-sizes", default="512,4096,32768", help="tokens per copy in the bandwidth check ('' skips)")
    args = ap.parse_args()
    from prefixrt.bench import workloads as W

    shape = "smoke" if args.smoke else args.shape
    sessions, turns, shared, own, append, out_len = SHAPES[shape]
    if args.smoke:
        model, kw = args.smoke, dict(device="cpu", dtype="float32", page_size=1, chunked_prefill_tokens=64)
    else:
        model, kw = args.model, dict(load_format="dummy", page_size=args.page_size)
    from transformers import AutoConfig

    from prefixrt.hub.registry import resolve_model

    vocab = AutoConfig.from_pretrained(resolve_model(model).path, local_files_only=True).vocab_size
    w = W.agent(vocab, sessions, turns, shared, own, append, out_len)
    ws = W.working_set_tokens(w)
    ps = kw["page_size"]
    log(f"workload: {w.description}; working set {ws} tokens")
    rows, outs = [], []
    for label, frac, tier, conc in map(parse_run, args.runs.split(",")):
        pool = -(-int(ws * frac) // ps) * ps + (4 * ps if frac >= 1 else 0)
        extra = dict(kv_cache_tokens=pool)
        if tier:
            extra["host_kv_cache_tokens"] = int(ws * args.host_ratio) // ps * ps + ps
            extra["host_kv_preempt_after_s"] = args.preempt_after_s if args.preempt_after_s >= 0 else None
        row, o = run_one(label, model, w, conc or args.concurrency or sessions, {**kw, **extra}, turns)
        rows.append(row)
        outs.append(o)
    report(rows, outs)
    copies = []
    if args.copy_sizes and not args.smoke:
        copies = copy_bandwidth(model, kw, [int(x) for x in args.copy_sizes.split(",")])
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"agents-{shape}.json"), "w") as f:
            json.dump({"workload": w.description, "working_set": ws, "rows": rows, "copies": copies,
                       "argv": vars(args)}, f, indent=1)


def report(rows: list[dict], outs: list) -> None:
    base = next((r for r in rows if r["pool_tokens"] and not r["host_tokens"] and "prefill_tok_s" in r), None)
    log("\n| run | pool | hit | hit / pool 1 | wall s | wall / pool 1 | TTFT p50 ms | p50 / pool 1 | TTFT p99 ms "
        "| computed tok | retracted | load GB | load GB/s | prefetch hits | recompute estimate s |")
    log("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        est = ""
        if base is not None and not r["host_tokens"]:
            extra = max(0, r["computed_tokens"] - base["computed_tokens"])
            r["recompute_estimate_s"] = round(base["wall_s"] + extra / base["prefill_tok_s"], 2)
            est = f"{r['recompute_estimate_s']} ({r['wall_s'] / r['recompute_estimate_s']:.2f}x)"

        def ratio(k, r=r):
            return f"{r[k] / base[k]:.2f}" if base and base[k] else "-"

        log(f"| {r['label']} | {r['pool_tokens']} | {r['hit_rate']:.3f} | {ratio('hit_rate')} | {r['wall_s']} | "
            f"{ratio('wall_s')} | {r['ttft_p50_ms']} | {ratio('ttft_p50_ms')} | {r['ttft_p99_ms']} | "
            f"{r['computed_tokens']} | {r['retracted']} | {r['host_load_gb']} | {r['host_load_gbps']} | "
            f"{r['prefetch_hits']} | {est} |")
    log("\nTTFT p50 / p99 ms by turn:")
    for r in rows:
        log(f"  {r['label']}: " + ", ".join(f"t{t['turn']} {t['p50_ms']}/{t['p99_ms']}" for t in r["ttft_by_turn"]))
    same = [sum(a == b for a, b in zip(outs[0], o)) for o in outs]
    log(f"greedy probes equal to the first run's: {same} of {len(outs[0])}")


if __name__ == "__main__":
    main()
