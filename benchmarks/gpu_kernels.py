"""GPU check and benchmark of the Triton attention kernels (run on one CUDA GPU, e.g. an H200).

(a) correctness: every kernel vs the torch reference on random ragged batches (prefixes up to 8k,
    windows, GQA 1/4/8, head_dim 128; bf16 rel err < 1e-2, fp32 < 1e-4);
(b) timing with triton.testing.do_bench (median): decode (achieved GB/s over the K+V bytes that must be
    read), cascade vs plain decode on a shared 3500-token prefix, extend attention (TFLOP/s);
(c) paged pools (--only=paged): decode B=64 ctx=2048 and the cascade RAG shape on a pool laid out in pages of
    16 slots, the kernels reading it a page at a time (page_size=16) vs slot by slot (page_size=1), beside the
    page-size-1 layout; every timed configuration is first checked against the torch reference.
Prints a table last; writes $OUT/gpu_kernels.json when OUT is set.

    PYTHONPATH=$PWD python benchmarks/gpu_kernels.py [--only=correctness,decode,cascade,extend,paged] [--no-sweep]
    PYTHONPATH=$PWD TRITON_INTERPRET=1 python benchmarks/gpu_kernels.py --smoke   # CPU dry run, tiny sizes
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
import traceback

import torch
import triton
from prefixrt.kernels import reference as ref
from prefixrt.kernels.cascade_decode import cascade_decode_attention
from prefixrt.kernels.cascade_plan import plan_cascade
from prefixrt.kernels.decode_attention import decode_attention
from prefixrt.kernels.extend_attention import extend_attention

from benchmarks.common import rel_err, script_parser
from prefixrt.model.attention.triton_backend import plan_decode_splits

SECTIONS = ("correctness", "decode", "cascade", "extend", "paged")


def parse_args() -> argparse.Namespace:
    ap = script_parser(__doc__, smoke="dry run of the script's logic on the CPU (TRITON_INTERPRET=1), shapes / 128")
    ap.add_argument("--only", default=",".join(SECTIONS), help="sections, comma-separated: " + ",".join(SECTIONS))
    ap.add_argument("--no-sweep", action="store_true", help="extend: time the shipped launch only, no sweep")
    return ap.parse_args()


# Parsed before anything asks for the GPU (so --help works on a machine without one); the shapes follow --smoke.
ARGS = parse_args()
SMOKE = ARGS.smoke
DEV = "cpu" if SMOKE else "cuda"


def size(n: int) -> int:
    return max(1, n // 128) if SMOKE else n


TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-4}
NUM_SMS = 132 if SMOKE else torch.cuda.get_device_properties(0).multi_processor_count
RESULTS: dict = {"checks": [], "timings": []}


class Pool:
    """K/V buffers plus a req_to_token table; slots handed out in random order (page size 1, scattered)."""

    def __init__(self, num_slots, num_kv_heads, head_dim, dtype, num_rows, max_context, seed=0):
        gen = torch.Generator(device=DEV).manual_seed(seed)
        self.k = torch.randn(num_slots, num_kv_heads, head_dim, device=DEV, dtype=dtype, generator=gen)
        self.v = torch.randn(num_slots, num_kv_heads, head_dim, device=DEV, dtype=dtype, generator=gen)
        self.req_to_token = torch.zeros(num_rows, max_context, dtype=torch.int32, device=DEV)
        self.perm = (torch.randperm(num_slots - 1, device=DEV, generator=gen) + 1).to(torch.int32)
        self.used = 0

    def take(self, n):
        out = self.perm[self.used : self.used + n]
        self.used += n
        assert self.used <= self.perm.numel(), "pool too small"
        return out

    def sequence(self, row, length, shared=None):
        p = 0 if shared is None else shared.numel()
        if p:
            self.req_to_token[row, :p] = shared
        self.req_to_token[row, p:length] = self.take(length - p)


class PagedPool(Pool):
    """A Pool in the KVManager's paged layout: a sequence takes whole pages of page_size slots (pages handed
    out in random order), position p in slot pages[p // page_size] * page_size + p % page_size. A shared prefix
    ending mid-page shares its whole pages; its partial page is copied into each sequence's own page (the
    engine shares whole pages only). page_size 1 is the plain Pool."""

    def __init__(self, num_tokens, num_kv_heads, head_dim, dtype, num_rows, max_context, page_size, seed=0):
        num_pages = num_tokens // page_size + num_rows + 2  # + a partial page per sequence, + page 0
        super().__init__(num_pages * page_size, num_kv_heads, head_dim, dtype, num_rows, max_context, seed)
        self.page_size = page_size
        gen = torch.Generator(device=DEV).manual_seed(seed + 1)
        self.page_perm = torch.randperm(num_pages - 1, device=DEV, generator=gen) + 1
        self.pages_used = 0

    def take(self, n):
        ps = self.page_size
        if ps == 1:
            return super().take(n)
        k = -(-n // ps)
        pages = self.page_perm[self.pages_used : self.pages_used + k]
        self.pages_used += k
        assert self.pages_used <= self.page_perm.numel(), "pool too small"
        return (pages[:, None] * ps + torch.arange(ps, device=DEV)[None, :]).flatten()[:n].to(torch.int32)

    def sequence(self, row, length, shared=None):
        p = 0 if shared is None else shared.numel()
        whole = p // self.page_size * self.page_size
        if whole:
            self.req_to_token[row, :whole] = shared[:whole]
        own = self.take(length - whole)
        self.req_to_token[row, whole:length] = own
        if whole < p:  # copy-on-write of the prefix's partial page
            src, dst = shared[whole:].long(), own[: p - whole].long()
            self.k[dst], self.v[dst] = self.k[src], self.v[src]


def i32(x):
    return torch.tensor(x, dtype=torch.int32, device=DEV)


def extend_inputs(pool, prefix_lens, extend_lens, num_heads, head_dim, dtype):
    rows = list(range(1, len(prefix_lens) + 1))
    for r, p, e in zip(rows, prefix_lens, extend_lens):
        pool.sequence(r, p + e)
    starts = [sum(extend_lens[:i]) for i in range(len(extend_lens))]
    q = torch.randn(sum(extend_lens), num_heads, head_dim, device=DEV, dtype=dtype)
    args = (pool.k, pool.v, pool.req_to_token, torch.tensor(rows, device=DEV), i32(prefix_lens), i32(extend_lens),
            i32(starts), max(extend_lens), 1 / math.sqrt(head_dim))  # fmt: skip
    new = torch.cat([pool.req_to_token[r, p : p + e].long() for r, p, e in zip(rows, prefix_lens, extend_lens)])
    return q, args, pool.k[new], pool.v[new]


def record_check(name, err, dtype):
    ok = err < TOL[dtype]
    RESULTS["checks"].append({"case": name, "rel_err": err, "ok": ok})
    print(f"  {'ok  ' if ok else 'FAIL'} {name}: rel err {err:.2e}", flush=True)


def correctness():
    rng = random.Random(0)
    num_kv_heads, head_dim = 2, 128
    for case in range(6):
        dtype = (torch.bfloat16, torch.float32)[case % 2]
        group = (1, 4, 8)[case % 3]
        window = (None, 512, None)[case % 3] if case < 5 else 100
        pool = Pool(40000, num_kv_heads, head_dim, dtype, 16, 8800, seed=case)
        prefix = [rng.choice([0, rng.randint(1, size(8192))]) for _ in range(4)]
        ext = [rng.randint(1, size(300) + 20) for _ in range(4)]
        q, args, k_new, v_new = extend_inputs(pool, prefix, ext, num_kv_heads * group, head_dim, dtype)
        expected, out = torch.empty_like(q), torch.empty_like(q)
        ref.extend_attention(q, expected, *args, sliding_window=window)
        for contiguous in (False, True):
            kw = {"k_extend": k_new, "v_extend": v_new} if contiguous else {}
            extend_attention(q, out, *args, sliding_window=window, **kw)
            name = f"extend {str(dtype)[6:]} G={group} win={window} contig={contiguous} pre={prefix} ext={ext}"
            record_check(name, rel_err(out, expected), dtype)

        # decode over ragged lengths up to 8k, with the split count the backend would choose
        seq_lens = [rng.randint(1, size(8192)) for _ in range(6)]
        pool = Pool(60000, num_kv_heads, head_dim, dtype, 16, 8800, seed=100 + case)
        for r, n in enumerate(seq_lens, start=1):
            pool.sequence(r, n)
        q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, device=DEV, dtype=dtype)
        dargs = (pool.k, pool.v, pool.req_to_token, torch.arange(1, len(seq_lens) + 1, device=DEV), i32(seq_lens),
                 1 / math.sqrt(head_dim))  # fmt: skip
        splits = plan_decode_splits(len(seq_lens) * num_kv_heads, max(seq_lens), NUM_SMS, 16)
        expected, out = torch.empty_like(q), torch.empty_like(q)
        ref.decode_attention(q, expected, *dargs, sliding_window=window)
        decode_attention(q, out, *dargs, sliding_window=window, num_kv_splits=splits)
        record_check(f"decode {str(dtype)[6:]} G={group} win={window} S={splits} lens={seq_lens}",
                     rel_err(out, expected), dtype)  # fmt: skip

        # cascade: two groups with long shared prefixes, one ungrouped sequence
        pool = Pool(60000, num_kv_heads, head_dim, dtype, 16, 8800, seed=200 + case)
        prefixes = [rng.randint(1, size(4000)), rng.randint(1, size(4000))]
        shared = [pool.take(p) for p in prefixes]
        members = [[0, 1, 2, 3, 4], [5, 6]]
        seq_lens = [0] * 8
        for g, seqs in enumerate(members):
            for s in seqs:
                seq_lens[s] = prefixes[g] + rng.randint(1, size(300))
                pool.sequence(s + 1, seq_lens[s], shared[g])
        seq_lens[7] = rng.randint(1, size(3000))
        pool.sequence(8, seq_lens[7])
        q = torch.randn(8, num_kv_heads * group, head_dim, device=DEV, dtype=dtype)
        cargs = (pool.k, pool.v, pool.req_to_token, torch.arange(1, 9, device=DEV), i32(seq_lens),
                 1 / math.sqrt(head_dim))  # fmt: skip
        plan = plan_cascade(list(zip(prefixes, members)), seq_lens, DEV, queries_per_tile=4)
        expected, out = torch.empty_like(q), torch.empty_like(q)
        ref.decode_attention(q, expected, *cargs)
        cascade_decode_attention(q, out, *cargs, plan=plan, num_prefix_splits=4, num_suffix_splits=2)
        record_check(f"cascade {str(dtype)[6:]} G={group} prefixes={prefixes}", rel_err(out, expected), dtype)


def bench(fn) -> float:
    """Median milliseconds of fn replayed from a CUDA graph (kernel time without Python launch cost, as
    the engine's decode runs). The eager median (launch cost included) is kept in LAST_EAGER_MS."""
    global LAST_EAGER_MS
    if SMOKE:
        t = time.perf_counter()
        fn()
        LAST_EAGER_MS = (time.perf_counter() - t) * 1e3
        return LAST_EAGER_MS
    LAST_EAGER_MS = triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


LAST_EAGER_MS = 0.0


def record_time(kind, name, ms, **extra):
    row = {"kind": kind, "case": name, "ms": ms, "eager_ms": LAST_EAGER_MS, **extra}
    RESULTS["timings"].append(row)
    shown = "  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in extra.items())
    print(f"  {kind:8s} {name:52s} graph {ms * 1e3:8.1f} us  eager {LAST_EAGER_MS * 1e3:8.1f} us  {shown}", flush=True)


def bench_decode():
    num_heads, num_kv_heads, head_dim, dtype = 32, 8, 128, torch.bfloat16
    max_b, max_ctx = size(256), size(4096)
    pool = Pool(max_b * max_ctx + 1, num_kv_heads, head_dim, dtype, max_b + 1, max_ctx)
    for r in range(1, max_b + 1):
        pool.sequence(r, max_ctx)
    for batch in sorted({size(1), size(64), size(256)}):
        for ctx in (size(2048), size(4096)):
            q = torch.randn(batch, num_heads, head_dim, device=DEV, dtype=dtype)
            o = torch.empty_like(q)
            seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
            rows = torch.arange(1, batch + 1, device=DEV)
            splits = plan_decode_splits(batch * num_kv_heads, ctx, NUM_SMS, 32)
            mid_o = torch.empty(batch, num_heads, splits, head_dim, device=DEV)
            mid_lse = torch.empty(batch, num_heads, splits, device=DEV)

            def run(q=q, o=o, seq_lens=seq_lens, rows=rows, splits=splits, mid_o=mid_o, mid_lse=mid_lse):
                decode_attention(q, o, pool.k, pool.v, pool.req_to_token, rows, seq_lens, head_dim**-0.5,
                                 num_kv_splits=splits, mid_o=mid_o, mid_lse=mid_lse)  # fmt: skip

            ms = bench(run)
            gbytes = batch * ctx * num_kv_heads * head_dim * 2 * 2 / 1e9
            record_time("decode", f"B={batch} ctx={ctx} splits={splits}", ms, GBps=gbytes / (ms / 1e3))


def bench_cascade():
    num_heads, num_kv_heads, head_dim, dtype = 32, 8, 128, torch.bfloat16
    batch, prefix_len = 64 if not SMOKE else 4, size(3500)
    rng = random.Random(1)
    own = [rng.randint(size(80), size(280)) for _ in range(batch)]
    seq_lens = [prefix_len + n for n in own]
    pool = Pool(prefix_len + sum(own) + 1, num_kv_heads, head_dim, dtype, batch + 1, max(seq_lens))
    shared = pool.take(prefix_len)
    for s in range(batch):
        pool.sequence(s + 1, seq_lens[s], shared)
    q = torch.randn(batch, num_heads, head_dim, device=DEV, dtype=dtype)
    args = (pool.k, pool.v, pool.req_to_token, torch.arange(1, batch + 1, device=DEV), i32(seq_lens), head_dim**-0.5)
    token_bytes = num_kv_heads * head_dim * 2 * 2
    splits = plan_decode_splits(batch * num_kv_heads, max(seq_lens), NUM_SMS, 32)
    o_plain = torch.empty_like(q)
    ms_plain = bench(lambda: decode_attention(q, o_plain, *args, num_kv_splits=splits))
    record_time("cascade", f"plain decode {batch}x({prefix_len}+own) S={splits}", ms_plain,
                GBps=sum(seq_lens) * token_bytes / 1e9 / (ms_plain / 1e3))  # fmt: skip
    for per_tile in (16, 32):
        plan = plan_cascade([(prefix_len, list(range(batch)))], seq_lens, DEV, queries_per_tile=per_tile)
        sp = plan_decode_splits(plan.num_tiles * num_kv_heads, prefix_len, NUM_SMS, 32)
        ss = plan_decode_splits(batch * num_kv_heads, plan.max_suffix_len, NUM_SMS, 32)
        o = torch.empty_like(q)

        def run(plan=plan, sp=sp, ss=ss, o=o):
            cascade_decode_attention(q, o, *args, plan=plan, num_prefix_splits=sp, num_suffix_splits=ss)

        ms = bench(run)
        run()
        record_time("cascade", f"cascade tile={per_tile} Sp={sp} Ss={ss}", ms, speedup=ms_plain / ms,
                    rel_err_vs_plain=rel_err(o, o_plain))  # fmt: skip


def bench_paged():
    """Page size 1 vs 16 on decode B=64 ctx=2048 and the cascade RAG shape (64 x (3500 shared + 80..280 own)).
    Rows: the page-size-1 layout read slot by slot; the 16-slot-page layout read slot by slot (layout effect
    alone); the same read a page at a time (page_size=16). Every configuration is checked against the torch
    reference (kernels/reference.py) before it is timed."""
    num_heads, num_kv_heads, head_dim, dtype = 32, 8, 128, torch.bfloat16
    token_bytes = num_kv_heads * head_dim * 2 * 2
    variants = [(1, 1), (16, 1), (16, 16)]  # (pool layout page size, page_size given to the kernels)
    table = []

    batch, ctx = size(64), size(2048)
    splits = plan_decode_splits(batch * num_kv_heads, ctx, NUM_SMS, 32)
    q = torch.randn(batch, num_heads, head_dim, device=DEV, dtype=dtype)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    rows = torch.arange(1, batch + 1, device=DEV)
    mid_o = torch.empty(batch, num_heads, splits, head_dim, device=DEV)
    mid_lse = torch.empty(batch, num_heads, splits, device=DEV)
    for layout in (1, 16):
        pool = PagedPool(batch * ctx, num_kv_heads, head_dim, dtype, batch + 1, ctx, layout, seed=3)
        for r in range(1, batch + 1):
            pool.sequence(r, ctx)
        args = (pool.k, pool.v, pool.req_to_token, rows, seq_lens, head_dim**-0.5)
        expected = torch.empty_like(q)
        ref.decode_attention(q, expected, *args)
        for lay, kernel_ps in (v for v in variants if v[0] == layout):
            o = torch.empty_like(q)

            def run(o=o, kernel_ps=kernel_ps, args=args):
                decode_attention(q, o, *args, num_kv_splits=splits, mid_o=mid_o, mid_lse=mid_lse, page_size=kernel_ps)

            run()
            name = f"decode B={batch} ctx={ctx} S={splits} layout P={lay} kernel page_size={kernel_ps}"
            record_check(f"paged {name}", rel_err(o, expected), dtype)
            ms = bench(run)
            record_time("paged", name, ms, GBps=batch * ctx * token_bytes / 1e9 / (ms / 1e3))
            table.append(("decode", f"B={batch} ctx={ctx}", lay, kernel_ps, ms))
        del pool, args

    batch, prefix_len = 64 if not SMOKE else 4, size(3500)
    rng = random.Random(1)
    own = [rng.randint(size(80), size(280)) for _ in range(batch)]
    seq_lens_l = [prefix_len + n for n in own]
    q = torch.randn(batch, num_heads, head_dim, device=DEV, dtype=dtype)
    seq_lens = i32(seq_lens_l)
    rows = torch.arange(1, batch + 1, device=DEV)
    for layout in (1, 16):
        pool = PagedPool(prefix_len + sum(own), num_kv_heads, head_dim, dtype, batch + 1, max(seq_lens_l), layout,
                         seed=4)  # fmt: skip
        shared = pool.take(prefix_len)
        for s_ in range(batch):
            pool.sequence(s_ + 1, seq_lens_l[s_], shared)
        args = (pool.k, pool.v, pool.req_to_token, rows, seq_lens, head_dim**-0.5)
        expected = torch.empty_like(q)
        ref.decode_attention(q, expected, *args)
        # The engine groups whole shared pages only (PrefixGrouper): the rest of the prefix is suffix.
        group_len = prefix_len // layout * layout
        plan = plan_cascade([(group_len, list(range(batch)))], seq_lens_l, DEV, queries_per_tile=16)
        sp = plan_decode_splits(plan.num_tiles * num_kv_heads, group_len, NUM_SMS, 32)
        ss = plan_decode_splits(batch * num_kv_heads, plan.max_suffix_len, NUM_SMS, 32)
        splits = plan_decode_splits(batch * num_kv_heads, max(seq_lens_l), NUM_SMS, 32)
        for lay, kernel_ps in (v for v in variants if v[0] == layout):
            o_plain, o_casc = torch.empty_like(q), torch.empty_like(q)

            def run_plain(o=o_plain, kernel_ps=kernel_ps, args=args, splits=splits):
                decode_attention(q, o, *args, num_kv_splits=splits, page_size=kernel_ps)

            def run_cascade(o=o_casc, kernel_ps=kernel_ps, args=args, plan=plan, sp=sp, ss=ss):
                cascade_decode_attention(q, o, *args, plan=plan, num_prefix_splits=sp, num_suffix_splits=ss,
                                         page_size=kernel_ps)  # fmt: skip

            for what, run, o in (("plain decode", run_plain, o_plain), ("cascade tile=16", run_cascade, o_casc)):
                run()
                name = f"RAG {what} {batch}x({prefix_len}+own) layout P={lay} kernel page_size={kernel_ps}"
                record_check(f"paged {name}", rel_err(o, expected), dtype)
                ms = bench(run)
                record_time("paged", name, ms, GBps=sum(seq_lens_l) * token_bytes / 1e9 / (ms / 1e3))
                table.append((f"RAG {what}", f"{batch}x({prefix_len}+80..280)", lay, kernel_ps, ms))
        del pool, args

    print("\n| kernel | shape | pool layout page size | kernel page_size | graph us | vs same layout slot by slot |"
          "\n|---|---|---|---|---|---|")
    for kind, shape, lay, kernel_ps, ms in table:
        base = next(m for k, sh, la, kp, m in table if (k, sh, la, kp) == (kind, shape, lay, 1))
        print(f"| {kind} | {shape} | {lay} | {kernel_ps} | {ms * 1e3:.1f} | {base / ms:.3f}x |")


def extend_flops(prefix_lens, extend_lens, num_heads, head_dim):
    visible = sum(e * p + e * (e + 1) // 2 for p, e in zip(prefix_lens, extend_lens))
    return 4 * num_heads * head_dim * visible


def sdpa_lower_right(q, k, v):
    """torch SDPA with the causal mask aligned bottom-right (queries are the last positions of the keys)."""
    from torch.nn.attention.bias import causal_lower_right

    sdpa = torch.nn.functional.scaled_dot_product_attention
    if q.shape[-2] == k.shape[-2]:
        return sdpa(q, k, v, is_causal=True, enable_gqa=True)
    return sdpa(q, k, v, attn_mask=causal_lower_right(q.shape[-2], k.shape[-2]), enable_gqa=True)


# Launch configurations swept on the GPU (BLOCK_M, BLOCK_N, num_warps, num_stages); the kernel's own choice
# is timed first as "default".
EXTEND_SWEEP = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 32, 4, 3),
                (128, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 8, 3),
                (64, 32, 4, 3)]
PACKED_SWEEP = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3), (64, 64, 4, 2)]


def bench_extend_case(name, prefix, ext, sweep=False, contiguous_too=True):
    num_heads, num_kv_heads, head_dim, dtype = 32, 8, 128, torch.bfloat16
    pool = Pool(sum(prefix) + sum(ext) + 1, num_kv_heads, head_dim, dtype, len(prefix) + 1, max(prefix) + max(ext))
    q, args, k_new, v_new = extend_inputs(pool, prefix, ext, num_heads, head_dim, dtype)
    o = torch.empty_like(q)
    flops = extend_flops(prefix, ext, num_heads, head_dim)
    row = {"case": name, "flops": flops}
    for pack in (False, True):  # one program per query head, or a kv head's query heads packed into its rows
        for contiguous in (False, True) if contiguous_too else (False,):
            kw = {"k_extend": k_new, "v_extend": v_new} if contiguous else {}
            ms = bench(lambda kw=kw, pack=pack: extend_attention(q, o, *args, pack_heads=pack, **kw))
            label = f"{name} ({'new K/V contiguous' if contiguous else 'all from pool'}{', heads packed' if pack else ''})"
            record_time("extend", label, ms, TFLOPs=flops / (ms / 1e3) / 1e12)
            row[("contiguous" if contiguous else "pool") + ("_packed" if pack else "")] = flops / (ms / 1e3) / 1e12
    # Reference for the checks and the SDPA baseline: each sequence's whole K/V gathered contiguously.
    rows = args[3].tolist()
    outs = []
    ks = [pool.k[pool.req_to_token[r, : p + e].long()].transpose(0, 1)[None] for r, p, e in zip(rows, prefix, ext)]
    vs = [pool.v[pool.req_to_token[r, : p + e].long()].transpose(0, 1)[None] for r, p, e in zip(rows, prefix, ext)]
    starts = [sum(ext[:i]) for i in range(len(ext))]
    if len(set(prefix)) == 1 and len(set(ext)) == 1:  # one batched SDPA call
        qd = q.view(len(ext), ext[0], num_heads, head_dim).transpose(1, 2)
        kd, vd = torch.cat(ks), torch.cat(vs)
        try:
            ms = bench(lambda: sdpa_lower_right(qd, kd, vd))
            record_time("extend", f"{name} torch SDPA baseline (contiguous K/V)", ms,
                        TFLOPs=flops / (ms / 1e3) / 1e12)  # fmt: skip
            row["sdpa"] = flops / (ms / 1e3) / 1e12
            expected = sdpa_lower_right(qd, kd, vd).transpose(1, 2).reshape_as(q)
        except Exception as e:  # noqa: BLE001 - a missing baseline must not stop the run
            print("  SDPA baseline unavailable:", e)
            expected = None
    else:
        for e, st, k, v in zip(ext, starts, ks, vs):
            qd = q[st: st + e].transpose(0, 1)[None]
            outs.append(sdpa_lower_right(qd, k, v)[0].transpose(0, 1))
        expected = torch.cat(outs)
    if expected is not None:
        for pack in (False, True):
            o.zero_()
            extend_attention(q, o, *args, pack_heads=pack)
            record_check(f"extend {name}{' heads packed' if pack else ''} vs SDPA", rel_err(o, expected), dtype)
    if sweep and not SMOKE:
        best = None
        for pack, configs in ((False, EXTEND_SWEEP), (True, PACKED_SWEEP)):
            for bm, bn, w, st in configs:
                cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": st}
                try:
                    o.zero_()
                    extend_attention(q, o, *args, config=cfg, pack_heads=pack)
                    err = rel_err(o, expected) if expected is not None else 0.0
                    ms = bench(lambda cfg=cfg, pack=pack: extend_attention(q, o, *args, config=cfg, pack_heads=pack))
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: skip the config
                    print(f"  config {bm, bn, w, st} failed: {type(e).__name__}: {str(e)[:120]}")
                    continue
                tf = flops / (ms / 1e3) / 1e12
                record_time("sweep", f"{name} {'packed ' if pack else ''}M{bm} N{bn} w{w} s{st}", ms, TFLOPs=tf,
                            rel_err=err)  # fmt: skip
                if err < TOL[dtype] and (best is None or tf > best[1]):
                    best = (("packed" if pack else "per-head", bm, bn, w, st), tf)
        row["best"] = best
    RESULTS.setdefault("extend_rows", []).append(row)


def bench_extend():
    sweep = not ARGS.no_sweep
    bench_extend_case("1 x 4096 prefill", [0], [size(4096)], sweep)
    for cached in (8192, 16384, 32768, 65536):
        bench_extend_case(f"1 x 2048 new over {cached} cached", [size(cached)], [size(2048)], sweep, False)
    bench_extend_case("64 x 80 new over 3500 prefix", [size(3500)] * size(64), [size(80)] * size(64), sweep)
    bench_extend_case("1 x 80 new over 3500 prefix", [size(3500)], [size(80)], False, False)
    print("\n| extend case | pool TFLOP/s | heads packed | SDPA TFLOP/s | best swept config (TFLOP/s) |\n|---|---|---|---|---|")
    for r in RESULTS.get("extend_rows", []):
        print(f"| {r['case']} | {r.get('pool', 0):.0f} | {r.get('pool_packed', 0):.0f} | {r.get('sdpa', 0):.0f} | {r.get('best')} |")


def main():
    t0 = time.time()
    RESULTS["device"] = "cpu (smoke)" if SMOKE else torch.cuda.get_device_name(0)
    print(f"device: {RESULTS['device']}, SMs {NUM_SMS}, torch {torch.__version__}, triton {triton.__version__}")
    sections = {"correctness": correctness, "decode": bench_decode, "cascade": bench_cascade, "extend": bench_extend,
                "paged": bench_paged}
    only = ARGS.only.split(",")
    for section in (sections[k] for k in only):
        print(f"== {section.__name__}", flush=True)
        try:
            section()
        except Exception:  # noqa: BLE001 - report and go on to the next section
            traceback.print_exc()
            RESULTS.setdefault("errors", []).append(section.__name__)
        if not SMOKE:
            torch.cuda.empty_cache()
    failed = [c for c in RESULTS["checks"] if not c["ok"]]
    print(f"\n== summary ({time.time() - t0:.0f} s): {len(RESULTS['checks']) - len(failed)}/{len(RESULTS['checks'])} checks ok")
    print("| kind | case | graph us | eager us | metric (from graph time) |\n|---|---|---|---|---|")
    for row in RESULTS["timings"]:
        metric = ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                           for k, v in row.items() if k not in ("kind", "case", "ms", "eager_ms"))  # fmt: skip
        print(f"| {row['kind']} | {row['case']} | {row['ms'] * 1e3:.1f} | {row['eager_ms'] * 1e3:.1f} | {metric} |")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_kernels.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)


if __name__ == "__main__":
    main()
