"""One H200 run for the host tier of the KV cache (issue 17) on the Llama-3.1-8B shape (128k context) with dummy weights (bf16).

A long-context multi-turn workload (bench/workloads.long_context: S sessions, each turn appends A tokens to the
whole history; C requests in flight, so a session's history waits in the cache while the others run) whose
working set (every session's final context) is 3x the GPU pool. Three engines, one after another:
  big pool      kv_cache_tokens = the working set                      (the ceiling)
  pool/3        kv_cache_tokens = working set / 3, no host tier        (what evictions cost today)
  pool/3 + host kv_cache_tokens = working set / 3, host_kv_cache_tokens = 1.1 x working set (write_through)
Prints per engine: cache hit rate (all tiers), TTFT p50/p99, input and output throughput, duration, host-tier
hits and the measured host->GPU load bandwidth; then a plain pinned-memory host->GPU copy of the same size
class for comparison, and how many greedy outputs of each engine equal the big pool's (bf16 with dummy
weights: batching differences may flip a few). Writes $OUT/gpu_host_tier.json when $OUT is set.

    PYTHONPATH=$PWD python benchmarks/gpu_host_tier.py                 # on the GPU host
    PYTHONPATH=$PWD python benchmarks/gpu_host_tier.py --smoke MODEL   # tiny shapes on the CPU (a local HF folder)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch

from prefixrt.bench import runner as R
from prefixrt.bench import workloads as W


def log(*a):
    print(*a, flush=True)


def pinned_copy_gbps(num_bytes: int, repeats: int = 5) -> float:
    """A plain pinned host tensor -> GPU copy of num_bytes, best of repeats, in GB/s."""
    src = torch.empty(num_bytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1000)
    return num_bytes / best / 1e9


def run_one(label: str, model: str, workload, concurrency: int, engine_kw: dict) -> tuple[dict, list]:
    from prefixrt.engine.engine import Engine

    t0 = time.perf_counter()
    eng = Engine(model, **engine_kw)
    start_s = time.perf_counter() - t0
    warm = W.random_prompts(eng.vocab_size, 4, 32, 4, seed=12345)
    R.run_workload(eng, warm, "warm-up", show_progress=False)
    eng.flush_cache()
    before = eng.stats()
    r = R.run_workload(eng, workload, label, concurrency, show_progress=False)
    s = eng.stats()
    load_b = s.host_load_bytes_total - before.host_load_bytes_total
    load_t = s.host_load_seconds_total - before.host_load_seconds_total
    row = {
        "label": label, "start_s": round(start_s, 1), "hit_rate": round(r.cache_hit_rate, 4),
        "optimal_hit_rate": round(r.optimal_hit_rate, 4),
        "ttft_p50_ms": r.ttft_ms.get("p50"), "ttft_p99_ms": r.ttft_ms.get("p99"),
        "input_tok_s": round(r.input_throughput, 1), "output_tok_s": round(r.output_throughput, 1),
        "duration_s": round(r.duration_s, 2), "retracted": s.retracted_requests_total - before.retracted_requests_total,
        "evicted_tokens": s.evicted_tokens_total - before.evicted_tokens_total,
        "host_hit_tokens": s.host_hit_tokens_total - before.host_hit_tokens_total,
        "host_load_gb": round(load_b / 1e9, 3), "host_load_gbps": round(load_b / load_t / 1e9, 2) if load_t else None,
        "host_backup_gb": round((s.host_backup_bytes_total - before.host_backup_bytes_total) / 1e9, 3),
        "host_load_failures": s.host_load_failures_total, "result": r.to_dict(),
    }
    # Correctness probe: session 0's turns without the outputs, one by one, greedy (each prompt extends the
    # previous one, so later probes reuse it from whichever tier holds it).
    probes, acc = [], []
    for turn in workload.sessions[0]:
        acc = acc + turn.new_tokens
        probes.append(list(acc))
    outs = []
    for p in probes:
        outs.append(eng.generate(p, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}).token_ids)
    log(f"{label}: {json.dumps({k: v for k, v in row.items() if k != 'result'})}")
    eng.shutdown()
    eng = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row, outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--smoke", default=None, metavar="MODEL_DIR", help="tiny CPU run on a local HF folder")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=14)
    ap.add_argument("--append-len", type=int, default=2500)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--ratio", type=float, default=3.0, help="working set / GPU pool")
    ap.add_argument("--policy", default="write_through")
    ap.add_argument("--page-size", type=int, default=16)
    args = ap.parse_args()
    smoke = args.smoke is not None
    if smoke:
        args.sessions, args.turns, args.append_len, args.output_len = 4, 3, 24, 4
        model, kw = args.smoke, dict(device="cpu", dtype="float32", page_size=1, chunked_prefill_tokens=32)
    else:
        model, kw = args.model, dict(load_format="dummy", page_size=args.page_size)
    w = W.long_context(32000 if not smoke else 300, args.sessions, args.turns, args.append_len, args.output_len)
    final = args.turns * args.append_len + (args.turns - 1) * args.output_len
    ws = args.sessions * (final + args.output_len)
    ps = kw["page_size"]
    pool = max(int(ws / args.ratio) // ps * ps, 2 * ps)
    host = int(ws * 1.1) // ps * ps + ps
    log(f"workload: {w.description}; working set {ws} tokens, pool/{args.ratio:g} = {pool}, host tier {host}, "
        f"concurrency {args.concurrency}")
    configs = [
        ("big pool", dict(kv_cache_tokens=ws + 4096)),
        (f"pool/{args.ratio:g}", dict(kv_cache_tokens=pool)),
        (f"pool/{args.ratio:g} + host", dict(kv_cache_tokens=pool, host_kv_cache_tokens=host,
                                               host_kv_write_policy=args.policy)),
    ]
    rows, outs = [], []
    for label, extra in configs:
        row, o = run_one(label, model, w, args.concurrency, {**kw, **extra})
        rows.append(row)
        outs.append(o)
    pinned = None
    if torch.cuda.is_available():
        pinned = pinned_copy_gbps(1 << 30)
    log("\n| engine | hit rate | TTFT p50 ms | TTFT p99 ms | in tok/s | out tok/s | s | retracted | host hit tok "
        "| load GB | load GB/s |")
    log("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        log(f"| {r['label']} | {r['hit_rate']:.3f} | {r['ttft_p50_ms']} | {r['ttft_p99_ms']} | {r['input_tok_s']} | "
            f"{r['output_tok_s']} | {r['duration_s']} | {r['retracted']} | {r['host_hit_tokens']} | "
            f"{r['host_load_gb']} | {r['host_load_gbps']} |")
    big, host_row = rows[0], rows[2]
    if big["ttft_p50_ms"] and host_row["ttft_p50_ms"]:
        log(f"host tier vs big pool: TTFT p50 {host_row['ttft_p50_ms'] / big['ttft_p50_ms']:.2f}x, "
            f"throughput {host_row['input_tok_s'] / big['input_tok_s']:.2f}x (acceptance: <= 2x, >= 0.7x; "
            f"hit rate >= 0.85)")
    if pinned is not None:
        log(f"plain pinned host->GPU copy (1 GiB): {pinned:.1f} GB/s; host tier loads: {host_row['host_load_gbps']} GB/s")
    same = [sum(a == b for a, b in zip(outs[0], o)) for o in outs]
    log(f"greedy probes equal to the big pool's: {same} of {len(outs[0])} (bf16, dummy weights)")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_host_tier.json"), "w") as f:
            json.dump({"rows": rows, "pinned_copy_gbps": pinned, "argv": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
