"""Speculative decoding on one H200, Llama-3-8B shape with dummy weights (speculative on, CUDA graphs; one engine
with the fixed-rate drafter for sections 1 and 2, then one with the n-gram drafter for section 3):
(1) verify: one forward of the last token + k drafts (k = 4, 8), logits at every position, at batch 1, 8, 64 and
    1k context, against a plain decode step (one token a row) of the same batch, timed alone on the runner;
(2) fixed: batch-1 decode tok/s (1k-token prompt, 256 new tokens, greedy) with the test drafter accepted at 70%
    (fixed:0.7, taught by the plain run) against plain decoding (overlap scheduler on, no speculation);
(3) ngram: radix lookahead on a workload whose answers repeat cached text (8 prompts answered once, then asked
    again: the tree holds each answer), batch 1, against the same repeat run plain.
Sections 2 and 3 need greedy tokens that do not depend on the kernel path: --stable-greedy (on by default) makes the
dummy model's next greedy token a fixed function of the last one, by a wide margin (stabilize_greedy says how).
Prints a short table last and writes JSON to benchmarks/results/gpu_speculative.json (and $OUT when set).

    PYTHONPATH=$PWD python benchmarks/gpu_speculative.py           # all sections, ~2-3 min on one H200
    PYTHONPATH=$PWD python benchmarks/gpu_speculative.py --smoke   # the same logic on a tiny checkpoint on the CPU
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from pathlib import Path

from benchmarks.common import log, log_table, run_section, script_parser, unpack_heads, write_results

RESULTS: dict = {}
SUMMARY: list[tuple[str, str, str]] = []
RESULTS_DIR = Path(__file__).resolve().parent / "results"
MODEL = "llama-3-8b"
T_START = time.perf_counter()


def section(name: str, fn) -> None:
    run_section(RESULTS, SUMMARY, name, fn)


def verify_costs(eng, batches, ks, ctx: int, iters: int) -> dict:
    """Runner forwards timed alone (Engine.probes.time_forward_ms: engine idle, cache flushed): decode vs verify."""
    eng.flush_cache()
    out = {}
    for b in batches:
        base = eng.probes.time_forward_ms(b, ctx, 1, iters)
        out[f"b{b}_decode_ms"] = round(base, 3)
        for k in ks:
            ms = eng.probes.time_forward_ms(b, ctx, k + 1, iters)
            out[f"b{b}_k{k}_verify_ms"] = round(ms, 3)
            out[f"b{b}_k{k}_ratio"] = round(ms / base, 3)
            SUMMARY.append((f"verify k={k} b={b} / decode", f"{ms / base:.2f}x",
                            f"{ms:.2f} vs {base:.2f} ms (target <= 1.15x)"))
    out["replays"] = eng.probes.forward_counts()
    eng.flush_cache()
    log(json.dumps(out, indent=1))
    return out


def _decode_tok_s(eng, prompt, max_new: int, spec: bool) -> float:
    """Decode tok/s of one greedy request from its first token on."""
    first, n = None, 0
    for ch in eng.stream(prompt, {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True,
                                  "detokenize": False, "speculative": spec}):
        if first is None:
            first = time.perf_counter()
            n = len(ch.token_ids)
            continue
        n += len(ch.token_ids)
    return (n - 1) / (time.perf_counter() - first)


def _set(eng, overlap: bool, k: int | None = None) -> None:
    eng.probes.set_overlap(overlap)
    if k is not None:
        eng.probes.set_draft_tokens(k)


def _spec_counters(eng) -> dict:
    s = eng.stats()
    forwards = {f"forwards_{how}": n for how, n in eng.probes.forward_counts().items()}  # how the target forwards ran
    return {"draft": s.spec_draft_tokens_total, "accepted": s.spec_accepted_tokens_total,
            "emitted": s.spec_emitted_tokens_total, "rows": s.spec_verify_rows_total, **forwards,
            "drafter_s": s.spec_drafter_seconds_total}


def _delta(a: dict, b: dict) -> dict:
    d = {k: round(b[k] - a[k], 4) for k in a}
    d["acceptance"] = round(d["accepted"] / d["draft"], 3) if d["draft"] else 0.0
    d["tokens_per_forward"] = round(d["emitted"] / d["rows"], 3) if d["rows"] else 0.0
    return d


def fixed_rate(eng, ctx: int, max_new: int, ks: list[int]) -> dict:
    rng = random.Random(11)
    prompt = [rng.randrange(16, eng.vocab_size) for _ in range(ctx)]
    _set(eng, overlap=eng.probes.facts()["device"].startswith("cuda"))
    plain = max(_decode_tok_s(eng, prompt, max_new, spec=False) for _ in range(2))  # also teaches the drafter
    out = {"plain_tok_s": round(plain, 1)}
    for k in ks:
        _set(eng, overlap=False, k=k)
        before = _spec_counters(eng)
        spec = max(_decode_tok_s(eng, prompt, max_new, spec=True) for _ in range(2))
        d = _delta(before, _spec_counters(eng))
        out[f"k{k}"] = {"spec_tok_s": round(spec, 1), "speedup": round(spec / plain, 3), **d}
        SUMMARY.append((f"b1 fixed:0.7 k={k} / plain", f"{spec / plain:.2f}x",
                        f"{spec:.0f} vs {plain:.0f} tok/s, acceptance {d['acceptance']:.2f}, "
                        f"{d['tokens_per_forward']:.2f} tok/forward (target >= 2x)"))
    log(json.dumps(out, indent=1))
    return out


def ngram_repeat(eng, ctx: int, max_new: int, k: int, prompts_n: int) -> dict:
    """On an engine built with speculative="ngram", speculative_num_tokens=k."""
    rng = random.Random(13)
    prompts = [[rng.randrange(16, eng.vocab_size) for _ in range(ctx)] for _ in range(prompts_n)]
    _set(eng, overlap=eng.probes.facts()["device"].startswith("cuda"), k=k)
    for p in prompts:  # the answers enter the tree
        _decode_tok_s(eng, p, max_new, spec=False)
    plain = [_decode_tok_s(eng, p, max_new, spec=False) for p in prompts]
    _set(eng, overlap=False)
    before = _spec_counters(eng)
    spec = [_decode_tok_s(eng, p, max_new, spec=True) for p in prompts]
    d = _delta(before, _spec_counters(eng))
    mp, ms = sum(plain) / len(plain), sum(spec) / len(spec)
    out = {"plain_tok_s": round(mp, 1), "spec_tok_s": round(ms, 1), "speedup": round(ms / mp, 3), "k": k, **d}
    SUMMARY.append(("b1 ngram repeat / plain", f"{ms / mp:.2f}x",
                    f"{ms:.0f} vs {mp:.0f} tok/s, k={k}, acceptance {d['acceptance']:.2f}, "
                    f"{d['tokens_per_forward']:.2f} tok/forward (target >= 1.8x)"))
    log(json.dumps(out, indent=1))
    return out


def stabilize_greedy(model, scale: float, seed: int = 0) -> int:
    """Make greedy tokens a fixed function of the last token, with a wide margin, on every kernel path; returns how
    many linears were changed. In place: each forward's work and memory traffic are unchanged.

    Dummy weights give nearly flat logits, so the decode graph and the verify forward (an extend over k + 1 tokens)
    round differently enough to pick different argmaxes: a drafter replaying one path's output (the fixed-rate
    drafter, radix lookahead over an earlier answer) then stops matching the other's. Scaling every layer's output
    projections (o_proj, down_proj) by `scale` keeps the residual stream near the last token's embedding e_t, and
    lm_head's rows become the embeddings in a random order (row j = e_perm[j]): token j's logit is then largest
    for the j with perm[j] = t, by |e_t|^2 against dot products of unrelated embeddings (~64x apart at 4096
    hidden), which no rounding difference flips. The text is a walk along a random permutation: no token repeats
    within its cycle, so only the tree (not the request's own context) can draft it."""
    import torch

    count = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in ("o_proj", "down_proj") and getattr(module, "weight", None) is not None:
                module.weight.mul_(scale)
                count += 1
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        if head.data_ptr() != embed.data_ptr() and head.shape == embed.shape:  # (tied: already the embeddings)
            gen = torch.Generator(device="cpu").manual_seed(seed)
            perm = torch.randperm(embed.shape[0], generator=gen).to(embed.device)
            head.copy_(embed[perm])
            count += 1
    return count


def main() -> None:
    ap = script_parser(__doc__, smoke="the same logic on the CPU: tiny checkpoint and shapes")
    ap.add_argument("--only", default="123", help="sections to run, e.g. 13 (default: all)")
    ap.add_argument("--ctx", type=int, default=1024, help="context of every section's requests")
    ap.add_argument("--max-new", type=int, default=256, help="tokens generated per request (sections 2, 3)")
    ap.add_argument("--k-fixed", default="4,8", help="drafted tokens per step with the fixed-rate drafter (each)")
    ap.add_argument("--k-ngram", type=int, default=8, help="drafted tokens per step with the n-gram drafter")
    ap.add_argument("--stable-greedy", type=float, default=1e-3, metavar="SCALE",
                    help="scale the dummy model's output projections by SCALE and make lm_head a permutation of the "
                         "embeddings, so greedy tokens are the same on the decode and verify paths (see "
                         "stabilize_greedy; 0: leave the weights as loaded)")
    ap.add_argument("--pack-map", default=None, help="1/0: packed query heads in the EXTEND and verify graphs' short "
                    "blocks (default: kernels.extend_attention.pack_heads_by_default)")
    args = ap.parse_args()
    smoke = args.smoke
    if args.pack_map == "0":
        unpack_heads(block_maps_only=True)
    if smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    import prefixrt

    cuda = torch.cuda.is_available() and not smoke
    tmp = tempfile.TemporaryDirectory()
    if smoke:
        from benchmarks.common import tiny_model_dir

        model_name = str(tiny_model_dir(Path(tmp.name)))
        kw = dict(device="cpu", attention_backend="torch", kv_cache_tokens=4000)
        ctx, max_new, batches, iters, n_prompts = 24, 12, (1, 2, 4), 3, 2
    else:
        model_name, kw = MODEL, {"load_format": "dummy"}
        ctx, max_new, batches, iters, n_prompts = args.ctx, args.max_new, (1, 8, 64), 20, 8
    RESULTS["device"] = torch.cuda.get_device_name() if cuda else "cpu (smoke)"
    ks_fixed = [int(k) for k in args.k_fixed.split(",")]

    def engine(speculative: str, k: int):
        t = time.perf_counter()
        eng = prefixrt.Engine(model_name, speculative=speculative, speculative_num_tokens=k,
                              speculative_adaptive=False, speculative_max_batch=64, **kw)
        RESULTS.setdefault("startup_s", {})[speculative] = round(time.perf_counter() - t, 1)
        log(f"engine ({speculative}) up in {RESULTS['startup_s'][speculative]}s, KV pool {eng.kv_total_tokens} tokens")
        if args.stable_greedy:
            scaled = stabilize_greedy(eng.probes.model, args.stable_greedy)
            RESULTS["stable_greedy"] = {"scale": args.stable_greedy, "linears": scaled}
            log(f"{scaled} linears changed: output projections scaled by {args.stable_greedy:g}, lm_head a permutation "
                "of the embeddings (--stable-greedy)")
        return eng

    if "1" in args.only or "2" in args.only:  # the fixed-rate drafter's engine (verify graphs up to max(k))
        eng = engine("fixed:0.7", max(ks_fixed + [8]))
        try:
            if "1" in args.only:
                section("verify", lambda: verify_costs(eng, batches, (4, 8), ctx, iters))
            if "2" in args.only:
                section("fixed", lambda: fixed_rate(eng, ctx, max_new, ks_fixed))
        finally:
            eng.shutdown()
    if "3" in args.only:  # the n-gram drafter's engine, built after the first is gone (one 8B engine at a time)
        eng = engine("ngram", args.k_ngram)
        try:
            section("ngram", lambda: ngram_repeat(eng, ctx, max_new, args.k_ngram, n_prompts))
        finally:
            eng.shutdown()
    pack = "" if args.pack_map is None else f"-pack{args.pack_map}"
    name = f"gpu_speculative-{args.only}{pack}{'-smoke' if smoke else ''}.json"
    tmp.cleanup()
    write_results(RESULTS, name, None if smoke else RESULTS_DIR)
    log(f"\nprefixrt speculative decoding, {MODEL if not smoke else 'tiny llama'} dummy on {RESULTS['device']}, "
        f"total {time.perf_counter() - T_START:.0f}s")
    log_table(SUMMARY, 10)


if __name__ == "__main__":
    main()
