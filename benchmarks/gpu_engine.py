"""One H200 run for the engine: correctness of the Triton backend against the torch reference inside the
engine, then the issue's benchmarks on the Llama-3-8B shape with dummy weights (bf16). Prints a table last
and writes JSON to $OUT/gpu_engine.json.

    PYTHONPATH=$PWD python benchmarks/gpu_engine.py            # on the GPU host
    PYTHONPATH=$PWD python benchmarks/gpu_engine.py --smoke    # tiny shapes on the CPU, to test the script
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time

import torch

import prefixrt
from prefixrt.bench import runner as R
from prefixrt.bench import workloads as W

RESULTS: dict = {}


def log(*a):
    print(*a, flush=True)


def free(eng):
    """Shut down and drop the engine's GPU memory (the caller must drop its own reference too)."""
    eng.shutdown()
    eng.core = eng._built = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def rel(a: list[float], b: list[float]) -> float:
    ta, tb = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return ((ta - tb).norm() / tb.norm().clamp_min(1e-12)).item()


def check_backends(model: str, dtype: str, n_prompts: int, smoke: bool) -> dict:
    """Same dummy weights, triton vs torch backend: greedy logprobs at prefill (first token) and decode."""
    rng = random.Random(0)
    vocab = 1000
    shared = [rng.randrange(16, vocab) for _ in range(300 if not smoke else 30)]
    prompts = [shared[: rng.randint(10, len(shared))] + [rng.randrange(16, vocab) for _ in range(rng.randint(1, 90))]
               for _ in range(n_prompts)]
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 20}
    outs = {}
    for backend in ("torch", "triton"):
        kw = dict(load_format="dummy", dtype=dtype, attention_backend=backend, kv_cache_tokens=60000 if not smoke else 3000, seed=0)
        if smoke:
            kw.update(device="cpu", attention_backend="torch")
        eng = prefixrt.Engine(model, **kw)
        eng.generate(prompts[:8], params)  # some prefixes are cached before the batch
        outs[backend] = eng.generate(prompts, params)
        free(eng)
        eng = None
    pre, dec = [], []
    for a, b in zip(outs["triton"], outs["torch"]):
        for j, (la, lb) in enumerate(zip(a.logprobs, b.logprobs)):
            va = {t["token_id"]: t["logprob"] for t in la["top_logprobs"]}
            vb = {t["token_id"]: t["logprob"] for t in lb["top_logprobs"]}
            common = sorted(set(va) & set(vb))
            err = rel([va[t] for t in common], [vb[t] for t in common])
            (pre if j == 0 else dec).append(err)
            if la["token_id"] != lb["token_id"]:
                break
    same = sum(a.token_ids == b.token_ids for a, b in zip(outs["triton"], outs["torch"]))
    return {"dtype": dtype, "prompts": n_prompts, "prefill_rel_err_max": max(pre),
            "decode_rel_err_max": max(dec) if dec else 0.0, "greedy_equal": same}


LONG_KEYS_SCHEMA = {
    "type": "object",
    "properties": {
        "customer_full_name": {"type": "string", "maxLength": 12},
        "customer_email_address": {"type": "string", "maxLength": 16},
        "shipping_address_line_one": {"type": "string", "maxLength": 16},
        "preferred_delivery_window": {"enum": ["morning", "afternoon", "evening"]},
        "order_total_in_cents": {"type": "integer", "minimum": 0, "maximum": 99999},
        "gift_wrapping_requested": {"type": "boolean"},
    },
    "required": ["customer_full_name", "customer_email_address", "shipping_address_line_one",
                 "preferred_delivery_window", "order_total_in_cents", "gift_wrapping_requested"],
    "additionalProperties": False,
}


def json_bench(eng, vocab: int, batch: int) -> dict:
    """Constrained JSON with long fixed keys at batch `batch`: jump-forward on vs off (forward passes and
    throughput), and the constrained step time against unconstrained decoding of the same length."""
    rng = random.Random(11)
    prompts = [[rng.randrange(16, vocab) for _ in range(64)] for _ in range(batch)]
    out = {}
    eng.generate(prompts[:2], {"max_new_tokens": 200, "temperature": 0, "json_schema": LONG_KEYS_SCHEMA})  # warm
    for jf in (True, False):
        eng.flush_cache()
        s0 = eng.stats().forward_passes_total
        t0 = time.perf_counter()
        res = eng.generate(prompts, {"max_new_tokens": 200, "temperature": 0, "json_schema": LONG_KEYS_SCHEMA,
                                     "jump_forward": jf})
        dt = time.perf_counter() - t0
        passes = eng.stats().forward_passes_total - s0
        toks = sum(c.completion_tokens for c in res)
        valid = sum(c.finish_reason == "stop" and bool(json.loads(c.text)) for c in res)
        out["jf_on" if jf else "jf_off"] = {"seconds": dt, "forward_passes": passes, "output_tokens": toks,
                                           "tok_s": toks / dt, "valid": valid, "step_ms": dt / passes * 1000}
    n = max(1, out["jf_off"]["output_tokens"] // batch)
    eng.flush_cache()
    s0 = eng.stats().forward_passes_total
    t0 = time.perf_counter()
    eng.generate(prompts, {"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
    dt = time.perf_counter() - t0
    passes = eng.stats().forward_passes_total - s0
    out["unconstrained"] = {"seconds": dt, "forward_passes": passes, "step_ms": dt / passes * 1000}
    out["jf_speedup"] = out["jf_on"]["tok_s"] / out["jf_off"]["tok_s"]
    out["constrained_step_over_unconstrained"] = out["jf_off"]["step_ms"] / out["unconstrained"]["step_ms"]
    return out


def ttft_once(eng, prompt) -> float:
    t0 = time.perf_counter()
    for _ in eng.stream(prompt, {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}):
        break
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--skip-json", action="store_true")
    ap.add_argument("--profile-ttft", action="store_true")
    args = ap.parse_args()
    smoke = args.smoke
    big = "llama-3-8b" if not smoke else "qwen3-0.6b"
    small = "llama-3.2-1b" if not smoke else "qwen3-0.6b"
    t_start = time.perf_counter()

    if not args.skip_check:
        RESULTS["check_bf16"] = check_backends(small, "bfloat16" if not smoke else "float32", 64 if not smoke else 4,
                                               smoke)
        log("check bf16", RESULTS["check_bf16"])
        RESULTS["check_fp32"] = check_backends(small, "float32", 16 if not smoke else 2, smoke)
        log("check fp32", RESULTS["check_fp32"])

    kw = {} if not smoke else dict(device="cpu", attention_backend="torch", kv_cache_tokens=3000)
    t = time.perf_counter()
    eng = prefixrt.Engine(big, load_format="dummy", **kw)
    log(f"engine up in {time.perf_counter() - t:.1f}s")
    vocab = eng.vocab_size
    scale = 1 if not smoke else 0
    RESULTS["cuda_graphs"] = eng.core.runner.graphs is not None
    log("decode CUDA graphs active:", RESULTS["cuda_graphs"])
    if RESULTS["cuda_graphs"]:  # raw replay time of the captured decode step, no scheduler around it
        for bs in (1, 64, 256):
            g, _ = eng.core.runner.graphs.graphs[bs]
            for _ in range(3):
                g.replay()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                g.replay()
            torch.cuda.synchronize()
            RESULTS[f"graph_replay_ms_b{bs}"] = (time.perf_counter() - t0) / 20 * 1000
            log(f"graph replay b{bs}: {RESULTS[f'graph_replay_ms_b{bs}']:.2f} ms (context {eng.max_context} planned)")
    rag = W.rag(vocab) if not smoke else W.rag(vocab, requests=4, shared_len=64, unique_len=8, output_len=4)
    rand = W.random_prompts(vocab) if not smoke else W.random_prompts(vocab, 4, 32, 4)
    warm = W.random_prompts(vocab, 8, 64, 8, seed=99)
    R.run_workload(eng, warm, "warm-up", show_progress=False)
    R.run_workload(eng, rag, "warm-up", show_progress=False)  # Triton specializations for these shapes
    eng.flush_cache()
    results = []
    r = R.run_workload(eng, rag, "RAG radix", show_progress=False)
    results.append(r)
    log(R.format_table([r]))

    # TTFT: one request on a hot 3500-token prefix + 80 new tokens, and the same cold.
    rng = random.Random(5)
    shared = [rng.randrange(16, vocab) for _ in range(3500 if scale else 64)]
    eng.cache_prefix(shared)
    hot = [ttft_once(eng, shared + [rng.randrange(16, vocab) for _ in range(80)]) for _ in range(7)]
    cold = []
    for _ in range(3):
        eng.flush_cache()
        cold.append(ttft_once(eng, [rng.randrange(16, vocab) for _ in range(3580 if scale else 72)]))
    if args.profile_ttft and torch.cuda.is_available():  # where the hot-prefix TTFT goes
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            ttft_once(eng, shared + [rng.randrange(16, vocab) for _ in range(80)])
        log(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
        log(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12))
    RESULTS["ttft_hot_ms"] = statistics.median(hot) * 1000
    RESULTS["ttft_cold_ms"] = statistics.median(cold) * 1000
    log(f"TTFT hot {RESULTS['ttft_hot_ms']:.2f} ms, cold {RESULTS['ttft_cold_ms']:.2f} ms")

    # Batch-1 decode at 4k context.
    p4k = [rng.randrange(16, vocab) for _ in range(4096 if scale else 64)]
    c = None
    first = None
    n = 0
    for ch in eng.stream(p4k, {"max_new_tokens": 256 if scale else 8, "temperature": 0, "ignore_eos": True}):
        if first is None:
            first = time.perf_counter()
        n += len(ch.token_ids)
    end = time.perf_counter()
    RESULTS["batch1_4k_tok_s"] = (n - 1) / (end - first)
    log(f"batch-1 decode at 4k: {RESULTS['batch1_4k_tok_s']:.1f} tok/s")
    del c

    # Decode at batch 256, 2k context: per-step time from ITL, achieved bandwidth.
    dec = W.random_prompts(vocab, 256 if scale else 4, 2048 if scale else 32, 64 if scale else 4, seed=3)
    eng.flush_cache()
    eng.generate([s[0].new_tokens for s in dec.sessions], {"max_new_tokens": 0})  # prefill all first
    rd = R.run_workload(eng, dec, "decode b256 2k", show_progress=False)
    results.append(rd)
    step_s = rd.itl_ms.get("p50", 0) / 1000
    model = eng._built.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes = prefixrt.engine.builder.KVPool.bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim,
                                                               eng._built.dtype) * 256 * (2048 + 16)
    RESULTS["decode_b256_2k"] = {"step_ms": step_s * 1000, "bytes_per_step_GB": (weight_bytes + kv_bytes) / 1e9,
                                 "achieved_GBps": (weight_bytes + kv_bytes) / step_s / 1e9 if step_s else 0}
    log("decode b256 2k", RESULTS["decode_b256_2k"])

    if not args.skip_json:
        RESULTS["json_jump_forward"] = json_bench(eng, vocab, 64 if scale else 4)
        log("json", RESULTS["json_jump_forward"])
    eng.flush_cache()
    r = R.run_workload(eng, rand, "random radix", show_progress=False)
    results.append(r)
    log(R.format_table([r]))
    free(eng)
    eng = None

    eng = prefixrt.Engine(big, load_format="dummy", radix_cache=False, **kw)
    R.run_workload(eng, warm, "warm-up", show_progress=False)
    for w, label in ((rag, "RAG no-radix"), (rand, "random no-radix")):
        r = R.run_workload(eng, w, label, show_progress=False)
        results.append(r)
        log(R.format_table([r]))
    path = eng._built.resolved.path
    free(eng)
    eng = None
    rr = {x.label: x for x in results}
    RESULTS["random_radix_over_noradix"] = rr["random radix"].output_throughput / rr["random no-radix"].output_throughput

    if not args.skip_hf and time.perf_counter() - t_start < 330:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        hf = R.run_hf_generate(str(path), rag, load_format="dummy", dtype=torch.bfloat16 if dev == "cuda" else
                               torch.float32, device=dev, batch_size=64, show_progress=False)
        results.append(hf)

    RESULTS["table"] = [x.to_dict() for x in results]
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_engine.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
    log(json.dumps({k: v for k, v in RESULTS.items() if k != "table"}, indent=1, default=str))
    log(R.format_table(results))
    log(f"total {time.perf_counter() - t_start:.0f}s")


if __name__ == "__main__":
    sys.exit(main())
