"""Where a hot-prefix request's device time goes, and the block-mapped extend attention it runs.

profile: one request at a time, 3500 cached + 80 new tokens (Llama-3-8B shape, dummy bf16), 5 warm requests, TTFT
of 10, then torch.profiler over 5 more: device time per kernel (the EXTEND graph on; --graphs 0 runs eagerly).
sweep: the EXTEND graphs' block-mapped extend attention alone (32 query heads, 8 kv heads, head dim 128, bf16)
for an 80-token extend over 3,500 cached tokens and a 200-token one over 60,000: per-head and packed query heads,
split counts and launch configs, each checked against the torch reference. Times are CUDA events around 200
launches from Python: the 3,500-token case is launch-bound there (read its device time from `profile`), the
60,000-token case is not.

    PYTHONPATH=$PWD python benchmarks/gpu_hot_extend.py [--only profile,sweep] [--graphs 1|0]
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from benchmarks.common import HotPrefix, device_ms, log, script_parser

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def profile(graphs: bool) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    import prefixrt

    eng = prefixrt.Engine("llama-3-8b", load_format="dummy", kv_cache_tokens=330_000, cuda_graph=graphs)
    try:
        hp = HotPrefix(eng, 32000, 3500, 80)
        params = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}

        def one() -> float:
            t = time.perf_counter()
            list(eng.stream(hp.shared + hp._tokens(80), params))
            return (time.perf_counter() - t) * 1000

        for _ in range(5):
            one()
        ttft = [one() for _ in range(10)]
        log(f"graphs={graphs}: TTFT ms median {statistics.median(ttft):.2f}, min {min(ttft):.2f}")
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                one()
            torch.cuda.synchronize()
        log(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=70))
    finally:
        eng.shutdown()


def sweep_case(prefix: int, new: int, bucket: int):
    """One sequence of `prefix` cached + `new` tokens in a shuffled pool, its queries, and the block map of the
    EXTEND graph bucket `bucket` (as model/cuda_graphs.py builds it)."""
    from prefixrt.kernels.extend_attention import block_map

    from prefixrt.model.cuda_graphs import extend_block_m

    dev = "cuda"
    slots = prefix + new + 16
    k = torch.randn(slots, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.zeros(2, slots, dtype=torch.int32, device=dev)
    table[1, : prefix + new] = torch.randperm(slots - 1, device=dev)[: prefix + new].int() + 1
    q = torch.randn(new, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    i32 = {"dtype": torch.int32, "device": dev}
    args = (k, v, table, torch.tensor([1], device=dev), torch.tensor([prefix], **i32), torch.tensor([new], **i32),
            torch.tensor([0], **i32), new, 1 / math.sqrt(HEAD_DIM))
    block_m = extend_block_m(bucket, 1, HEAD_DIM)
    seqs, mbs = block_map([new], block_m, 1 + -(-bucket // block_m))
    return q, args, block_m, torch.tensor(seqs, **i32), torch.tensor(mbs, **i32)


def timed_us(fn, n: int = 200) -> float:
    return device_ms(fn, iters=n, warm=5) * 1000


def sweep() -> None:
    import prefixrt.kernels.reference as ref
    from prefixrt.kernels.extend_attention import extend_attention

    for prefix, new, bucket in ((3500, 80, 96), (60000, 200, 256)):
        q, args, block_m, block_seq, block_mb = sweep_case(prefix, new, bucket)
        expected = torch.empty_like(q)
        ref.extend_attention(q, expected, *args)
        variants = [(pack, splits, None) for pack in (False, True) for splits in (1, 4, 8, 16)]
        variants += [(True, 8, {"BLOCK_N": bn, "num_warps": w, "num_stages": st})
                     for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3)]
        mapped = {"block_seq": block_seq, "block_mb": block_mb, "block_m": block_m}
        for pack, splits, cfg in variants:
            o = torch.empty_like(q)

            def run(q=q, o=o, args=args, mapped=mapped, pack=pack, splits=splits, cfg=cfg):
                extend_attention(q, o, *args, **mapped, num_splits=splits, pack_heads=pack, config=cfg)
            run()
            err = ((o.float() - expected.float()).norm() / expected.float().norm()).item()
            log(f"prefix {prefix} new {new} packed {pack} splits {splits} config {cfg}: {timed_us(run):.1f} us, "
                f"rel err {err:.1e}")


def main() -> None:
    ap = script_parser(__doc__)
    ap.add_argument("--only", default="profile,sweep", help="parts, comma-separated: profile, sweep")
    ap.add_argument("--graphs", default="1", help="profile: 1 = CUDA graphs on (the default engine), 0 = eager")
    args = ap.parse_args()
    only = args.only.split(",")
    if "profile" in only:
        profile(args.graphs == "1")
    if "sweep" in only:
        sweep()


if __name__ == "__main__":
    main()
