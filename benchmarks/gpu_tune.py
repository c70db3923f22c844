"""Launch-configuration sweeps on one CUDA GPU (e.g. an H200), each variant checked before it is timed.

(gemm)    skinny GEMMs at 32 and 64 rows (decode at batch 32-64) on the Llama-3-8B shapes: cuBLAS against the
          Triton GEMV/skinny-GEMM layouts (kernels/gemv.py), graph-timed with weights cycled past L2; prints
          the kernels/gemv_table.py entries;
(cascade) shared-prefix decode on the RAG shape (64 sequences x (3500 shared + 80..280 own), 32/8 heads x
          128, bf16), stage by stage (prefix kernel, suffix stage, merge) over several launch configs, with
          four layers' K/V buffers so the working set does not sit in L2. Every variant's full result is
          compared with plain decode attention before its stage is timed.

(decode)  plain decode's stage-1 launch configurations; (merge) the split merge's launch variants.

    PYTHONPATH=$PWD python benchmarks/gpu_tune.py [--only=gemm,cascade,decode,merge]
    PYTHONPATH=$PWD TRITON_INTERPRET=1 python benchmarks/gpu_tune.py --smoke   # CPU dry run, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch
import triton
from prefixrt.kernels import decode_attention as dec
from prefixrt.kernels._common import dot_args, qk_scale
from prefixrt.kernels.cascade_decode import _cascade_prefix_kernel, _prefix_config, cascade_decode_attention
from prefixrt.kernels.cascade_plan import plan_cascade
from prefixrt.kernels.gemv import GemvConfig, candidate_configs, measure

from benchmarks.common import rel_err, script_parser
from prefixrt.model.attention.triton_backend import plan_decode_splits

SECTIONS = ("gemm", "cascade", "decode", "merge")


def parse_args() -> argparse.Namespace:
    ap = script_parser(__doc__, smoke="a CPU dry run of the script's logic under TRITON_INTERPRET=1, tiny shapes")
    ap.add_argument("--only", default=",".join(SECTIONS), help="sections, comma-separated: " + ",".join(SECTIONS))
    return ap.parse_args()


# Parsed before anything asks for the GPU (so --help works on a machine without one); the shapes follow --smoke.
ARGS = parse_args()
SMOKE = ARGS.smoke
DEV = "cpu" if SMOKE else "cuda"
NUM_SMS = 132 if SMOKE else torch.cuda.get_device_properties(0).multi_processor_count
RESULTS: dict = {"gemm": [], "cascade": []}
TABLE: list[tuple[str, str, str]] = []


def graph_us(fn, reps: int = 20) -> float:
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    return triton.testing.do_bench_cudagraph(fn, rep=reps) * 1000


# ------------------------------------------------------------------------------------------------ gemm

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}


def bench_gemm() -> None:
    for rows in (32, 64):
        for name, (n, k) in SHAPES.items():
            configs = [None, *candidate_configs(n, k, NUM_SMS)]
            configs += [GemvConfig(64, 128, 1, 8, 4), GemvConfig(128, 64, 1, 8, 3), GemvConfig(128, 128, 1, 8, 3)]
            configs = list(dict.fromkeys(configs))
            t = measure(n, k, rows, torch.bfloat16, DEV, configs)
            cublas = t.get(None)
            tri = {c: v for c, v in t.items() if c is not None}
            best = min(tri, key=tri.get) if tri else None
            gb = n * k * 2 / 1e9
            row = {"rows": rows, "shape": name, "n": n, "k": k, "cublas_us": cublas,
                   "best": str(best), "best_us": tri.get(best), "cublas_GBps": gb / (cublas / 1e6) if cublas else None,
                   "best_GBps": gb / (tri[best] / 1e6) if best else None,
                   "all": {str(c): v for c, v in t.items()}}
            RESULTS["gemm"].append(row)
            choice = best if best is not None and tri[best] < 0.98 * cublas else None
            print(f"  gemm M={rows} {name}: cuBLAS {cublas:.1f} us ({row['cublas_GBps']:.0f} GB/s), best Triton "
                  f"{best} {tri.get(best, float('nan')):.1f} us -> {choice or 'cuBLAS'}", flush=True)
            TABLE.append((f"gemm M={rows} {name}", f"cuBLAS {cublas:.1f} us / {best} {tri.get(best, 0):.1f} us",
                          f"{row['cublas_GBps']:.0f} / {row['best_GBps'] or 0:.0f} GB/s"))
            cfg = (f"GemvConfig({choice.block_n}, {choice.block_k}, {choice.split_k}, {choice.num_warps}, "
                   f"{choice.num_stages})" if choice else "None")
            print(f"        ({n}, {k}, {rows}, None): {cfg},  # {name}: cuBLAS {cublas:.2f} us, best layout "
                  f"{tri.get(best, 0):.2f} us", flush=True)


# --------------------------------------------------------------------------------------------- cascade

LAYERS = 1 if SMOKE else 4
BATCH, PREFIX = (4, 40) if SMOKE else (64, 3500)
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128


class RagShape:
    def __init__(self):
        rng = random.Random(1)
        own = [rng.randint(8, 28) if SMOKE else rng.randint(80, 280) for _ in range(BATCH)]
        self.seq_lens_cpu = [PREFIX + n for n in own]
        slots = PREFIX + sum(own) + 1
        gen = torch.Generator(device=DEV).manual_seed(0)
        self.k = [torch.randn(slots, NUM_KV_HEADS, HEAD_DIM, device=DEV, dtype=torch.bfloat16, generator=gen)
                  for _ in range(LAYERS)]
        self.v = [torch.randn_like(k) for k in self.k]
        perm = (torch.randperm(slots - 1, device=DEV, generator=gen) + 1).to(torch.int32)
        self.req_to_token = torch.zeros(BATCH + 1, max(self.seq_lens_cpu), dtype=torch.int32, device=DEV)
        used = PREFIX
        for s, n in enumerate(self.seq_lens_cpu):
            self.req_to_token[s + 1, :PREFIX] = perm[:PREFIX]
            self.req_to_token[s + 1, PREFIX:n] = perm[used : used + n - PREFIX]
            used += n - PREFIX
        self.rows = torch.arange(1, BATCH + 1, device=DEV)
        self.seq_lens = torch.tensor(self.seq_lens_cpu, dtype=torch.int32, device=DEV)
        self.q = [torch.randn(BATCH, NUM_HEADS, HEAD_DIM, device=DEV, dtype=torch.bfloat16) for _ in range(LAYERS)]
        self.scale = HEAD_DIM**-0.5
        self.mid_o, self.mid_lse = dec.decode_workspace(BATCH, NUM_HEADS, HEAD_DIM, 64, DEV)
        self.plain = []
        for i in range(LAYERS):
            o = torch.empty_like(self.q[i])
            dec.decode_attention(self.q[i], o, self.k[i], self.v[i], self.req_to_token, self.rows, self.seq_lens,
                                 self.scale, num_kv_splits=8)
            self.plain.append(o)

    def prefix(self, i, plan, sp, cfg):
        grid = (plan.num_tiles, NUM_KV_HEADS * cfg["HEAD_BLOCKS"], sp)
        mo, ml = self.mid_o, self.mid_lse
        _cascade_prefix_kernel[grid](
            self.q[i], self.k[i], self.v[i], self.req_to_token, self.rows, plan.group_prefix_lens,
            plan.group_lead_seq, plan.group_seq_ids, plan.tile_group, plan.tile_seq_start, plan.tile_num_seqs,
            mo, ml, ml, ml, qk_scale(self.scale, None), 0.0,  # (KScale, VScale: unread with a bf16 pool)
            self.q[i].stride(0), self.q[i].stride(1), self.k[i].stride(0), self.k[i].stride(1),
            self.v[i].stride(0), self.v[i].stride(1), self.req_to_token.stride(0),
            mo.stride(0), mo.stride(1), mo.stride(2), ml.stride(0), ml.stride(1),
            HEADS_PER_KV=NUM_HEADS // NUM_KV_HEADS, HEAD_DIM=HEAD_DIM, BLOCK_D=HEAD_DIM, NUM_SPLITS=sp,
            HAS_SOFTCAP=False, **dot_args(torch.bfloat16), **cfg,
        )  # fmt: skip

    def suffix(self, i, plan, sp, ss, cfg):
        mo, ml = self.mid_o, self.mid_lse
        dec._decode_stage1[(BATCH, NUM_KV_HEADS, ss)](
            self.q[i], self.k[i], self.v[i], self.req_to_token, self.rows, self.seq_lens, plan.suffix_start,
            mo, ml, ml, ml, qk_scale(self.scale, None), 0.0, 0,  # (KScale, VScale: unread with a bf16 pool)
            self.q[i].stride(0), self.q[i].stride(1), self.k[i].stride(0), self.k[i].stride(1),
            self.v[i].stride(0), self.v[i].stride(1), self.req_to_token.stride(0),
            mo.stride(0), mo.stride(1), mo.stride(2), ml.stride(0), ml.stride(1), sp,
            HEADS_PER_KV=NUM_HEADS // NUM_KV_HEADS, HEAD_DIM=HEAD_DIM, BLOCK_D=HEAD_DIM, NUM_SPLITS=ss,
            HAS_KV_START=True, HAS_WINDOW=False, HAS_SOFTCAP=False, **dot_args(torch.bfloat16), **cfg,
        )  # fmt: skip

    def merge(self, o, plan, sp, ss):
        dec.launch_merge(o, self.mid_o, self.mid_lse, sp + ss, kv_start=plan.suffix_start, num_guarded=sp)


def bench_cascade() -> None:
    r = RagShape()
    heads_per_kv = NUM_HEADS // NUM_KV_HEADS
    tok_bytes = NUM_KV_HEADS * HEAD_DIM * 2 * 2
    unique_bytes = sum(n - PREFIX for n in r.seq_lens_cpu) * tok_bytes
    plans = {t: plan_cascade([(PREFIX, list(range(BATCH)))], r.seq_lens_cpu, DEV, queries_per_tile=t)
             for t in ((16,) if SMOKE else (16, 32, 64))}

    def plain_run():
        for i in range(LAYERS):
            o = torch.empty_like(r.q[i])
            dec.decode_attention(r.q[i], o, r.k[i], r.v[i], r.req_to_token, r.rows, r.seq_lens, r.scale,
                                 num_kv_splits=plan_decode_splits(BATCH * NUM_KV_HEADS, max(r.seq_lens_cpu),
                                                                  NUM_SMS, 16),
                                 mid_o=r.mid_o, mid_lse=r.mid_lse)

    us_plain = graph_us(plain_run) / LAYERS
    RESULTS["cascade"].append({"variant": "plain decode", "us_per_layer": us_plain})
    TABLE.append(("cascade: plain decode (per layer)", f"{us_plain:.1f} us",
                  f"{(sum(r.seq_lens_cpu) * tok_bytes) / us_plain / 1e3:.0f} GB/s over all K/V"))

    default_suffix = {"BLOCK_H": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}

    def check(plan, sp, pcfg, ss, scfg) -> float:
        worst = 0.0
        for i in range(LAYERS):
            o = torch.empty_like(r.q[i])
            r.prefix(i, plan, sp, pcfg)
            r.suffix(i, plan, sp, ss, scfg)
            r.merge(o, plan, sp, ss)
            worst = max(worst, rel_err(o, r.plain[i]))
        return worst

    # (1) prefix stage
    prefix_rows = []
    for tile, plan in plans.items():
        base = _prefix_config(HEAD_DIM, heads_per_kv, tile)
        sp_default = plan_decode_splits(plan.num_tiles * NUM_KV_HEADS, PREFIX, NUM_SMS, 16)
        for sp in sorted({sp_default, 16, 32})[: 1 if SMOKE else None]:
            for bn, w, st in ((base["BLOCK_N"], base["num_warps"], base.get("num_stages", 2)), (64, 4, 3), (64, 8, 3),
                              (32, 4, 3)):
                cfg = {**base, "BLOCK_N": bn, "num_warps": w, "num_stages": st}
                name = f"prefix tile={tile} Sp={sp} N{bn} w{w} s{st}"
                try:
                    err = check(plan, sp, cfg, 1, default_suffix)
                    if err > 1e-2:
                        print(f"  FAIL {name}: rel err {err:.2e}", flush=True)
                        continue
                    us = graph_us(lambda p=plan, s=sp, c=cfg: [r.prefix(i, p, s, c) for i in range(LAYERS)]) / LAYERS
                except Exception as e:  # a config this GPU cannot compile (shared memory): not a candidate
                    print(f"  skip {name}: {type(e).__name__} {str(e)[:80]}", flush=True)
                    continue
                row = {"variant": name, "tile": tile, "sp": sp, "cfg": cfg, "us_per_layer": us, "rel_err": err,
                       "default": sp == sp_default and (bn, w, st) == (base["BLOCK_N"], base["num_warps"],
                                                                       base.get("num_stages", 2))}
                prefix_rows.append(row)
                RESULTS["cascade"].append(row)
                print(f"  {name}: {us:.1f} us/layer, err {err:.1e}{' (default)' if row['default'] else ''}", flush=True)

    # (2) suffix stage (own slots of each sequence)
    suffix_rows = []
    plan16 = plans[16]
    p16 = _prefix_config(HEAD_DIM, heads_per_kv, 16)
    ss_default = plan_decode_splits(BATCH * NUM_KV_HEADS, plan16.max_suffix_len, NUM_SMS, 16)
    for ss in sorted({ss_default, 1, 2})[: 1 if SMOKE else None]:
        for bh, bn, w, st in ((16, 64, 4, 2), (16, 32, 4, 2), (16, 64, 4, 3), (16, 32, 2, 3), (16, 32, 4, 4))[: 1 if SMOKE else None]:
            cfg = {"BLOCK_H": bh, "BLOCK_N": bn, "num_warps": w, "num_stages": st}
            name = f"suffix Ss={ss} H{bh} N{bn} w{w} s{st}"
            try:
                err = check(plan16, 8, {**p16}, ss, cfg)
                if err > 1e-2:
                    print(f"  FAIL {name}: rel err {err:.2e}", flush=True)
                    continue
                us = graph_us(lambda s=ss, c=cfg: [r.suffix(i, plan16, 8, s, c) for i in range(LAYERS)]) / LAYERS
            except Exception as e:
                print(f"  skip {name}: {type(e).__name__} {str(e)[:80]}", flush=True)
                continue
            row = {"variant": name, "ss": ss, "cfg": cfg, "us_per_layer": us, "rel_err": err,
                   "GBps": unique_bytes / us / 1e3,
                   "default": ss == ss_default and (bn, w, st) == (64, 4, 2)}
            suffix_rows.append(row)
            RESULTS["cascade"].append(row)
            print(f"  {name}: {us:.1f} us/layer ({row['GBps']:.0f} GB/s), err {err:.1e}", flush=True)

    # (3) merge, at a few split totals
    for sp, ss in ((8, 1), (16, 1), (32, 1), (8, 4))[: 1 if SMOKE else None]:
        o = torch.empty_like(r.q[0])
        us = graph_us(lambda sp=sp, ss=ss, o=o: [r.merge(o, plan16, sp, ss) for _ in range(LAYERS)]) / LAYERS
        RESULTS["cascade"].append({"variant": f"merge S={sp}+{ss}", "us_per_layer": us})
        TABLE.append((f"cascade merge S={sp}+{ss}", f"{us:.1f} us/layer", ""))

    for label, rows in (("prefix", prefix_rows), ("suffix", suffix_rows)):
        if not rows:
            continue
        d = next((x for x in rows if x["default"]), None)
        b = min(rows, key=lambda x: x["us_per_layer"])
        TABLE.append((f"cascade {label}: default", d["variant"] if d else "-", f"{d['us_per_layer']:.1f} us" if d else ""))
        TABLE.append((f"cascade {label}: best", b["variant"], f"{b['us_per_layer']:.1f} us"))

    # (4) the whole cascade through cascade_decode_attention: the stages one after the other vs concurrently
    # (prefix stage on a side stream), over tile sizes and split counts
    whole = []
    combos = [(16, 9, 1, False), (16, 9, 1, True), (16, 9, 2, True), (16, 4, 1, True), (16, 4, 2, True),
              (16, 2, 2, True), (8, 4, 1, True), (8, 4, 2, True), (8, 9, 1, True), (32, 4, 2, True),
              (32, 9, 1, True), (64, 9, 2, True), (64, 16, 2, True), (16, 16, 1, True)]
    for tile, sp, ss, conc in combos[: 2 if SMOKE else None]:
        if tile not in plans:
            plans[tile] = plan_cascade([(PREFIX, list(range(BATCH)))], r.seq_lens_cpu, DEV, queries_per_tile=tile)
        plan = plans[tile]
        outs = [torch.empty_like(q) for q in r.q]

        def run(plan=plan, sp=sp, ss=ss, conc=conc, outs=outs):
            for i in range(LAYERS):
                cascade_decode_attention(r.q[i], outs[i], r.k[i], r.v[i], r.req_to_token, r.rows, r.seq_lens,
                                         r.scale, plan, num_prefix_splits=sp, num_suffix_splits=ss,
                                         mid_o=r.mid_o, mid_lse=r.mid_lse, concurrent_stages=conc)

        run()
        err = max(rel_err(outs[i], r.plain[i]) for i in range(LAYERS))
        name = f"whole tile={tile} Sp={sp} Ss={ss} {'concurrent' if conc else 'sequential'}"
        if err > 1e-2:
            print(f"  FAIL {name}: rel err {err:.2e}", flush=True)
            continue
        us = graph_us(run) / LAYERS
        whole.append((us, name))
        RESULTS["cascade"].append({"variant": name, "us_per_layer": us, "rel_err": err})
        print(f"  {name}: {us:.1f} us/layer, err {err:.1e}", flush=True)
    for us, name in sorted(whole)[:4] + [w for w in whole if "tile=16 Sp=9 Ss=1" in w[1]]:
        TABLE.append((f"cascade {name}", f"{us:.1f} us/layer", f"{us_plain / us:.2f}x plain decode"))


def bench_decode_configs() -> None:
    """Plain decode stage 1 launch configs (the stage-1 kernel also runs cascade's suffix stage)."""
    for batch, ctx in ((1, 4096), (64, 2048), (256, 1100)):
        slots = batch * ctx + 1
        k = torch.randn(slots, NUM_KV_HEADS, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        perm = (torch.randperm(slots - 1, device=DEV) + 1).to(torch.int32)
        rtt = perm.view(batch, ctx)
        rows = torch.arange(batch, device=DEV)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
        q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
        splits = plan_decode_splits(batch * NUM_KV_HEADS, ctx, NUM_SMS, 16)
        mo, ml = dec.decode_workspace(batch, NUM_HEADS, HEAD_DIM, splits, DEV)
        expected = torch.empty_like(q)
        dec.decode_attention(q, expected, k, v, rtt, rows, lens, HEAD_DIM**-0.5, num_kv_splits=splits)
        gb = batch * ctx * NUM_KV_HEADS * HEAD_DIM * 4 / 1e9
        for bn, w, st in ((64, 4, 2), (64, 4, 3), (64, 4, 4), (32, 4, 3), (128, 4, 2), (64, 8, 3)):
            cfg = {"BLOCK_N": bn, "num_warps": w, "num_stages": st}
            o = torch.empty_like(q)

            def run(cfg=cfg, o=o, a=(q, k, v, rtt, rows, lens, mo, ml), splits=splits):
                dec.launch_decode_stage1(*a, HEAD_DIM**-0.5, None, None, splits, config=cfg)
                dec.launch_merge(o, a[6], a[7], splits)

            run()
            err = rel_err(o, expected)
            if err > 1e-2:
                print(f"  FAIL decode B={batch} {cfg}: {err:.2e}", flush=True)
                continue
            us = graph_us(run)
            RESULTS.setdefault("decode", []).append({"batch": batch, "ctx": ctx, "cfg": cfg, "us": us, "GBps": gb / us * 1e6})
            print(f"  decode B={batch} ctx={ctx} S={splits} N{bn} w{w} s{st}: {us:.1f} us, {gb / us * 1e6:.0f} GB/s",
                  flush=True)
            TABLE.append((f"decode B={batch} ctx={ctx} N{bn} w{w} s{st}", f"{us:.1f} us", f"{gb / us * 1e6:.0f} GB/s"))


def bench_merge() -> None:
    """The merge's launch (heads per program, warps), alone at the engine's split counts and inside the whole
    cascade (RAG shape, tile 16)."""
    r = RagShape()
    plan = plan_cascade([(PREFIX, list(range(BATCH)))], r.seq_lens_cpu, DEV, queries_per_tile=16)
    variants = [(1, 4), (1, 2), (1, 1), (2, 4), (4, 4), (4, 8), (8, 8)][: 2 if SMOKE else None]
    for sp, ss in ((9, 2), (4, 1)):
        expected = None
        for hm, w in variants:
            o = torch.empty_like(r.q[0])
            r.prefix(0, plan, sp, _prefix_config(HEAD_DIM, NUM_HEADS // NUM_KV_HEADS, 16))
            r.suffix(0, plan, sp, ss, {"BLOCK_H": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3})
            dec.launch_merge(o, r.mid_o, r.mid_lse, sp + ss, kv_start=plan.suffix_start, num_guarded=sp,
                             heads_per_program=hm, num_warps=w)
            err = rel_err(o, r.plain[0])
            us = graph_us(lambda o=o, hm=hm, w=w, sp=sp, ss=ss: [dec.launch_merge(o, r.mid_o, r.mid_lse, sp + ss,
                                                                  kv_start=plan.suffix_start, num_guarded=sp,
                                                                  heads_per_program=hm, num_warps=w)
                                                 for _ in range(LAYERS)]) / LAYERS
            outs = [torch.empty_like(q) for q in r.q]

            def run(outs=outs, sp=sp, ss=ss, hm=hm, w=w):
                launch = {"heads_per_program": hm, "num_warps": w}
                for i in range(LAYERS):
                    cascade_decode_attention(r.q[i], outs[i], r.k[i], r.v[i], r.req_to_token, r.rows, r.seq_lens,
                                             r.scale, plan, num_prefix_splits=sp, num_suffix_splits=ss,
                                             mid_o=r.mid_o, mid_lse=r.mid_lse, merge_launch=launch)

            whole = graph_us(run) / LAYERS
            expected = expected if expected is not None else o.clone()
            name = f"merge S={sp}+{ss} heads/program {hm} warps {w}"
            RESULTS["cascade"].append({"variant": name, "us_per_layer": us, "whole_us": whole, "rel_err": err,
                                       "same_as_first": bool(torch.equal(o, expected))})
            print(f"  {name}: merge {us:.1f} us, whole cascade {whole:.1f} us/layer, err {err:.1e}", flush=True)
            TABLE.append((name, f"{us:.1f} us merge", f"whole cascade {whole:.1f} us/layer, err {err:.1e}"))


def main():
    sections = {"gemm": bench_gemm, "cascade": bench_cascade, "decode": bench_decode_configs, "merge": bench_merge}
    only = ARGS.only.split(",")
    t0 = time.perf_counter()
    for key in only:
        t = time.perf_counter()
        try:
            sections[key]()
        except Exception:
            import traceback

            traceback.print_exc()
            TABLE.append((f"section {key}", "FAILED", ""))
        print(f"section {key}: {time.perf_counter() - t:.0f}s", flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_tune.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
    print(f"\n{'smoke' if SMOKE else torch.cuda.get_device_name()}, total {time.perf_counter() - t0:.0f}s")
    w = max([len(a) for a, _, _ in TABLE] + [1])
    for a, b, c in TABLE:
        print(f"{a:<{w}}  {b:<44}  {c}")


if __name__ == "__main__":
    main()
