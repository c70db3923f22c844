"""Capacity and throughput model of layer-split K/V for context-parallel prefill (prefixrt/parallel/experimental/layer_split.py),
against replicating every layer's K/V on every rank. Prints the markdown table of docs/layer_split.md.

    python benchmarks/layer_split_model.py                      # Llama-3.1-8B shape, 4 ranks (the docs' table)
    python benchmarks/layer_split_model.py --ranks 8 --layers 80 --kv-heads 8 --head-dim 128 --hidden 8192 \
        --intermediate 28672 --heads 64 --kv-budget-gib 60     # a 70B shape on 8 ranks

One prefill of a context of C tokens whose first h*C tokens are a cache hit (prefix P = h*C, new N = (1-h)*C),
W ranks, each computing N/W new tokens (context parallel), L layers, b = K/V bytes per token over all layers.
- K/V per GPU: replicated C*b; layer-split C*b*ceil(L/W)/L (the rank with the most layers).
- Received per GPU per prefill: the new tokens' K/V, all-gathered, N*b*(W-1)/W in both designs (replicated
  keeps it, layer-split keeps only its layers'); layer-split also receives the prefix of every layer it does not
  own, P*b*(L-own)/L: the price of the memory saved.
- Overlap: layer l+1's broadcast travels while layer l computes. Per layer, compute = (2*params_per_layer +
  4*heads*head_dim*(P + N/2)) * N/W FLOPs at --tflops, but no less than reading the layer's weights at --hbm-gbps;
  broadcast = P*b/L bytes at --link-gbps. Hidden when the
  broadcast is no longer than the compute; else the prefill slows by the difference per layer.
The rates are assumptions (flags), not measurements: an H200's dense bf16 peak is ~989 TFLOP/s, its HBM ~4.8 TB/s
and NVLink ~450 GB/s per direction; the defaults take ~60%, ~70% and ~70% of those.
"""

from __future__ import annotations

import argparse
import math

from benchmarks.common import script_parser

GIB = 2**30


def rows(a: argparse.Namespace) -> list[dict]:
    b = 2 * a.layers * a.kv_heads * a.head_dim * a.dtype_bytes  # K/V bytes per token, all layers
    own = math.ceil(a.layers / a.ranks)  # layers of the busiest rank
    params = a.hidden * (a.heads * a.head_dim * 2 + 2 * a.kv_heads * a.head_dim) + 3 * a.hidden * a.intermediate
    out = []
    for c in a.contexts:
        for h in a.hit_rates:
            p, n = h * c, (1 - h) * c
            gather = n * b * (a.ranks - 1) / a.ranks
            bcast = p * b * (a.layers - own) / a.layers
            flops = (2 * params + 4 * a.heads * a.head_dim * (p + n / 2)) * n / a.ranks  # one layer, one rank
            # A layer cannot run faster than its weights stream from HBM (what bounds short extends).
            t_compute = max(flops / (a.tflops * 1e12), params * a.dtype_bytes / (a.hbm_gbps * 1e9))
            t_bcast = p * b / a.layers / (a.link_gbps * 1e9)
            out.append({
                "context": c, "hit": h,
                "kv_rep": c * b / GIB, "kv_split": c * b * own / a.layers / GIB,
                "gather": gather / GIB, "bcast": bcast / GIB,
                "t_compute_ms": t_compute * 1e3, "t_bcast_ms": t_bcast * 1e3,
                "slowdown": (a.layers * max(t_compute, t_bcast)) / (a.layers * t_compute) if t_compute else math.inf,
            })
    return out


def table(a: argparse.Namespace) -> str:
    b = 2 * a.layers * a.kv_heads * a.head_dim * a.dtype_bytes
    own = math.ceil(a.layers / a.ranks)
    lines = [
        f"Shape: {a.layers} layers, {a.kv_heads} KV heads x {a.head_dim}, {a.dtype_bytes}-byte K/V "
        f"({b / 2**10:.0f} KiB per token), hidden {a.hidden}, {a.heads} heads, MLP {a.intermediate}; {a.ranks} ranks "
        f"(busiest keeps {own} of {a.layers} layers); {a.tflops:.0f} TFLOP/s and {a.hbm_gbps:.0f} GB/s HBM per rank, "
        f"{a.link_gbps:.0f} GB/s links.",
        "",
        "| context | hit rate | K/V per GPU, replicated (GiB) | K/V per GPU, layer-split (GiB) | new K/V all-gathered "
        "per GPU (GiB) | prefix broadcast per GPU (GiB) | compute per layer (ms) | broadcast per layer (ms) | "
        "prefill time vs replicated |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows(a):
        hidden = "hidden" if r["slowdown"] <= 1.0 else f"{r['slowdown']:.2f}x"
        lines.append(f"| {r['context'] // 1024}k | {r['hit']:.0%} | {r['kv_rep']:.2f} | {r['kv_split']:.2f} | "
                     f"{r['gather']:.2f} | {r['bcast']:.2f} | {r['t_compute_ms']:.2f} | {r['t_bcast_ms']:.2f} | "
                     f"{hidden} |")
    cap_rep = a.kv_budget_gib * GIB / b
    cap_split = a.kv_budget_gib * GIB / (b * own / a.layers)
    lines += ["", f"With {a.kv_budget_gib:.0f} GiB of K/V per GPU: at most {cap_rep / 1e3:.0f}k tokens of context "
                  f"replicated, {cap_split / 1e3:.0f}k layer-split ({cap_split / cap_rep:.1f}x)."]
    return "\n".join(lines)


def parse(argv=None) -> argparse.Namespace:
    p = script_parser(__doc__)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--dtype-bytes", type=int, default=2)
    p.add_argument("--tflops", type=float, default=600.0, help="sustained dense TFLOP/s per rank")
    p.add_argument("--hbm-gbps", type=float, default=3300.0, help="weight streaming bandwidth per rank, GB/s")
    p.add_argument("--link-gbps", type=float, default=315.0, help="broadcast bandwidth per rank, GB/s")
    p.add_argument("--kv-budget-gib", type=float, default=60.0, help="K/V memory per GPU, for the capacity line")
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    p.add_argument("--hit-rates", type=float, nargs="+", default=[0.0, 0.5, 0.9, 0.99])
    return p.parse_args(argv)


if __name__ == "__main__":
    print(table(parse()))
