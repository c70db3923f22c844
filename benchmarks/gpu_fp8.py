"""FP8 on one H200, Llama-3-8B shape with dummy weights, bf16 and FP8 in the same run:
(1) kernels: the FP8 kernels against their torch references on the GPU (activation quantization per group and per
    token, the Triton FP8 GEMM per-channel and 128x128-block with group activation scales, quantize +
    torch._scaled_mm with per-token ones, extend / decode / cascade attention and the fused
    RoPE store over an e4m3 K/V pool);
(2) layouts: the FP8 GEMM's Triton layouts for the 8B linears at 1-64 rows with group activation scales, the engines'
    default (the engines below use these choices; the lines to paste into kernels/fp8_table.py are printed);
(5) GEMMs: per 8B linear and the LM head at 1, 8, 64, 256 rows, bf16 cuBLAS against the FP8 GEMM with group
    activation scales as the table ran it, its best split-K layout, other Triton layouts (256 rows: the prefill-size
    question, since group scales run the Triton GEMM at every batch size) and quantize + _scaled_mm with per-token
    scales (us, weight TB/s);
(3) logits: FP8 weights, FP8 K/V and both against bf16 on the same dummy weights (relative error, top-1 agreement);
(4) engines bf16 | FP8 weights | FP8 weights + FP8 K/V: batch-1 decode at 4k context, the RAG workload in-process
    (64 x (3500 shared + 80 unique), 200 out, streamed with text), decode throughput at batch 256, and the KV pool's
    tokens at the same memory fraction. --configs labels: bf16; fp8 (the engine's defaults: per-token activation
    scales for tall inputs, smoothed at load); fp8+kv; kv (FP8 K/V alone); fp8t, fp8t+kv (per-token scales named);
    fp8n (weight-only tall inputs, fp8_activation_scale="none"); fp8u (per-token scales without smoothing: the
    start-up cost of smoothing's calibration forward is fp8's start-up less fp8u's).
Prints a short table last and writes JSON to benchmarks/results/gpu_fp8-<sections>.json (and $OUT when set).
Sections that would start past --budget-s are skipped (said so in the table). Section 2 saves its choices to
benchmarks/results/gpu_fp8_group_layouts.json; section 4 run later on the same GPU model loads them, so the two can run as
separate commands:

    PYTHONPATH=$PWD python benchmarks/gpu_fp8.py --only 123                       # kernels, logits, layouts
    PYTHONPATH=$PWD python benchmarks/gpu_fp8.py --only 2 --layout-rows 1,8       # layouts of some row counts
    PYTHONPATH=$PWD python benchmarks/gpu_fp8.py --only 5                         # GEMM timings
    PYTHONPATH=$PWD python benchmarks/gpu_fp8.py --only 4 --configs bf16,fp8+kv   # engines (measured layouts)
    PYTHONPATH=$PWD python benchmarks/gpu_fp8.py --only 4 --configs fp8
    PYTHONPATH=$PWD python benchmarks/gpu_fp8.py --smoke      # the same logic on a tiny checkpoint on the CPU
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import random
import tempfile
import time
from pathlib import Path

from benchmarks.common import log, log_table, rel_err, run_section, script_parser, write_results

RESULTS: dict = {}
SUMMARY: list[tuple[str, str, str]] = []  # (what, value, note)
BUDGET_S = 230  # --budget-s: an 8B engine takes 30-65 s to start, a section cannot be cut short
RESULTS_DIR = Path(__file__).resolve().parent / "results"
LAYOUTS_FILE = RESULTS_DIR / "gpu_fp8_group_layouts.json"  # (choices with group activation scales)
T_START = time.perf_counter()
MODEL = "llama-3-8b"
# the FP8 acceptance lines, each a ratio to bf16 in the same run (docs/benchmarks.md, "FP8")
TARGETS = {"b1": 1.8, "rag": 1.25, "b256": 1.5, "startup": 1.2}


def over_budget(what: str) -> bool:
    if time.perf_counter() - T_START > BUDGET_S:
        SUMMARY.append((what, "SKIPPED", f"past the {BUDGET_S} s budget"))
        return True
    return False


def section(name: str, fn) -> None:
    if not over_budget(name):
        run_section(RESULTS, SUMMARY, name, fn)


# ------------------------------------------------------------------------------------------------ (1) kernels


def kernel_checks(smoke: bool, dev) -> dict:
    """Each FP8 kernel on the device against its torch reference: relative errors (and byte mismatches where the
    result is e4m3), each with its limit."""
    import torch
    from prefixrt.kernels import fp8_gemm as G
    from prefixrt.kernels import fp8_reference as R
    from prefixrt.kernels import fused_reference as fused_ref
    from prefixrt.kernels import reference as ref
    from prefixrt.kernels.cascade_decode import cascade_decode_attention
    from prefixrt.kernels.cascade_plan import plan_cascade
    from prefixrt.kernels.decode_attention import decode_attention
    from prefixrt.kernels.extend_attention import extend_attention
    from prefixrt.kernels.rope import qk_norm_rope_store

    out: dict = {}
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dev)

    k_dim = 4096 if not smoke else 256
    x = randn(64 if not smoke else 8, k_dim, scale=3.0).to(torch.bfloat16)
    mismatch, scale_err = 0, 0.0
    for scheme in ("group", "token"):
        x_q, x_s = G.quantize_activations(x, scheme)
        r_q, r_s = R.quantize_activations(x, scheme)
        mismatch += int((x_q.view(torch.uint8) != r_q.view(torch.uint8)).sum())
        scale_err = max(scale_err, rel_err(x_s, r_s))
    out["quantize_rows_byte_mismatch"] = mismatch  # (both activation schemes)
    out["quantize_rows_scale_rel_err"] = scale_err

    shapes = [(6144, 4096), (4096, 14336)] if not smoke else [(96, 256)]
    worst = {}
    for n, k in shapes:
        w = randn(n, k, scale=k**-0.5)
        for block in (False, True):
            w_q, w_s = R.quantize_blocks(w) if block else R.quantize_weight(w)
            for m in ((1, 16, 64, 300) if not smoke else (1, 20)):
                xm = randn(m, k).to(torch.bfloat16)
                want = R.fp8_linear(xm, w_q, w_s).float()  # activation scales per group (the default)
                configs = [G.Fp8GemmConfig(quantize_input=True), G.Fp8GemmConfig(quantize_input=False),
                           G.Fp8GemmConfig(quantize_input=True, split_k=4),
                           G.Fp8GemmConfig(32, 128, quantize_input=False, split_k=8 if not smoke else 2)]
                if not block and G.scaled_mm_supported(xm.device):
                    configs.append(None)
                for cfg in configs:
                    label = "scaled_mm" if cfg is None else (f"triton_{'block' if block else 'channel'}"
                                                             f"{'_split_k' if cfg.split_k > 1 else ''}")
                    if cfg is None:  # cuBLAS's row-wise scales: per-token activations
                        err = rel_err(G.run_config(xm, w_q, w_s, None, None, "token"),
                                      R.fp8_linear(xm, w_q, w_s, activation_scale="token").float())
                    else:
                        err = rel_err(G.run_config(xm, w_q, w_s, None, cfg), want)
                    worst[label] = max(worst.get(label, 0.0), err)
    out["gemm_rel_err"] = {k: round(v, 5) for k, v in worst.items()}
    out["scaled_mm_supported"] = G.scaled_mm_supported(x.device)

    # The attention kernels and the fused RoPE store over a bf16 pool (the paths every engine runs: they must not
    # regress) and over an e4m3 pool with per-kv-head scales; 8 kv heads of 128 (Llama-3-8B).
    kvh, d, h = (8, 128, 32) if not smoke else (2, 32, 4)
    slots = 40000 if not smoke else 2000
    k_f, v_f = randn(slots, kvh, d, scale=2.0), randn(slots, kvh, d)
    k_scale = k_f.abs().amax(dim=(0, 2)) / 448
    v_scale = v_f.abs().amax(dim=(0, 2)) / 448
    pools = {"bf16": (k_f.to(torch.bfloat16), v_f.to(torch.bfloat16), {}),
             "fp8": (R.quantize_kv(k_f, k_scale), R.quantize_kv(v_f, v_scale),
                     {"k_scale": k_scale, "v_scale": v_scale})}
    perm = (torch.randperm(slots - 1, generator=gen) + 1).to(dev)
    prefix, own, members = (2000, 100, 8) if not smoke else (40, 6, 3)
    ext = (200, 64) if not smoke else (10, 5)  # extend: rows 8 (over the cached prefix) and 9 (from position 0)
    rows, own_width = 10, max(own, ext[0]) + 8
    table = torch.zeros(rows, prefix + own_width, dtype=torch.int32, device=dev)
    table[:, :prefix] = perm[:prefix].int()  # every row shares the prefix's slots
    for r in range(rows):
        table[r, prefix:] = perm[prefix + r * own_width : prefix + (r + 1) * own_width].int()
    sm = d**-0.5
    errs = {}
    b = members
    q = randn(b, h, d).to(torch.bfloat16)
    seq_lens = torch.full((b,), prefix + own, dtype=torch.int32, device=dev)
    row_idx = torch.arange(b, device=dev)
    plan = plan_cascade([(prefix, list(range(b)))], [prefix + own] * b, dev, queries_per_tile=16)
    qe = randn(sum(ext), h, d).to(torch.bfloat16)
    i32 = {"dtype": torch.int32, "device": dev}
    t = 64 if not smoke else 6
    qkv = randn(t, (h + 2 * kvh) * d, scale=2.0).to(torch.bfloat16)
    ang = torch.arange(t, device=dev)[:, None].float() * torch.rand(d // 2, generator=gen).to(dev)[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    loc = perm[-t:]
    bf16_store = None
    for kind, (k8, v8, scales) in pools.items():
        # decode: `members` sequences of prefix + own tokens, plain (split-K) and cascade (shared prefix)
        o, want = torch.empty_like(q), torch.empty_like(q)
        decode_attention(q, o, k8, v8, table, row_idx, seq_lens, sm, num_kv_splits=8, **scales)
        ref.decode_attention(q, want, k8, v8, table, row_idx, seq_lens, sm, **scales)
        errs[f"decode_{kind}"] = rel_err(o, want)
        o = torch.empty_like(q)
        cascade_decode_attention(q, o, k8, v8, table, row_idx, seq_lens, sm, plan, num_prefix_splits=4,
                                 num_suffix_splits=2, **scales)
        errs[f"cascade_{kind}"] = rel_err(o, want)
        # extend: two sequences, one over the cached prefix
        args = (k8, v8, table, torch.tensor([8, 9], device=dev), torch.tensor([prefix, 0], **i32),
                torch.tensor(list(ext), **i32), torch.tensor([0, ext[0]], **i32), max(ext), sm)
        o, want = torch.empty_like(qe), torch.empty_like(qe)
        extend_attention(qe, o, *args, **scales)
        ref.extend_attention(qe, want, *args, **scales)
        errs[f"extend_{kind}"] = rel_err(o, want)
        # the fused RoPE store against the torch one (bf16: close; e4m3: the bf16 store quantized, byte for byte)
        k_pool, v_pool = torch.zeros_like(k8), torch.zeros_like(v8)
        q_out = qk_norm_rope_store(qkv, cos, sin, loc, k_pool, v_pool, h, kvh, d, **scales)
        if not scales:
            k_ref, v_ref = torch.zeros_like(k8), torch.zeros_like(v8)
            q_ref = fused_ref.qk_norm_rope_store(qkv, cos, sin, loc, k_ref, v_ref, h, kvh, d)
            bf16_store = k_pool[loc]
            errs["rope_store_bf16"] = max(rel_err(q_out, q_ref), rel_err(bf16_store, k_ref[loc]),
                                          rel_err(v_pool[loc], v_ref[loc]))
        else:
            out["rope_store_byte_mismatch"] = int((k_pool[loc].view(torch.uint8) != R.quantize_kv(
                bf16_store, k_scale).view(torch.uint8)).sum())
    out["attention_rel_err"] = {k: round(v, 5) for k, v in errs.items()}
    ok = (out["quantize_rows_byte_mismatch"] == 0 and max(worst.values()) < 1e-2 and max(errs.values()) < 2e-2
          and out["rope_store_byte_mismatch"] == 0)
    out["ok"] = ok
    SUMMARY.append(("FP8 kernels vs references", "ok" if ok else "MISMATCH",
                    f"GEMM worst {max(worst.values()):.1e} (1e-2), attention worst {max(errs.values()):.1e} (2e-2), "
                    f"_scaled_mm {'on' if out['scaled_mm_supported'] else 'unavailable'}"))
    log(json.dumps(out, indent=1))
    return out


# ------------------------------------------------------------------------------------------------ (2) layouts


SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LM_HEAD = (128256, 4096)


def measure_layouts(smoke: bool, dev, rows_measured: tuple[int, ...]) -> dict:
    """choose_config per 8B linear shape and row count (rows_measured, of fp8_linear.MEASURED_ROWS); the choices go
    where the engines' plans look first, merged into the saved file (so the row counts can be measured by separate
    runs on one machine)."""
    import torch

    from prefixrt.model import fp8_linear

    if dev.type != "cuda":
        return {"skipped": "no CUDA: the table is measured on the GPU only"}
    shapes = SHAPES
    gpu = torch.cuda.get_device_name(dev)
    out, lines = {}, []
    for name, (n, k) in shapes.items():
        for rows in rows_measured:
            if over_budget(f"layouts {name} {rows} rows and after"):
                break
            config, timings = fp8_linear._kernels().choose_config(n, k, rows, dev)  # group activation scales
            fp8_linear._CHOICES[(n, k, rows, False, gpu, "group")] = config
            cublas = timings.get(None)  # (None: _scaled_mm cannot take group scales)
            best = min((t for c, t in timings.items() if c is not None), default=float("nan"))
            out[f"{name}_{rows}"] = {"choice": str(config), "scaled_mm_us": cublas, "best_triton_us": best}
            value = "None" if config is None else f"Fp8GemmConfig{dataclasses.astuple(config)}"
            lines.append(f"        ({n}, {k}, {rows}): {value},  # {name}: quantize+_scaled_mm "
                         f"{cublas if cublas is None else round(cublas, 2)} us, best layout {best:.2f} us")
    log(f"kernels/fp8_table.py entries for {gpu!r}:\n" + "\n".join(lines))
    saved = {}
    if LAYOUTS_FILE.is_file() and json.loads(LAYOUTS_FILE.read_text())["gpu"] == gpu:
        saved = json.loads(LAYOUTS_FILE.read_text())["choices"]
    saved.update({f"{n},{k},{rows}": None if c is None else list(dataclasses.astuple(c))
                  for (n, k, rows, block, g, scheme), c in fp8_linear._CHOICES.items()
                  if g == gpu and not block and scheme == "group"})
    RESULTS_DIR.mkdir(exist_ok=True)
    LAYOUTS_FILE.write_text(json.dumps({"gpu": gpu, "choices": saved}, indent=1))
    out["table_lines"] = lines
    won = sum(v["choice"] != "None" for k, v in out.items() if isinstance(v, dict))
    SUMMARY.append(("FP8 GEMM layouts measured", f"{won} of {len(lines)} Triton", "rest quantize + _scaled_mm"))
    return out


def load_layouts(dev) -> None:
    """Section 2's saved choices (this GPU model's) into the engines' plans (fp8_linear looks there first)."""
    import torch

    from prefixrt.model import fp8_linear

    gpu = torch.cuda.get_device_name(dev)
    if not LAYOUTS_FILE.is_file() or json.loads(LAYOUTS_FILE.read_text())["gpu"] != gpu:
        log("no w8a8 layouts measured by section 2 for this GPU (the engines' decode batches run weight-only FP8 "
            "from kernels/fp8_table.py)")
        RESULTS["layouts_loaded"] = 0
        return
    choices = json.loads(LAYOUTS_FILE.read_text())["choices"]
    config_cls = fp8_linear._kernels().Fp8GemmConfig
    for key, fields in choices.items():
        n, k, rows = map(int, key.split(","))
        fp8_linear._CHOICES[(n, k, rows, False, gpu, "group")] = None if fields is None else config_cls(*fields)
    RESULTS["layouts_loaded"] = len(choices)
    log(f"loaded {len(choices)} measured FP8 layout choices from {LAYOUTS_FILE}")


# ------------------------------------------------------------------------------------------------ (5) GEMMs


def gemm_timings(smoke: bool, dev, rows_list: tuple[int, ...]) -> dict:
    """Per 8B linear (and the LM head) and row count: bf16 cuBLAS (F.linear), the FP8 GEMM as the engines ran it
    before split-K (the checked-in table's layout, else the default one), the best split-K layout, the best other
    Triton layout (256 rows), and quantize + _scaled_mm; microseconds (CUDA graph, weights read from HBM) and the
    weight bytes streamed per second. Also checks each split-K layout against the reference (measure() drops a
    layout off by more than 1e-2)."""
    import torch
    from prefixrt.kernels import fp8_gemm as G
    from prefixrt.kernels import gemv
    from prefixrt.kernels.fp8_table import MEASURED

    if dev.type != "cuda":
        return {"skipped": "no CUDA: timings are measured on the GPU only"}
    gpu = torch.cuda.get_device_name(dev)
    out, rows_out = {}, []
    for name, (n, k) in {**SHAPES, "lm_head": LM_HEAD}.items():
        for m in rows_list:
            if over_budget(f"GEMM timings {name} {m} rows and after"):
                return out
            old = MEASURED.get(gpu, {}).get((n, k, m), G.Fp8GemmConfig(quantize_input=False))
            cands = G.candidate_configs(n, k, m)
            split = [c for c in cands if c.split_k > 1]
            other = [c for c in cands if c.split_k == 1 and c != old] if m > 64 else []
            t8 = G.measure(n, k, m, dev, [old, *split, *other])  # activation scales per group (the default)
            t8[None] = G.measure(n, k, m, dev, [None], activation_scale="token").get(None)  # cuBLAS: per token
            t16 = gemv.measure(n, k, m, torch.bfloat16, dev, [None]).get(None)
            best_split = min(split, key=lambda c: t8.get(c, math.inf), default=None)
            best_other = min(other, key=lambda c: t8.get(c, math.inf), default=None)
            row = {"bf16_cublas_us": t16, "fp8_before_us": t8.get(old), "fp8_before": str(old),
                   "split_k_us": t8.get(best_split) if best_split else None, "split_k": str(best_split),
                   "triton_other_us": t8.get(best_other) if best_other else None, "triton_other": str(best_other),
                   "scaled_mm_us": t8.get(None), "split_k_dropped": [str(c) for c in split if c not in t8]}
            best = min((v for key, v in row.items() if key.endswith("_us") and key != "bf16_cublas_us" and v),
                       default=math.nan)
            row["fp8_best_tb_s"] = round(n * k / best / 1e6, 2) if best == best else None
            out[f"{name}_{m}"] = row
            fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
            rows_out.append(f"{name:8s} M={m:<4d} bf16 {fmt(t16):>7s}  fp8 before {fmt(row['fp8_before_us']):>7s}  "
                            f"split-K {fmt(row['split_k_us']):>7s} ({row['split_k']})  other "
                            f"{fmt(row['triton_other_us']):>7s}  scaled_mm {fmt(row['scaled_mm_us']):>7s}  "
                            f"best {row['fp8_best_tb_s']} TB/s")
    log("GEMM timings (us):\n" + "\n".join(rows_out))
    for m in rows_list:
        layers = [out.get(f"{name}_{m}", {}) for name in SHAPES]
        total = lambda key, layers=layers: sum(r.get(key) or math.nan for r in layers) * 32  # noqa: E731
        SUMMARY.append((f"GEMM us/step 32 layers M={m}", f"bf16 {total('bf16_cublas_us'):.0f} | fp8 before "
                        f"{total('fp8_before_us'):.0f} | split-K {total('split_k_us'):.0f}",
                        f"scaled_mm {total('scaled_mm_us'):.0f}"))
    return out


# ------------------------------------------------------------------------------------------------- (3) logits


def logits_diff(smoke: bool, dev, model_path) -> dict:
    """bf16 vs FP8 on the same dummy weights (seed 0), 4 prompts of 256 random tokens, torch attention."""
    import torch

    from prefixrt.cache.kv_pool import KVPool
    from prefixrt.hub.loader import load_model
    from prefixrt.model.attention.torch_backend import TorchAttentionBackend
    from prefixrt.model.forward_batch import ForwardBatch
    from prefixrt.model.kv_calibration import calibrate_kv_scales
    from prefixrt.model.quantize import quantize_fp8_weights

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = load_model(model_path, load_format="dummy", dtype=dtype, device=dev)
    n_prompts, length = (4, 256) if not smoke else (2, 24)
    rng = random.Random(3)
    prompts = [[rng.randrange(16, model.vocab_size) for _ in range(length)] for _ in range(n_prompts)]

    def logits(model, kv_scales=None):
        total = n_prompts * length
        pool = KVPool(total + 1, model.num_layers, model.num_kv_heads, model.head_dim,
                      torch.float8_e4m3fn if kv_scales else dtype, dev)
        if kv_scales:
            pool.set_scales(*kv_scales, source="calibrated")
        table = torch.arange(1, total + 1, dtype=torch.int32, device=dev).view(n_prompts, length)
        batch = ForwardBatch.build(req_pool_indices=list(range(n_prompts)), prefix_lens=[0] * n_prompts,
                                   extend_tokens=prompts, out_cache_loc=list(range(1, total + 1)),
                                   req_to_token=table, logits_indices=list(range(total)), device=dev)
        attn = TorchAttentionBackend(pool)
        attn.prepare(batch)
        with torch.inference_mode():
            return model(batch, attn).float()

    base = logits(model)
    scales = calibrate_kv_scales(model, [rng.randrange(16, model.vocab_size) for _ in range(256)], dev)
    runs = {"fp8_kv": logits(model, scales)}
    quantize_fp8_weights(model)
    runs["fp8_weights"] = logits(model)
    runs["fp8_weights_kv"] = logits(model, scales)
    out = {}
    for name, got in runs.items():
        lp, lq = torch.log_softmax(base, -1), torch.log_softmax(got, -1)
        out[name] = {"rel_err": round(rel_err(got, base), 5), "max_abs": round((got - base).abs().max().item(), 4),
                     "top1_agree": round((got.argmax(-1) == base.argmax(-1)).float().mean().item(), 4),
                     "kl": round((lp.exp() * (lp - lq)).sum(-1).mean().item(), 6)}
    SUMMARY.append(("logits vs bf16 (rel err | top-1)", " ; ".join(
        f"{k} {v['rel_err']:.3g} | {v['top1_agree']:.1%}" for k, v in out.items()), "same dummy weights"))
    del model
    gc.collect()
    log(json.dumps(out, indent=1))
    return out


# ------------------------------------------------------------------------------------------------ (4) engines


def engine_runs(smoke: bool, model_name: str, label: str, kw: dict) -> dict:
    import torch

    import prefixrt
    from benchmarks.common import stream_text
    from benchmarks.gpu_engine import decode_step_ms, free
    from prefixrt.bench import workloads as W

    t = time.perf_counter()
    eng = prefixrt.Engine(model_name, load_format="dummy" if not smoke else "auto", **kw)
    out = {"startup_s": round(time.perf_counter() - t, 1), "kv_pool_tokens": eng.kv_total_tokens,
           "kv_dtype": eng.probes.facts()["kv_dtype"]}
    vocab = eng.vocab_size
    log(f"[{label}] engine up in {out['startup_s']}s, KV pool {eng.kv_total_tokens} tokens ({out['kv_dtype']})")
    rng = random.Random(5)
    try:
        eng.generate([[rng.randrange(16, vocab) for _ in range(32)] for _ in range(4)], {"max_new_tokens": 4})
        # batch-1 decode at 4k context
        prompt = [rng.randrange(16, vocab) for _ in range(4096 if not smoke else 64)]
        first, n = None, 0
        for ch in eng.stream(prompt, {"max_new_tokens": 256 if not smoke else 8, "temperature": 0,
                                      "ignore_eos": True}):
            if first is None:
                first = time.perf_counter()
            n += len(ch.token_ids)
        out["b1_tok_s"] = round((n - 1) / (time.perf_counter() - first), 1)
        log(f"[{label}] batch-1 decode at 4k: {out['b1_tok_s']} tok/s")
        if over_budget(f"[{label}] RAG and b256"):
            return out
        # RAG in-process, streamed with text: a first run (cold prefix), then the warm one that counts
        rag = W.rag(vocab) if not smoke else W.rag(vocab, requests=4, shared_len=64, unique_len=8, output_len=4)
        prompts = [s[0].new_tokens for s in rag.sessions]
        eng.flush_cache()
        stream_text(eng, prompts, rag.sessions[0][0].max_new_tokens, 64)
        out["rag"] = stream_text(eng, prompts, rag.sessions[0][0].max_new_tokens, 64)
        log(f"[{label}] RAG: {out['rag']['out_tok_s']} out tok/s")
        if over_budget(f"[{label}] b256"):
            return out
        # decode throughput at batch 256 (1k context): wall time per step, prompts cached first
        eng.flush_cache()
        bs, ctx, steps = (256, 1024, 32) if not smoke else (4, 24, 3)
        dec = [[rng.randrange(16, vocab) for _ in range(ctx)] for _ in range(bs)]
        step_ms = decode_step_ms(eng, dec, steps)
        out["b256_step_ms"] = round(step_ms, 3)
        out["b256_tok_s"] = round(bs / step_ms * 1000, 1)
        log(f"[{label}] decode b{bs}: {out['b256_step_ms']} ms a step, {out['b256_tok_s']} tok/s")
    finally:
        free(eng)
        eng = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def main() -> None:
    global BUDGET_S
    ap = script_parser(__doc__, smoke="the same logic on the CPU: tiny checkpoint and shapes, Triton interpreted")
    ap.add_argument("--only", default="1234", help="sections to run, e.g. 14 (default: all)")
    ap.add_argument("--configs", default="bf16,fp8+kv,fp8", help="engine configurations of section 4, in order")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S, help="start no section past this many seconds")
    ap.add_argument("--layout-rows", default="1,2,4,8,16,32,64", help="row counts section 2 measures")
    ap.add_argument("--gemm-rows", default="1,8,64,256", help="row counts section 5 times")
    args = ap.parse_args()
    BUDGET_S = args.budget_s
    smoke = args.smoke
    if smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported
    import torch

    from prefixrt.hub.registry import resolve_model

    cuda = torch.cuda.is_available() and not smoke
    dev = torch.device("cuda" if cuda else "cpu")
    tmp = tempfile.TemporaryDirectory()
    if smoke:
        from benchmarks.common import tiny_model_dir

        model_name = model_path = str(tiny_model_dir(Path(tmp.name)))
    else:
        model_name, model_path = MODEL, resolve_model(MODEL).path
    RESULTS["device"] = torch.cuda.get_device_name(dev) if cuda else "cpu (smoke)"
    if "1" in args.only:
        section("kernels", lambda: kernel_checks(smoke, dev))
    if "3" in args.only:  # (before the layouts: an acceptance figure; the layouts only help section 4's speed)
        section("logits", lambda: logits_diff(smoke, dev, model_path))
    if "2" in args.only:
        section("layouts", lambda: measure_layouts(smoke, dev, tuple(map(int, args.layout_rows.split(",")))))
    if "5" in args.only:
        section("gemms", lambda: gemm_timings(smoke, dev, tuple(map(int, args.gemm_rows.split(",")))))
    if "4" in args.only:
        base_kw = {} if cuda else dict(device="cpu", attention_backend="torch", kv_cache_tokens=3000)
        token = {"fp8_activation_scale": "token"}
        configs = {"bf16": {}, "fp8": {"quantization": "fp8"},
                   "fp8+kv": {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"},
                   "kv": {"kv_cache_dtype": "fp8_e4m3"}, "fp8t": {"quantization": "fp8", **token},
                   "fp8t+kv": {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3", **token},
                   "fp8n": {"quantization": "fp8", "fp8_activation_scale": "none"},
                   "fp8u": {"quantization": "fp8", "fp8_smoothing": 0, **token}}
        if cuda:
            load_layouts(dev)
        engines = {}
        for label in args.configs.split(","):
            section(f"engine_{label}", lambda label=label: engine_runs(smoke, model_name, label,
                                                                        {**base_kw, **configs[label]}))
            engines[label] = RESULTS.get(f"engine_{label}", {})
        summarize_engines(engines, cuda)
    configs = f"-{args.configs.replace(',', '_').replace('+', '')}" if "4" in args.only else ""
    name = f"gpu_fp8-{args.only}{configs}{'-smoke' if smoke else ''}.json"  # (runs of other configs kept apart)
    tmp.cleanup()
    write_results(RESULTS, name, None if smoke else RESULTS_DIR)  # (a smoke run leaves no results)
    log(f"\nprefixrt FP8, {MODEL if not smoke else 'tiny llama'} dummy on {RESULTS['device']}, "
        f"total {time.perf_counter() - T_START:.0f}s")
    log_table(SUMMARY, 34)


def summarize_engines(engines: dict, cuda: bool) -> None:
    base = engines.get("bf16", {})

    def ratio(a, b):
        return a / b if a and b else math.nan

    for label, r in engines.items():
        if "b1_tok_s" not in r:
            continue
        rag = r.get("rag", {}).get("out_tok_s")
        note = ""
        if label != "bf16" and base.get("b1_tok_s"):
            note = (f"x bf16: b1 {ratio(r['b1_tok_s'], base['b1_tok_s']):.2f}, RAG "
                    f"{ratio(rag, base.get('rag', {}).get('out_tok_s')):.2f}, b256 "
                    f"{ratio(r.get('b256_tok_s'), base.get('b256_tok_s')):.2f}, KV tokens "
                    f"{ratio(r['kv_pool_tokens'], base['kv_pool_tokens']):.2f}")
        SUMMARY.append((f"{label}: b1 4k | RAG | b256 tok/s", f"{r['b1_tok_s']} | {rag} | {r.get('b256_tok_s')}",
                        note))
        SUMMARY.append((f"{label}: KV pool tokens", f"{r['kv_pool_tokens']} ({r['kv_dtype']})", ""))
    if engines.get("fp8", {}).get("kv_pool_tokens") and engines.get("fp8+kv", {}).get("kv_pool_tokens"):
        SUMMARY.append(("KV tokens fp8+kv / fp8 (same weights)",
                        f"{engines['fp8+kv']['kv_pool_tokens'] / engines['fp8']['kv_pool_tokens']:.2f}",
                        "the K/V dtype alone"))
    if cuda and base:
        fp8 = engines.get("fp8", {})
        both = engines.get("fp8+kv", {})
        rag = {label: r.get("rag", {}).get("out_tok_s") for label, r in engines.items()}
        checks = {
            f"b1 FP8 weights >= {TARGETS['b1']}x bf16": ratio(fp8.get("b1_tok_s"), base.get("b1_tok_s")) >= TARGETS["b1"],
            f"RAG FP8 w+kv >= {TARGETS['rag']}x bf16": ratio(rag.get("fp8+kv"), rag.get("bf16")) >= TARGETS["rag"],
            f"b256 FP8 w+kv >= {TARGETS['b256']}x bf16":
                ratio(both.get("b256_tok_s"), base.get("b256_tok_s")) >= TARGETS["b256"],
            f"start-up FP8 w+kv <= {TARGETS['startup']}x bf16":
                0 < ratio(both.get("startup_s"), base.get("startup_s")) <= TARGETS["startup"],
            "no FP8 configuration slower than bf16": all(
                ratio(r.get(k), base.get(k)) >= 1 for label, r in engines.items() if label != "bf16"
                for k in ("b1_tok_s", "b256_tok_s") if r.get(k)) and all(
                ratio(v, rag["bf16"]) >= 1 for label, v in rag.items() if label != "bf16" and v),
        }
        for what, ok in checks.items():
            SUMMARY.append((what, "met" if ok else "NOT met", ""))
        RESULTS["targets"] = checks


if __name__ == "__main__":
    main()
