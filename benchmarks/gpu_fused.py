"""One H200 run for the fused layer kernels and small-batch GEMV (Llama-3-8B shape, dummy bf16 weights):
correctness of every fused kernel against its torch reference (bf16 and fp32) first, then timings: fused
vs unfused per op, GEMV layouts vs cuBLAS per shape and M in {1, 2, 4, 8, 16}, batch-1 decode at 4k context
(tok/s, graph replay, kernels per step, fused vs unfused), decode at batch 256 / 2k context (GB/s vs the
4.3 TB/s floor), the long-context multi-turn workload (Llama-3.1-8B shape, 128k context) against the bf16
compute floor, and torch.compile
for the GEMV shapes with the time left. Prints a short table last; JSON to $OUT/gpu_fused.json.

    PYTHONPATH=$PWD python benchmarks/gpu_fused.py            # on the GPU host (about 4 minutes)
    PYTHONPATH=$PWD python benchmarks/gpu_fused.py --smoke    # tiny shapes on the CPU (Triton interpreter)
"""

from __future__ import annotations

import gc
import json
import os
import random
import time
import traceback

import torch
import torch.nn.functional as F

from benchmarks.common import rel_err, replay_ms, script_parser

RESULTS: dict = {}
T0 = time.perf_counter()
BUDGET_S = 200.0  # sections starting later than this are skipped (one run stays under 4 minutes)
HBM_FLOOR_GBPS = 4300.0


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def save():
    out = os.environ.get("OUT")
    if not out:  # (a smoke run on a checkout: nothing to keep)
        return
    with open(os.path.join(out, "gpu_fused.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def section(name, fn, *args):
    if time.perf_counter() - T0 > BUDGET_S:
        RESULTS[name] = {"skipped": "time budget"}
        log(f"{name}: skipped (time budget)")
        return None
    t = time.perf_counter()
    try:
        res = fn(*args)
        RESULTS[name] = res
    except Exception as e:  # keep going: the other sections still report
        RESULTS[name] = {"error": f"{type(e).__name__}: {e}"}
        traceback.print_exc()
        res = None
    log(f"{name} done in {time.perf_counter() - t:.1f}s")
    save()
    return res


# --------------------------------------------------------------------------------------- correctness


def correctness(dev, smoke):
    from prefixrt.kernels import fused_reference as ref
    from prefixrt.kernels.activation import act_mul
    from prefixrt.kernels.gemv import GemvConfig, gemv
    from prefixrt.kernels.norm import add_rms_norm
    from prefixrt.kernels.rope import qk_norm_rope_store

    from prefixrt.model.layers import RopeConfig, RotaryEmbedding

    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
    hidden, inter, (h, kvh, d) = (4096, 14336, (32, 8, 128)) if not smoke else (128, 256, (4, 2, 32))
    tokens = 64 if not smoke else 4
    out = {}
    g = torch.Generator(device=dev).manual_seed(0)

    def rn(*shape, dtype, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dtype)

    def record(name, dtype, err):
        key = f"{name}/{str(dtype).split('.')[-1]}"
        out[key] = {"rel_err": err, "ok": err < tol[dtype]}

    for dtype in (torch.bfloat16, torch.float32):
        for gemma in (False, True):
            x, r = rn(tokens, hidden, dtype=dtype, scale=3), rn(tokens, hidden, dtype=dtype)
            w = rn(hidden, dtype=dtype, scale=0.5) + (0.0 if gemma else 1.0)
            got, exp = add_rms_norm(x, w, 1e-5, r, gemma=gemma), ref.add_rms_norm(x, w, 1e-5, r, gemma=gemma)
            record(f"add_rms_norm{'_gemma' if gemma else ''}", dtype, max(rel_err(got[0], exp[0]), rel_err(got[1], exp[1])))
        for act in ("silu", "gelu_tanh"):
            gu = rn(tokens, 2 * inter, dtype=dtype, scale=3)
            record(f"act_mul_{act}", dtype, rel_err(act_mul(gu, act), ref.act_mul(gu, act)))
        rope_cases = {  # Llama-3.1 (llama3 scaling), Gemma-3 global layer (linear, q/k norm, D=256), Qwen3
            "rope_llama3": (RopeConfig(d, 500000.0, "llama3", 8.0, 1.0, 4.0, 8192), h, kvh, d, None),
            "rope_gemma_qknorm": (RopeConfig(256, 1e6, "linear", 8.0), 4, 1, 256, "gemma"),
            "rope_qwen3_qknorm": (RopeConfig(d, 1e6), h, kvh, d, "llama"),
        }
        for name, (cfg, nh, nkv, hd, norm) in rope_cases.items():
            pos = torch.randint(0, 32768, (tokens,), generator=g, device=dev)
            cos, sin = RotaryEmbedding(cfg)(pos)
            qkv = rn(tokens, (nh + 2 * nkv) * hd, dtype=dtype, scale=2)
            loc = torch.randperm(4 * tokens, generator=g, device=dev)[:tokens]
            kw = {}
            if norm:
                base = 0.0 if norm == "gemma" else 1.0
                kw = dict(q_norm_weight=rn(hd, dtype=dtype, scale=0.3) + base,
                          k_norm_weight=rn(hd, dtype=dtype, scale=0.3) + base, norm_eps=1e-6,
                          gemma_norm=norm == "gemma")
            bufs = [torch.zeros(4 * tokens, nkv, hd, device=dev, dtype=dtype) for _ in range(4)]
            q = qk_norm_rope_store(qkv, cos, sin, loc, bufs[0], bufs[1], nh, nkv, hd, **kw)
            eq = ref.qk_norm_rope_store(qkv, cos, sin, loc, bufs[2], bufs[3], nh, nkv, hd, **kw)
            record(name, dtype, max(rel_err(q, eq), rel_err(bufs[0], bufs[2]), rel_err(bufs[1], bufs[3])))
        shapes = gemv_shapes(smoke)
        for name, (n, k, act) in shapes.items():
            if dtype == torch.float32 and name == "lm_head" and smoke is False:
                n = 32768  # the fp32 check on a quarter of the vocab keeps the run short
            wt = rn(n, k, dtype=dtype, scale=k**-0.5)
            for m in (1, 16) if not smoke else (1, 3):
                x = rn(m, 2 * k if act else k, dtype=dtype)
                exp = ref.linear(x, wt, None, act)
                errs = []
                for c in (GemvConfig(), GemvConfig(32, 256, 4), GemvConfig(16, 256, 1)):
                    try:
                        errs.append(rel_err(gemv(x, wt, None, c, act), exp))
                    except Exception as e:  # a layout that does not fit this GPU is reported, not fatal
                        out[f"gemv_{name}_m{m}_{c}/{str(dtype).split('.')[-1]}"] = {"error": str(e)[:200]}
                if errs:
                    record(f"gemv_{name}_m{m}", dtype, max(errs))
    out["all_ok"] = all(v["ok"] for v in out.values() if isinstance(v, dict) and "ok" in v)
    return out


def gemv_shapes(smoke):
    if smoke:
        return {"qkv": (96, 64, None), "down+silu": (64, 128, "silu")}
    return {"qkv": (6144, 4096, None), "o": (4096, 4096, None), "gate_up": (28672, 4096, None),
            "down": (4096, 14336, None), "down+silu": (4096, 14336, "silu"), "lm_head": (128256, 4096, None)}


# ---------------------------------------------------------------------------------------- per-op timing


def op_timings(dev):
    from prefixrt.kernels import fused_reference as ref
    from prefixrt.kernels.activation import act_mul
    from prefixrt.kernels.gemv import graph_time_us
    from prefixrt.kernels.norm import add_rms_norm
    from prefixrt.kernels.rope import qk_norm_rope_store

    from prefixrt.model.layers import RopeConfig, RotaryEmbedding

    bf = torch.bfloat16
    out = {}

    def at(tokens):  # every op at one token count, timed inside CUDA graphs
        x, r = torch.randn(tokens, 4096, device=dev, dtype=bf), torch.randn(tokens, 4096, device=dev, dtype=bf)
        w = torch.randn(4096, device=dev, dtype=bf)
        gu = torch.randn(tokens, 2 * 14336, device=dev, dtype=bf)
        cos, sin = RotaryEmbedding(RopeConfig(128, 500000.0, "llama3", 8.0, 1.0, 4.0, 8192))(
            torch.arange(tokens, device=dev) + 4000)
        qkv = torch.randn(tokens, 48 * 128, device=dev, dtype=bf)
        kb, vb = (torch.zeros(65536, 8, 128, device=dev, dtype=bf) for _ in range(2))
        loc = torch.randperm(65536, device=dev)[:tokens]
        gq = torch.randn(tokens, 6 * 256, device=dev, dtype=bf)
        gkb, gvb = (torch.zeros(65536, 1, 256, device=dev, dtype=bf) for _ in range(2))
        gw = torch.randn(256, device=dev, dtype=bf)
        gcos, gsin = torch.randn(tokens, 256, device=dev), torch.randn(tokens, 256, device=dev)
        ops = {
            "add_rms_norm": (lambda i: add_rms_norm(x, w, 1e-5, r), lambda i: ref.add_rms_norm(x, w, 1e-5, r)),
            "silu_mul": (lambda i: act_mul(gu, "silu"), lambda i: ref.act_mul(gu, "silu")),
            "rope_kv_store_llama3": (
                lambda i: qk_norm_rope_store(qkv, cos, sin, loc, kb, vb, 32, 8, 128),
                lambda i: ref.qk_norm_rope_store(qkv, cos, sin, loc, kb, vb, 32, 8, 128)),
            "gemma_qknorm_rope_kv_store": (
                lambda i: qk_norm_rope_store(gq, gcos, gsin, loc, gkb, gvb, 4, 1, 256, gw, gw, 1e-6, True),
                lambda i: ref.qk_norm_rope_store(gq, gcos, gsin, loc, gkb, gvb, 4, 1, 256, gw, gw, 1e-6, True)),
        }
        for name, (fused, unfused) in ops.items():
            tf, tu = graph_time_us(fused, 20), graph_time_us(unfused, 20)
            out[f"{name}/T{tokens}"] = {"fused_us": round(tf, 2), "unfused_us": round(tu, 2),
                                        "speedup": round(tu / tf, 2)}
            log(f"  {name} T={tokens}: fused {tf:.1f} us, unfused {tu:.1f} us")

    for tokens in (1, 256):
        at(tokens)
    return out


# ---------------------------------------------------------------------------------------------- GEMV


def gemv_sweep(dev, smoke):
    from prefixrt.model.layers import gemv_choice

    out = {}
    for name, (n, k, act) in gemv_shapes(smoke).items():
        gb = n * k * 2 / 1e9
        for m in (1, 2, 4, 8, 16):
            best, timings = gemv_choice(n, k, m, act, torch.bfloat16, dev, use_table=False)  # measure now
            cublas = timings.get(None)
            tri = {str(c): t for c, t in timings.items() if c is not None}
            best_tri = min(tri, key=tri.get) if tri else None
            row = {"cublas_us": round(cublas, 2) if cublas else None,
                   "cublas_GBps": round(gb / cublas * 1e6) if cublas else None,
                   "triton_best": best_tri, "triton_us": round(tri[best_tri], 2) if best_tri else None,
                   "triton_GBps": round(gb / tri[best_tri] * 1e6) if best_tri else None,
                   "chosen": str(best) if best is not None else "cublas", "all_us": {k_: round(v, 2) for k_, v in tri.items()}}
            out[f"{name}/m{m}"] = row
            log(f"  gemv {name} m={m}: cuBLAS {row['cublas_us']} us ({row['cublas_GBps']} GB/s), "
                f"triton {row['triton_us']} us ({row['triton_GBps']} GB/s) {best_tri} -> {row['chosen']}")
    return out


def torch_compile_gemv(dev):
    from prefixrt.kernels.gemv import graph_time_us

    out = {}
    for name, (n, k, act) in gemv_shapes(False).items():
        if act or time.perf_counter() - T0 > BUDGET_S + 25:
            continue
        for m in (1, 16):
            copies = max(4, min(16, -(-256 * 2**20 // (n * k * 2))))
            ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)

            def lin(a, b):
                return F.linear(a, b)

            comp = torch.compile(lin, dynamic=False)
            t = time.perf_counter()
            comp(x, ws[0])
            compile_s = time.perf_counter() - t
            us = graph_time_us(lambda i, c=comp, x=x, ws=ws: c(x, ws[i]), copies)
            out[f"{name}/m{m}"] = {"us": round(us, 2), "GBps": round(n * k * 2 / us / 1e3), "compile_s": round(compile_s, 1)}
            log(f"  torch.compile {name} m={m}: {us:.1f} us (compile {compile_s:.1f}s)")
    return out


# -------------------------------------------------------------------------------------------- engine


def count_kernels(fn) -> tuple[int, dict]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names: dict[str, int] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset")):
            names[e.name] = names.get(e.name, 0) + 1
    top = dict(sorted(names.items(), key=lambda kv: -kv[1])[:12])
    return sum(names.values()), top


def engine_sections(smoke):
    import prefixrt
    from prefixrt.bench import runner as R
    from prefixrt.bench import workloads as W
    from prefixrt.cache.kv_pool import KVPool
    from prefixrt.model.layers import use_fused_kernels

    model_name = "llama-3-8b" if not smoke else "qwen3-0.6b"
    kw = {} if not smoke else dict(device="cpu", attention_backend="torch", kv_cache_tokens=4000)
    t = time.perf_counter()
    eng = prefixrt.Engine(model_name, load_format="dummy", **kw)
    RESULTS["engine_start_s"] = round(time.perf_counter() - t, 1)
    log(f"engine up in {RESULTS['engine_start_s']}s")
    model = eng.probes.model
    runner = eng.core.runner  # (the b1 step profile's kernel counts: see tests/benchmarks/test_public_api_only.py)
    vocab = eng.vocab_size
    rng = random.Random(5)
    R.run_workload(eng, W.random_prompts(vocab, 4, 64, 8, seed=99), "warm-up", show_progress=False)

    def decode_step_profile():
        g = runner.graphs
        g.positions[:1].fill_(4095)
        g.seq_lens[:1].fill_(4096)
        g.req_pool_indices[:1].fill_(g.pad_row)  # every position reads the padding slot
        g.out_cache_loc[:1].zero_()
        batch = g._static_batch(1)
        res = {}
        with torch.inference_mode():
            res["kernels_fused"], res["top_fused"] = count_kernels(lambda: runner._forward_eager(batch))
            res["replay_ms_fused"] = replay_ms(g.graphs[1][0])
            use_fused_kernels(model, enabled=False)
            res["kernels_unfused"], res["top_unfused"] = count_kernels(lambda: runner._forward_eager(batch))
            from prefixrt.model.cuda_graphs import DecodeGraphs

            ug = DecodeGraphs(runner._forward_eager, runner.attn_backend, g.req_to_token, g.pad_row, 1,
                              g.max_context, g.input_ids.device)
            ug.capture()
            ug.positions[:1].fill_(4095)
            ug.seq_lens[:1].fill_(4096)
            ug.req_pool_indices[:1].fill_(g.pad_row)
            res["replay_ms_unfused"] = replay_ms(ug.graphs[1][0])
            ug.close()
            use_fused_kernels(model, enabled=True)  # cached choices: no re-measurement
        log(f"  b1 step: {res['kernels_fused']} kernels fused ({res['replay_ms_fused']:.2f} ms replay) vs "
            f"{res['kernels_unfused']} unfused ({res['replay_ms_unfused']:.2f} ms)")
        return res

    if runner.graphs is not None:
        section("b1_step", decode_step_profile)

    def batch1_4k():
        p4k = [rng.randrange(16, vocab) for _ in range(4096 if not smoke else 64)]
        first, n = None, 0
        for ch in eng.stream(p4k, {"max_new_tokens": 256 if not smoke else 8, "temperature": 0, "ignore_eos": True}):
            if first is None:
                first = time.perf_counter()
            n += len(ch.token_ids)
        tok_s = (n - 1) / (time.perf_counter() - first)
        log(f"  batch-1 decode at 4k: {tok_s:.1f} tok/s")
        return {"tok_s": round(tok_s, 1), "target": 240}

    section("batch1_4k", batch1_4k)

    def decode_b256():
        bs, ctx, out_len = (256, 2048, 32) if not smoke else (4, 32, 4)
        dec = W.random_prompts(vocab, bs, ctx, out_len, seed=3)
        eng.flush_cache()
        eng.generate([s[0].new_tokens for s in dec.sessions], {"max_new_tokens": 0})  # prefill all first
        rd = R.run_workload(eng, dec, "decode", show_progress=False)
        step_s = rd.itl_ms.get("p50", 0) / 1000
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        kv = KVPool.bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, getattr(torch, eng.probes.facts()["dtype"].removeprefix("torch.")))
        total = weight_bytes + kv * bs * (ctx + out_len // 2)
        gbps = total / step_s / 1e9 if step_s else 0.0
        log(f"  decode b{bs} ctx {ctx}: step {step_s * 1000:.1f} ms, {gbps:.0f} GB/s = {gbps / HBM_FLOOR_GBPS:.0%}")
        return {"step_ms": round(step_s * 1000, 2), "bytes_per_step_GB": round(total / 1e9, 2),
                "achieved_GBps": round(gbps), "fraction_of_4300": round(gbps / HBM_FLOOR_GBPS, 3),
                "out_tok_s": round(rd.output_throughput)}

    section("decode_b256_2k", decode_b256)
    eng.shutdown()
    eng = model = runner = None  # drop the engine before the remaining GPU sections
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def long_context_section(smoke):
    """The long-context multi-turn workload on the Llama-3.1-8B shape (Llama-3-8B's dims, 128k context):
    computed prompt tokens per second against the bf16 compute floor."""
    import prefixrt
    from prefixrt.bench import runner as R
    from prefixrt.bench import workloads as W
    from prefixrt.bench.compute_floor import ModelShape, floor_report, format_floor

    model_name = "llama-3.1-8b" if not smoke else "qwen3-0.6b"
    kw = {} if not smoke else dict(device="cpu", attention_backend="torch", kv_cache_tokens=4000)
    eng = prefixrt.Engine(model_name, load_format="dummy", **kw)
    try:
        vocab = eng.vocab_size
        R.run_workload(eng, W.random_prompts(vocab, 4, 64, 8, seed=99), "warm-up", show_progress=False)
        eng.flush_cache()
        w = W.long_context(vocab) if not smoke else W.long_context(vocab, 2, 2, 32, 4)
        r = R.run_workload(eng, w, "long-context", show_progress=False)
        rep = floor_report(ModelShape.of(eng.probes.model), [(q.prompt_tokens, q.cached_tokens) for q in r.records],
                           r.duration_s)
        log("  " + format_floor("long-context", rep))
        return {"model": model_name, "workload": w.description, "duration_s": round(r.duration_s, 2), **rep,
                "cache_hit_rate": round(r.cache_hit_rate, 4), "ttft_ms": r.ttft_ms}
    finally:
        eng.shutdown()
        eng = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------- table


def table():
    lines = ["", "== summary ==", f"{'item':<34} {'value':>44}"]

    def add(k, v):
        lines.append(f"{k:<34} {v:>44}")

    c = RESULTS.get("correctness", {})
    if "all_ok" in c:
        worst = {}
        for key, v in c.items():
            if isinstance(v, dict) and "rel_err" in v:
                dt = key.split("/")[-1]
                worst[dt] = max(worst.get(dt, 0), v["rel_err"])
        verdict = "all ok" if c["all_ok"] else "FAIL" + (" (the interpreter truncates to bf16)" if RESULTS["smoke"] else "")
        add("fused kernels vs reference", f"{verdict}; worst " +
            ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    for key, v in RESULTS.get("op_timings", {}).items():
        if isinstance(v, dict) and "fused_us" in v:
            add(key, f"{v['fused_us']:.1f} us fused vs {v['unfused_us']:.1f} unfused")
    for key, v in RESULTS.get("gemv", {}).items():
        if isinstance(v, dict) and "cublas_GBps" in v and key.endswith(("m1", "m16")):
            add(f"gemv {key} GB/s", f"cuBLAS {v['cublas_GBps']} | triton {v['triton_GBps']} -> {v['chosen']}")
    for key, v in RESULTS.get("torch_compile", {}).items():
        if isinstance(v, dict) and "GBps" in v:
            add(f"torch.compile {key} GB/s", f"{v['GBps']}")
    b = RESULTS.get("b1_step", {})
    if "kernels_fused" in b:
        add("b1 kernels/step fused|unfused", f"{b['kernels_fused']} | {b['kernels_unfused']}")
        add("b1 replay ms fused|unfused", f"{b['replay_ms_fused']:.2f} | {b['replay_ms_unfused']:.2f}")
    if "tok_s" in RESULTS.get("batch1_4k", {}):
        add("batch-1 decode 4k tok/s", f"{RESULTS['batch1_4k']['tok_s']} (target 240)")
    d = RESULTS.get("decode_b256_2k", {})
    if "achieved_GBps" in d:
        add("decode b256 2k GB/s", f"{d['achieved_GBps']} = {d['fraction_of_4300']:.0%} of 4300 (target 75%)")
    lc = RESULTS.get("long_context", {})
    if "computed_tok_s" in lc:
        add("long-context computed tok/s", f"{lc['computed_tok_s']:.0f} vs floor {lc['floor_tok_s']:.0f} "
            f"({lc['fraction_of_floor']:.0%})")
    add("wall s", f"{time.perf_counter() - T0:.0f}")
    print("\n".join(lines), flush=True)


def main():
    ap = script_parser(__doc__, smoke="tiny shapes on the CPU under the Triton interpreter")
    args = ap.parse_args()
    smoke = args.smoke
    if smoke:  # before any kernel module is imported (they are imported inside the sections)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    dev = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    RESULTS["device"] = torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"
    RESULTS["smoke"] = smoke
    section("correctness", correctness, dev, smoke)
    if dev.type == "cuda":
        section("gemv", gemv_sweep, dev, smoke)  # also fills the engine's GEMV choices (same process)
        gc.collect()
        torch.cuda.empty_cache()  # the sweep's weight copies must not shrink the engine's KV pool
    engine_sections(smoke)
    section("long_context", long_context_section, smoke)
    if dev.type == "cuda":
        section("op_timings", op_timings, dev)
        section("torch_compile", torch_compile_gemv, dev)
    save()
    table()


if __name__ == "__main__":
    main()
