"""Prefill/decode disaggregation on ONE GPU: a prefill worker and a decode worker, two processes on the same
device, against one plain engine (issue 18; prefixrt/disagg/decode.py).

    PYTHONPATH=$PWD python benchmarks/gpu_disagg.py --model llama-3.2-1b              # on the GPU host (dummy weights)
    PYTHONPATH=$PWD python benchmarks/gpu_disagg.py --device cpu --model TINY_HF_DIR  # the same logic on the CPU

1. single: one Engine runs the check prompts (greedy) and the workload; then it is shut down.
2. disagg: this process builds a DecodeEngine (rank 0, hosts the rendezvous); a spawned process builds the
   prefill Engine and its PrefillWorker (rank 1) on the same device; K/V goes over gloo (staged through host
   memory: NCCL refuses two ranks on one GPU). Both processes seed their dummy weights alike; their checksums are
   compared before anything runs. The same check prompts, then the same workload.
Checks: the check prompts' greedy tokens equal the single engine's (exit status 1 if fewer than --min-match of
them do; float32 by default, so only batch-shape rounding can differ), and both engines end idle with their pool
invariant intact. Table: request and output throughput, TTFT p50/p99, transfer count, GB moved, transfer
bandwidth (bytes / time from header to last layer, and bytes / wall time), the prefill worker's cache hit rate.
Writes $OUT/gpu_disagg.json when $OUT is set.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from benchmarks.common import free_port, int_flags, log, script_parser
from prefixrt.bench import runner as R
from prefixrt.bench import workloads as W


def weights_checksum(engine) -> float:
    with torch.no_grad():
        return float(sum(p.double().sum() for p in engine.probes.model.parameters()))


def check_prompts(vocab: int, n: int, length: int) -> list[list[int]]:
    w = W.random_prompts(vocab, n, length, 1, seed=4242)
    return [s[0].new_tokens for s in w.sessions]


def run_side(eng, label: str, checks: list[list[int]], check_len: int, workload, concurrency: int) -> tuple[dict, list]:
    """Warm-up, the check prompts (greedy outputs), the workload (timed)."""
    R.run_workload(eng, W.random_prompts(eng.vocab_size, 4, 32, 4, seed=12345), "warm-up", show_progress=False)
    outs = [c.token_ids for c in eng.generate(checks, {"max_new_tokens": check_len, "temperature": 0,
                                                        "ignore_eos": True})]
    r = R.run_workload(eng, workload, label, concurrency, show_progress=False)
    row = {"label": label, "requests": r.num_requests, "duration_s": round(r.duration_s, 3),
           "req_s": round(r.request_throughput, 2), "output_tok_s": round(r.output_throughput, 1),
           "input_tok_s": round(r.input_throughput, 1), "ttft_p50_ms": r.ttft_ms.get("p50"),
           "ttft_p99_ms": r.ttft_ms.get("p99"), "tpot_p50_ms": r.tpot_ms.get("p50"),
           "hit_rate": round(r.cache_hit_rate, 4)}
    return row, outs


def recv(conn, proc, timeout_s: float):
    """The prefill process's next message; a dead or silent prefill process is an error, not a hang."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll(1.0):
        if not proc.is_alive():
            raise SystemExit(f"the prefill process exited (status {proc.exitcode}) before answering")
        if time.monotonic() > deadline:
            raise SystemExit(f"the prefill process did not answer within {timeout_s:.0f}s")
    return conn.recv()


def assert_clean(eng) -> None:
    eng.wait_idle(120)
    s = eng.stats()
    assert s.kv_free + s.kv_evictable == s.kv_total and s.kv_locked == 0, s
    eng.check_integrity()


def prefill_main(model: str, engine_kw: dict, addr: str, conn) -> None:
    """The prefill process: Engine + PrefillWorker at rank 1; reports its weights' checksum, then its stats."""
    from prefixrt.disagg.prefill import PrefillWorker
    from prefixrt.engine.engine import Engine
    from prefixrt.parallel.kv_transport import make_group

    eng = Engine(model, **engine_kw)
    conn.send(("ready", weights_checksum(eng)))
    worker = PrefillWorker(eng, make_group(addr, 1, 2, "gloo"), decode_ranks=(0,))
    conn.recv()  # "stop": the decode side has said bye
    worker.close()
    assert_clean(eng)
    s = eng.stats()
    conn.send(("stats", {"transfers": worker.transfers_total, "cancelled": worker.cancelled_total,
                         "prompt_tokens": s.prompt_tokens_total, "cached_tokens": s.cached_tokens_total}))
    eng.shutdown()


def main() -> int:
    ap = script_parser(__doc__)
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32", help="float32 (exact check) or bfloat16")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--kv-cache-tokens", type=int, default=131072, help="each engine's pool (two share the GPU)")
    int_flags(ap, groups=8, prompts_per_group=8, system_len=2048, question_len=256, output_len=64,
              concurrency=32)
    ap.add_argument("--checks", type=int, default=16, help="check prompts (greedy outputs compared)")
    ap.add_argument("--check-len", type=int, default=16, help="tokens generated per check prompt")
    ap.add_argument("--min-match", type=float, default=None,
                    help="fraction of check outputs that must equal the single engine's (default 1.0 in float32, "
                         "0 in bfloat16: reported only)")
    args = ap.parse_args()
    if args.device == "cpu":  # a tiny model on the CPU: small shapes
        args.kv_cache_tokens = min(args.kv_cache_tokens, 8192)
        args.system_len, args.question_len, args.output_len = min(args.system_len, 48), min(args.question_len, 16), \
            min(args.output_len, 8)
    min_match = args.min_match if args.min_match is not None else (1.0 if args.dtype == "float32" else 0.0)
    kw = dict(device=args.device, dtype=args.dtype, load_format=args.load_format, kv_cache_tokens=args.kv_cache_tokens,
              seed=0)

    from prefixrt.disagg.decode import DecodeEngine
    from prefixrt.engine.engine import Engine
    from prefixrt.parallel.kv_transport import make_group

    t0 = time.perf_counter()
    single = Engine(args.model, **kw)
    vocab = single.vocab_size
    workload = W.shared_prefix(vocab, args.groups, args.prompts_per_group, args.system_len, args.question_len,
                               args.output_len)
    checks = check_prompts(vocab, args.checks, args.system_len // 2 + args.question_len)
    log(f"model {args.model} ({args.load_format}, {args.dtype}) on {args.device}; workload: {workload.description}, "
        f"concurrency {args.concurrency}; {len(checks)} check prompts x {args.check_len} tokens")
    checksum = weights_checksum(single)
    row_single, want = run_side(single, "single engine", checks, args.check_len, workload, args.concurrency)
    assert_clean(single)
    single.shutdown()
    single = None
    log(f"single: {json.dumps(row_single)} ({time.perf_counter() - t0:.0f}s)")

    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    addr = f"127.0.0.1:{free_port()}"
    proc = ctx.Process(target=prefill_main, args=(args.model, kw, addr, child))
    proc.start()
    decode = None
    try:
        decode = DecodeEngine(args.model, **kw)
        _, prefill_checksum = recv(parent, proc, 900)
        if prefill_checksum != checksum or weights_checksum(decode) != checksum:
            raise SystemExit(f"the engines' dummy weights differ (checksums {checksum}, {prefill_checksum}, "
                             f"{weights_checksum(decode)}): outputs cannot be compared")
        decode.connect(make_group(addr, 0, 2, "gloo"), prefill_ranks=(1,))
        row_disagg, got = run_side(decode, "prefill + decode (2 processes)", checks, args.check_len, workload,
                                   args.concurrency)
        assert_clean(decode)
        xfer = decode.transfer_stats()
        decode.shutdown()
        parent.send("stop")
        _, prefill_stats = recv(parent, proc, 300)
    finally:
        if decode is not None:
            decode.shutdown()
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    matches = sum(a == b for a, b in zip(want, got))
    gb = xfer["bytes"] / 1e9
    row_disagg.update(transfers=xfer["transfers"], transfer_gb=round(gb, 3),
                      transfer_gbps=round(gb / xfer["seconds"], 2) if xfer["seconds"] else None,
                      transfer_gbps_wall=round(gb / row_disagg["duration_s"], 2) if row_disagg["duration_s"] else None,
                      not_fetched=xfer["not_fetched"], failed=xfer["failed"],
                      prefill_hit_rate=round(prefill_stats["cached_tokens"] / prefill_stats["prompt_tokens"], 4)
                      if prefill_stats["prompt_tokens"] else 0.0)
    log(f"disagg: {json.dumps(row_disagg)}")
    diverge = [next(i for i, (x, y) in enumerate(zip(a + [None], b + [None])) if x != y)
               for a, b in zip(want, got) if a != b]
    log(f"\ncheck: {matches}/{len(want)} greedy outputs equal the single engine's ({args.dtype})"
        + (f"; the others diverge at generated token {diverge}" if diverge else ""))
    log("\n| engine | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | transfers | GB moved "
        "| transfer GB/s | GB/s over the run |")
    log("|---|---|---|---|---|---|---|---|---|---|")
    for r in (row_single, row_disagg):
        log(f"| {r['label']} | {r['req_s']} | {r['output_tok_s']} | {r['ttft_p50_ms']} | {r['ttft_p99_ms']} | "
            f"{r['tpot_p50_ms']} | {r.get('transfers', '-')} | {r.get('transfer_gb', '-')} | "
            f"{r.get('transfer_gbps', '-')} | {r.get('transfer_gbps_wall', '-')} |")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_disagg.json"), "w") as f:
            json.dump({"args": vars(args), "single": row_single, "disagg": row_disagg, "prefill": prefill_stats,
                       "check": {"equal": matches, "total": len(want), "diverge_at": diverge}}, f, indent=2)
    ok = matches >= min_match * len(want) and xfer["failed"] == 0 and xfer["transfers"] > 0
    log("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
