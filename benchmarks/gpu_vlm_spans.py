"""Gemma-3 image blocks on the Triton extend kernel (span_end: each new token sees keys up to its image block's
end), on one H200:

(a) correctness: the kernel against kernels/reference.py on Gemma-3-4B's attention shape (8 query heads, 4 kv
    heads, head_dim 256), ragged batches with 256-token image blocks (one starting in the cached prefix), bf16
    and fp32, full and 1024-token sliding window, pool and contiguous new K/V;
(b) timing (median, triton.testing.do_bench): a 4096-token prefill holding 8 image blocks, with span_end
    against the plain causal launch of the same shape (what the blocks cost);
(c) the engine: a tiny random Gemma-3 VLM checkpoint (tests/helpers/checkpoints.py, fp32 on the GPU), three
    prompts with 1-2 images, attention_backend="triton" (cached, chunked prefill) against "torch" with no
    reuse: greedy tokens equal, largest top-3 logprob difference.

Writes benchmarks/results/gpu_vlm_spans.json and prints a short table last.

    PYTHONPATH=$PWD python benchmarks/gpu_vlm_spans.py            # on the GPU host (about 1-2 minutes)
    PYTHONPATH=$PWD python benchmarks/gpu_vlm_spans.py --smoke    # tiny shapes on the CPU (Triton interpreter)
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import log, log_table, rel_err, script_parser

TOL = {"bfloat16": 2e-2, "float32": 1e-4}


def _case(torch, dev, dtype, heads, kv_heads, head_dim, prefix_lens, extend_lens, seed):
    """Random pool K/V (scattered slots), queries and the new tokens' contiguous K/V."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    total = sum(p + e for p, e in zip(prefix_lens, extend_lens)) + 1
    k = torch.randn(total, kv_heads, head_dim, device=dev, generator=gen).to(dtype)
    v = torch.randn(total, kv_heads, head_dim, device=dev, generator=gen).to(dtype)
    perm = (torch.randperm(total - 1, device=dev, generator=gen) + 1).to(torch.int32)
    table = torch.zeros(len(prefix_lens) + 1, max(p + e for p, e in zip(prefix_lens, extend_lens)),
                        dtype=torch.int32, device=dev)
    used = 0
    for row, (p, e) in enumerate(zip(prefix_lens, extend_lens), start=1):
        table[row, : p + e] = perm[used : used + p + e]
        used += p + e
    i32 = {"dtype": torch.int32, "device": dev}
    starts = [sum(extend_lens[:i]) for i in range(len(extend_lens))]
    q = torch.randn(sum(extend_lens), heads, head_dim, device=dev, generator=gen).to(dtype)
    args = (k, v, table, torch.arange(1, len(prefix_lens) + 1, device=dev), torch.tensor(prefix_lens, **i32),
            torch.tensor(extend_lens, **i32), torch.tensor(starts, **i32), max(extend_lens), 1 / math.sqrt(head_dim))
    new = torch.cat([table[r, p : p + e].long() for r, (p, e) in enumerate(zip(prefix_lens, extend_lens), start=1)])
    return q, args, k[new], v[new]


def _blocks(prefix_lens, extend_lens, block, every):
    """Image blocks of `block` tokens starting every `every` positions; the first may start in the prefix."""
    spans = []
    for p, e in zip(prefix_lens, extend_lens):
        mine, pos = [], max(p - block // 2, 0)
        while pos + block <= p + e:
            if pos + block > p:
                mine.append((pos, pos + block))
            pos += every
        spans.append(mine)
    return spans


def correctness(torch, dev, smoke: bool) -> list[dict]:
    from prefixrt.kernels import reference as ref
    from prefixrt.kernels.extend_attention import extend_attention, span_ends

    heads, kv_heads, head_dim, block = (4, 2, 64, 6) if smoke else (8, 4, 256, 256)
    rng = random.Random(0)
    out = []
    for i, (dtype, window) in enumerate([(torch.bfloat16, None), (torch.float32, None), (torch.bfloat16, 1024),
                                         (torch.float32, 1024)]):
        window = None if window is None or smoke else window
        if smoke:
            prefix, ext = [0, 5, 9], [20, 14, 11]
        else:
            prefix = [0, rng.randint(100, 700), rng.randint(1000, 2000), 0]
            ext = [rng.randint(600, 1200), rng.randint(300, 700), rng.randint(300, 900), 4 * 300]
        spans = _blocks(prefix, ext, block, block + (3 if smoke else 40))
        q, args, k_new, v_new = _case(torch, dev, dtype, heads, kv_heads, head_dim, prefix, ext, seed=i)
        span_end = torch.tensor(span_ends(prefix, ext, spans), dtype=torch.int32, device=dev)
        want, causal = torch.empty_like(q), torch.empty_like(q)
        ref.extend_attention(q, want, *args, sliding_window=window, span_end=span_end)
        ref.extend_attention(q, causal, *args, sliding_window=window)
        for contiguous in (False, True):
            got = torch.empty_like(q)
            kw = {"k_extend": k_new, "v_extend": v_new} if contiguous else {}
            extend_attention(q, got, *args, sliding_window=window, span_end=span_end, **kw)
            name = str(dtype).removeprefix("torch.")
            err = rel_err(got, want)
            out.append({"dtype": name, "window": window, "contiguous": contiguous, "prefix": prefix, "extend": ext,
                        "blocks": sum(len(s) for s in spans), "rel_err": err, "ok": err < TOL[name],
                        "causal_rel_err": rel_err(causal, want)})
            log(f"  {'ok  ' if err < TOL[name] else 'FAIL'} {name} window={window} contiguous={contiguous}: "
                f"rel err {err:.2e} (causal launch differs by {out[-1]['causal_rel_err']:.2e})")
    return out


def timing(torch, dev, smoke: bool) -> dict:
    from prefixrt.kernels.extend_attention import extend_attention, span_ends

    heads, kv_heads, head_dim, n, block = (4, 2, 64, 48, 6) if smoke else (8, 4, 256, 4096, 256)
    q, args, _, _ = _case(torch, dev, torch.bfloat16 if not smoke else torch.float32, heads, kv_heads, head_dim,
                          [0], [n], seed=9)
    spans = [[(a, a + block) for a in range(16, n - block, n // 8)][:8]]
    span_end = torch.tensor(span_ends([0], [n], spans), dtype=torch.int32, device=dev)
    o = torch.empty_like(q)

    def run(se):
        return lambda: extend_attention(q, o, *args, span_end=se)

    if smoke:
        t0 = time.perf_counter()
        run(span_end)()
        return {"tokens": n, "blocks": len(spans[0]), "causal_ms": None, "spans_ms": (time.perf_counter() - t0) * 1e3}
    import triton

    causal_ms = triton.testing.do_bench(run(None), warmup=25, rep=200, return_mode="median")
    spans_ms = triton.testing.do_bench(run(span_end), warmup=25, rep=200, return_mode="median")
    return {"tokens": n, "blocks": len(spans[0]), "causal_ms": causal_ms, "spans_ms": spans_ms}


def engine_check(torch, dev) -> dict:
    """The tiny Gemma-3 VLM through the engine on both backends (tests/helpers builds the checkpoint)."""
    from types import SimpleNamespace

    from prefixrt.engine.engine import Engine
    from prefixrt.hub.loader import load_model
    from tests.helpers.checkpoints import save_tiny_vlm_checkpoint
    from tests.helpers.engines import make_tiny_tokenizer
    from tests.helpers.images import ask, random_image

    tokenizer = make_tiny_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        save_tiny_vlm_checkpoint(Path(tmp), "gemma3_vlm")
        engines = {}
        for backend, kw in (("triton", {"chunked_prefill_tokens": 4}), ("torch", {"radix_cache": False})):
            model = load_model(tmp, dtype="float32", device=str(dev))
            resolved = SimpleNamespace(name="tiny-gemma3-vlm", revision="test", extra_eos_token_ids=(), path=tmp)
            engines[backend] = Engine("tiny-gemma3-vlm", _parts=(model, tokenizer, resolved), device=str(dev),
                                      dtype="float32", kv_cache_tokens=4096, attention_backend=backend,
                                      cuda_graph=False, **kw)
        params = {"max_new_tokens": 6, "temperature": 0.0, "logprobs": 3}
        a, b = random_image(81), random_image(82, size=(30, 30))
        equal, worst = 0, 0.0
        prompts = [ask("What is the capital?", a), ask("Where is the fox?", a, b), ask("What is it?", b, a)]
        for p in prompts:
            got, want = engines["triton"].generate(p, params), engines["torch"].generate(p, params)
            if got.error or want.error:
                raise RuntimeError(f"engine error: {got.error or want.error}")
            equal += got.token_ids == want.token_ids
            for g, w in zip(got.logprobs, want.logprobs):
                for x, y in zip(g["top_logprobs"], w["top_logprobs"]):
                    worst = max(worst, abs(x["logprob"] - y["logprob"]))
        cached = engines["triton"].stats().cached_tokens_total
        for eng in engines.values():
            eng.shutdown()
    return {"prompts": len(prompts), "greedy_equal": equal, "max_logprob_diff": worst, "cached_tokens": cached}


def main() -> None:
    ap = script_parser(__doc__, smoke="tiny shapes on the CPU under the Triton interpreter")
    ap.add_argument("--no-engine", action="store_true", help="skip (c), the engine check")
    args = ap.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    dev = torch.device("cpu" if args.smoke else "cuda")
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --smoke for the CPU check")
    t0 = time.perf_counter()
    log("(a) correctness")
    checks = correctness(torch, dev, args.smoke)
    log("(b) timing")
    t = timing(torch, dev, args.smoke)
    log(f"  {t}")
    eng = None
    if not args.no_engine:
        log("(c) engine")
        eng = engine_check(torch, dev)
        log(f"  {eng}")
    result = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "smoke": args.smoke,
              "checks": checks, "timing": t, "engine": eng, "seconds": time.perf_counter() - t0}
    out = Path("benchmarks/results") / ("gpu_vlm_spans_smoke.json" if args.smoke else "gpu_vlm_spans.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    rows = [("kernel checks passed", f"{sum(c['ok'] for c in checks)}/{len(checks)}",
             f"worst rel err {max(c['rel_err'] for c in checks):.2e}")]
    if t["causal_ms"] is not None:
        rows.append((f"prefill {t['tokens']} tok, {t['blocks']} image blocks", f"{t['spans_ms']:.3f} ms",
                     f"causal launch {t['causal_ms']:.3f} ms ({t['spans_ms'] / t['causal_ms']:.2f}x)"))
    if eng is not None:
        rows.append(("engine greedy equal (triton vs torch)", f"{eng['greedy_equal']}/{eng['prompts']}",
                     f"max top-3 logprob diff {eng['max_logprob_diff']:.2e}, cached {eng['cached_tokens']}"))
    log(f"wrote {out} ({result['seconds']:.0f} s)")
    log_table(rows, 12)


if __name__ == "__main__":
    main()
