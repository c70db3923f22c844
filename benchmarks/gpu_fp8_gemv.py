"""FP8 linears at decode sizes on one GPU, Llama-3-8B shapes, bf16 baseline in the same run:
(1) the device's copy bandwidth (the floor's denominator);
(2) the weight-only FP8 GEMV (kernels/gemv.py with w_scale: e4m3 weights widened in registers, bf16 activations)
    against its torch reference (kernels/fp8_reference.weight_only_linear), per-channel and 128x128-block scales,
    the gated activation fused or not, 1-64 rows;
(4) the w8a8 Triton GEMM (group activation scales) in 64- and 128-row tiles at 256-4096 rows, against bf16 cuBLAS
    and quantize + _scaled_mm;
(5) decode attention at batch 256 x 1k context over bf16 and e4m3 K/V, stage 1 in several launch configurations;
(3) microseconds per linear (CUDA graph, weights cycled past L2): bf16 cuBLAS, the weight-only kernel's best layout
    (kernels/gemv.weight_only_candidates; up to 64 rows also the bf16 GEMV's best of the same layouts), quantize +
    torch._scaled_mm with per-token scales, and for taller inputs (128-4096 rows) the w8a8 Triton GEMM with group
    activation scales.
Prints the lines of kernels/fp8_table.py's weight-only table for this GPU and a short table last; JSON to
benchmarks/results/gpu_fp8_gemv-<gpu>.json (and $OUT when set).

    PYTHONPATH=$PWD python benchmarks/gpu_fp8_gemv.py [--rows 1,2,4,8,16,32,64] [--big-rows 128,256,1024,4096]
    PYTHONPATH=$PWD python benchmarks/gpu_fp8_gemv.py --smoke     # the same logic, tiny shapes, Triton interpreted
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

from benchmarks.common import log, log_table, rel_err, run_section, script_parser, write_results

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
RESULTS: dict = {}
SUMMARY: list[tuple[str, str, str]] = []
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def bandwidth(dev) -> dict:
    """A 4 GiB device-to-device copy: bytes read + written per second (median of 10)."""
    import torch

    a = torch.empty(1 << 31, dtype=torch.int16, device=dev)
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    t = sorted(times[2:])[len(times[2:]) // 2]
    tb_s = 2 * a.numel() * 2 / t / 1e12
    SUMMARY.append(("copy bandwidth", f"{tb_s:.2f} TB/s", "read + write, 4 GiB"))
    return {"copy_tb_s": round(tb_s, 3)}


def correctness(smoke: bool, dev) -> dict:
    """Weight-only GEMV against its reference: worst relative error per scale kind and activation."""
    import torch
    from prefixrt.kernels import fp8_reference as R
    from prefixrt.kernels import gemv as G
    from prefixrt.kernels.fused_reference import act_mul

    gen = torch.Generator(device="cpu").manual_seed(0)
    shapes = [(6144, 4096), (4096, 14336), (1000, 4096)] if not smoke else [(96, 256), (130, 192)]
    worst: dict[str, float] = {}
    for n, k in shapes:
        w = (torch.randn(n, k, generator=gen) * k**-0.5).to(dev)
        for block in (False, True):
            w_q, w_s = R.quantize_blocks(w) if block else R.quantize_weight(w)
            for m in (1, 7, 33, 64) if not smoke else (1, 5):
                for act in (None, "silu"):
                    x = (torch.randn(m, 2 * k if act else k, generator=gen) * 2).to(dev, torch.bfloat16)
                    want = R.weight_only_linear(act_mul(x, act) if act else x, w_q, w_s)
                    for cfg in (G.GemvConfig(32, 128), G.GemvConfig(64, 128, 4), G.GemvConfig(16, 256)):
                        if block and 128 % cfg.block_k:
                            continue
                        got = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)
                        got.copy_(G.gemv(x, w_q, None, cfg, act, w_scale=w_s))
                        key = f"{'block' if block else 'channel'}{'_' + act if act else ''}"
                        worst[key] = max(worst.get(key, 0.0), rel_err(got, want))
    ok = max(worst.values()) < 1e-2
    SUMMARY.append(("weight-only GEMV vs reference", "ok" if ok else "MISMATCH",
                    f"worst {max(worst.values()):.1e} (1e-2)"))
    return {"worst_rel_err": worst, "ok": ok}


def _call(fn, *args, **kw):
    """fn(...) for weight copy i: the list arguments (positional or keyword) indexed by i."""
    def pick(a, i):
        return a[i] if isinstance(a, list) else a

    return lambda i: fn(*[pick(a, i) for a in args], **{k: pick(v, i) for k, v in kw.items()})


def _best(timings: dict) -> tuple[float, object]:
    if not timings:
        return math.inf, None
    best = min(timings, key=timings.get)
    return timings[best], best


def shape_timings(name: str, n: int, k: int, act: str | None, dev, rows_all: tuple[int, ...],
                  bf16_gemv: bool) -> dict:
    """One linear shape at every row count: the variants of the module docstring (us per call)."""
    import torch
    import torch.nn.functional as F
    from prefixrt.kernels import fp8_gemm as FG
    from prefixrt.kernels import fp8_reference as R
    from prefixrt.kernels import gemv as G
    from prefixrt.kernels.fused_reference import act_mul

    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    copies = max(4, min(16, -(-256 * 2**20 // (n * k))))
    w16 = [(torch.randn(n, k, device=dev) * k**-0.5).to(torch.bfloat16) for _ in range(copies)]
    w8 = [R.quantize_weight(w.float()) for w in w16]
    w8q, w8s = [w[0] for w in w8], [w[1] for w in w8]
    out = {}
    for m in rows_all:
        x = torch.randn(m, 2 * k if act else k, device=dev, dtype=torch.bfloat16)
        xa = F.silu(x[:, :k]) * x[:, k:] if act else x
        row: dict = {"bf16_cublas": G.graph_time_us(_call(F.linear, xa, w16), copies)}
        want = R.weight_only_linear(act_mul(x, act) if act else x, w8q[0], w8s[0]).float()
        wo, w16t = {}, {}
        for cfg in G.weight_only_candidates(n, k, m, num_sms):
            try:
                if rel_err(G.gemv(x, w8q[0], None, cfg, act, w_scale=w8s[0]), want) > (2e-2 if act else 1e-2):
                    log(f"  {name} m={m} {cfg}: WRONG")
                    continue
                wo[cfg] = G.graph_time_us(_call(G.gemv, x, w8q, None, cfg, act, w_scale=w8s), copies)
                if bf16_gemv and m <= G.MAX_M and not cfg.swap_ab:
                    w16t[cfg] = G.graph_time_us(_call(G.gemv, x, w16, None, cfg, act), copies)
            except Exception as e:  # a layout this GPU cannot run (shared memory): not a candidate
                log(f"  {name} m={m} {cfg}: {type(e).__name__}: {str(e)[:80]}")
        row["weight_only"], cfg = _best(wo)
        row["weight_only_cfg"] = str(cfg)
        row["weight_only_all"] = {str(c): round(t, 2) for c, t in wo.items()}
        row["bf16_gemv"], cfg16 = _best(w16t)
        row["bf16_gemv_cfg"] = str(cfg16)
        row["weight_only_tb_s"] = round(n * k / row["weight_only"] / 1e6, 2)
        row["config"] = cfg
        if not act:
            if FG.scaled_mm_supported(dev):
                row["scaled_mm_token"] = G.graph_time_us(_call(FG.run_config, x, w8q, w8s, None, None, "token"),
                                                         copies)
            if m > G.MAX_M:
                g = {c: G.graph_time_us(_call(FG.run_config, x, w8q, w8s, None, c, "group"), copies)
                     for c in (FG.Fp8GemmConfig(64, 128, 4, 3, False), FG.Fp8GemmConfig(128, 128, 8, 3, False))}
                row["w8a8_group"], _ = _best(g)
        out[m] = row
        fmt = lambda v: "-" if v is None or v == math.inf else f"{v:.1f}"  # noqa: E731
        log(f"{name:9s} M={m:<5d} bf16 {fmt(row['bf16_cublas']):>7s} gemv16 {fmt(row.get('bf16_gemv')):>7s}  "
            f"wo-fp8 {fmt(row['weight_only']):>7s} ({row['weight_only_cfg']})  w8a8-group "
            f"{fmt(row.get('w8a8_group')):>7s}  scaled_mm {fmt(row.get('scaled_mm_token')):>7s}")
    return out


def timings(dev, rows_list: tuple[int, ...], big_rows: tuple[int, ...], extra: bool) -> dict:
    import torch

    shapes = dict(SHAPES)
    rows_all = (*rows_list, *big_rows)
    per_shape = {name: shape_timings(name, n, k, None, dev, rows_all, extra) for name, (n, k) in shapes.items()}
    if extra:
        per_shape["down+silu"] = shape_timings("down+silu", *shapes["down"], "silu", dev, rows_list, extra)
    gpu = torch.cuda.get_device_name(dev)
    table_lines = []
    for name, (n, k) in shapes.items():
        for m, row in per_shape[name].items():
            c = row.pop("config")
            if c is not None:
                table_lines.append(f"        ({n}, {k}, {m}): GemvConfig({c.block_n}, {c.block_k}, {c.split_k}, "
                                   f"{c.num_warps}, {c.num_stages}, {c.block_m}, {c.swap_ab}),  # {name}: bf16 cuBLAS "
                                   f"{row['bf16_cublas']:.2f} us, weight-only {row['weight_only']:.2f} us")
    for row in per_shape.get("down+silu", {}).values():
        row.pop("config")
    log(f"kernels/fp8_table.py entries for {gpu!r}:\n" + "\n".join(table_lines))
    for m in rows_all:
        rows = [per_shape[s][m] for s in shapes]
        tot = lambda key, rows=rows: sum(r.get(key) or math.nan for r in rows) * 32  # noqa: E731
        SUMMARY.append((f"GEMM us/step 32 layers M={m}", f"bf16 {tot('bf16_cublas'):.0f} | wo-fp8 "
                        f"{tot('weight_only'):.0f}", f"scaled_mm {tot('scaled_mm_token'):.0f}, w8a8 group "
                        f"{tot('w8a8_group'):.0f}"))
    return {"shapes": {name: {str(m): r for m, r in rows.items()} for name, rows in per_shape.items()},
            "table_lines": table_lines}


def tall_w8a8(dev, rows_list: tuple[int, ...]) -> dict:
    """The w8a8 Triton GEMM with group activation scales in 64- and 128-row tiles (x quantized in a launch before),
    against bf16 cuBLAS and quantize + _scaled_mm (per-token scales), for inputs of rows_list rows (us)."""
    import torch
    import torch.nn.functional as F
    from prefixrt.kernels import fp8_gemm as FG
    from prefixrt.kernels import fp8_reference as R
    from prefixrt.kernels import gemv as G

    configs = [FG.Fp8GemmConfig(bn, bk, w, p, False, 1, bm) for bm, bn, bk, w, p in (
        (64, 128, 128, 4, 3), (128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 256, 128, 8, 3),
        (64, 256, 128, 8, 3), (128, 128, 64, 8, 4), (128, 64, 128, 4, 4))]
    out = {}
    for name, (n, k) in SHAPES.items():
        copies = max(4, min(16, -(-256 * 2**20 // (n * k))))
        w16 = [(torch.randn(n, k, device=dev) * k**-0.5).to(torch.bfloat16) for _ in range(copies)]
        w8q, w8s = map(list, zip(*[R.quantize_weight(w.float()) for w in w16]))
        for m in rows_list:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            want = R.fp8_linear(x, w8q[0], w8s[0], None, "group").float()
            row = {"bf16_cublas": G.graph_time_us(_call(F.linear, x, w16), copies),
                   "scaled_mm_token": G.graph_time_us(_call(FG.run_config, x, w8q, w8s, None, None, "token"), copies)}
            times = {}
            for cfg in configs:
                try:
                    if rel_err(FG.run_config(x, w8q[0], w8s[0], None, cfg, "group"), want) > 1e-2:
                        log(f"  {name} m={m} {cfg}: WRONG")
                        continue
                    times[cfg] = G.graph_time_us(_call(FG.run_config, x, w8q, w8s, None, cfg, "group"), copies)
                except Exception as e:
                    log(f"  {name} m={m} {cfg}: {type(e).__name__}: {str(e)[:80]}")
            row["group_best"], cfg = _best(times)
            row["group_best_cfg"] = str(cfg)
            row["group_all"] = {str(c): round(t, 2) for c, t in times.items()}
            out[f"{name}_{m}"] = row
            log(f"{name:8s} M={m:<5d} bf16 {row['bf16_cublas']:7.1f}  scaled_mm {row['scaled_mm_token']:7.1f}  "
                f"group best {row['group_best']:7.1f} ({cfg})")
    for m in rows_list:
        rows = [out[f"{s}_{m}"] for s in SHAPES]
        tot = lambda key, rows=rows: sum(r[key] for r in rows) * 32  # noqa: E731
        SUMMARY.append((f"w8a8 us/step M={m}", f"bf16 {tot('bf16_cublas'):.0f} | group {tot('group_best'):.0f}",
                        f"scaled_mm {tot('scaled_mm_token'):.0f}"))
    return out


def decode_attention_kv(dev) -> dict:
    """Decode attention at batch 256 x 1024 context (Llama-3-8B heads): bf16 against e4m3 K/V, stage 1 in several
    launch configurations (GB/s of K/V read)."""
    import torch
    from prefixrt.kernels import fp8_reference as R
    from prefixrt.kernels import gemv as G
    from prefixrt.kernels.decode_attention import decode_workspace, launch_decode_stage1

    b, ctx, h, kvh, d = 256, 1024, 32, 8, 128
    slots = b * ctx + 1
    k = torch.randn(slots, kvh, d, device=dev)
    v = torch.randn(slots, kvh, d, device=dev)
    ks, vs = k.abs().amax(dim=(0, 2)) / 448, v.abs().amax(dim=(0, 2)) / 448
    pools = {"bf16": (k.to(torch.bfloat16), v.to(torch.bfloat16), {}),
             "fp8": (R.quantize_kv(k, ks), R.quantize_kv(v, vs), {"k_scale": ks, "v_scale": vs})}
    del k, v
    table = (torch.randperm(slots - 1, device=dev) + 1).int().view(b, ctx)
    q = torch.randn(b, h, d, device=dev, dtype=torch.bfloat16)
    seq = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    rows = torch.arange(b, device=dev)
    mid_o, mid_lse = decode_workspace(b, h, d, 1, dev)
    out = {}
    for kind, (kb, vb, sc) in pools.items():
        nbytes = 2 * b * ctx * kvh * d * kb.element_size()
        for bn, w, st in ((64, 4, 3), (128, 4, 3), (128, 8, 3), (64, 4, 4), (128, 4, 2), (256, 8, 2)):
            cfg = {"BLOCK_N": bn, "num_warps": w, "num_stages": st}
            try:
                t = G.graph_time_us(lambda i, cfg=cfg, kb=kb, vb=vb, sc=sc: launch_decode_stage1(
                    q, kb, vb, table, rows, seq, mid_o, mid_lse, d**-0.5, None, None, 1, config=cfg, **sc), 4)
            except Exception as e:
                log(f"  decode {kind} {cfg}: {type(e).__name__}: {str(e)[:80]}")
                continue
            out[f"{kind}_n{bn}w{w}p{st}"] = {"us": round(t, 1), "gb_s": round(nbytes / t / 1e3, 0)}
            log(f"decode {kind} n{bn}w{w}p{st}: {t:.1f} us, {nbytes / t / 1e3:.0f} GB/s")
    for kind in pools:
        best = min((v for key, v in out.items() if key.startswith(kind)), key=lambda v: v["us"])
        SUMMARY.append((f"decode b256 x 1k {kind} K/V", f"{best['us']} us", f"{best['gb_s']} GB/s"))
    return out


def main() -> None:
    ap = script_parser(__doc__, smoke="tiny shapes on the CPU, Triton interpreted")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--big-rows", default="128,256,1024,4096")
    ap.add_argument("--only", default="123")
    ap.add_argument("--extra", action="store_true", help="also the bf16 GEMV's layouts and the fused down+silu")
    args = ap.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    t0 = time.perf_counter()
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    RESULTS["device"] = gpu
    if "1" in args.only and dev.type == "cuda":
        run_section(RESULTS, SUMMARY, "bandwidth", lambda: bandwidth(dev))
    if "2" in args.only:
        run_section(RESULTS, SUMMARY, "correctness", lambda: correctness(args.smoke, dev))
    if "3" in args.only and dev.type == "cuda":
        rows = tuple(map(int, args.rows.split(",")))
        big = tuple(map(int, args.big_rows.split(","))) if args.big_rows else ()
        run_section(RESULTS, SUMMARY, "timings", lambda: timings(dev, rows, big, args.extra))
    if "4" in args.only and dev.type == "cuda":
        run_section(RESULTS, SUMMARY, "tall_w8a8", lambda: tall_w8a8(dev, (256, 1024, 4096)))
    if "5" in args.only and dev.type == "cuda":
        run_section(RESULTS, SUMMARY, "decode_attention", lambda: decode_attention_kv(dev))
    name = f"gpu_fp8_gemv-{args.only}-{gpu.replace(' ', '_')}.json"
    write_results(RESULTS, name, None if args.smoke else RESULTS_DIR)
    log(f"\nFP8 GEMV on {gpu}, total {time.perf_counter() - t0:.0f}s")
    log_table(SUMMARY, 40)


if __name__ == "__main__":
    main()
