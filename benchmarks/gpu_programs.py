"""The SGLang paper's LM-program evaluation on prefixrt: every workload of prefixrt/bench/programs under every ablation.

Workloads (preset "gpu", sizes in prefixrt/bench/programs/*.py and docs/benchmarks-programs.md): mmlu, hellaswag,
react, generative-agents, tree-of-thought, skeleton-of-thought, llm-judge, json, multi-turn-short,
multi-turn-long, dspy-rag. Ablations (prefixrt/bench/programs/runner.py): full, fcfs, no-hint, no-parallel on one
engine (radix cache, lpm; fcfs switched on its scheduler), then no-cache (radix_cache=False) and block-cache
(prefix_cache="block", vLLM-style hash blocks) on an engine each: three engines in all, built one after another.
Each engine first runs every workload at the "ci" preset (warm-up: kernels, grammars; the first engine's are
kept as the small-shape hit rates to compare with the CPU test suite's Gemma-3-270M runs).

Prints one table per workload (programs/s, tokens/s, x no-cache, hit rate, ideal hit rate, latency p50/p99) and
writes programs.json and programs.png (throughput normalised to no cache; hit rate vs ideal) to --out (default
$OUT when set, else the current folder).

Sized for an H200 with the llama-3-8b shape and dummy weights: the whole run is meant to end within 8 minutes;
--budget-s (default 400) stops starting new runs past that many seconds, and the skipped runs are listed.

Memory pressure (--pool-fraction-of-working-set F): the default pool holds every workload's whole working set, so
nothing is evicted and the order of admission (lpm or fcfs) cannot change what is reused. With F, a first engine
at the default pool runs each workload under "full" and measures its working set (the tokens an exact
never-evicting cache holds after the trace, bench/workloads.trace_working_set); then each workload runs its
ablations on engines whose pool is F x that many tokens (at least --min-pool-tokens), three engines a workload
(lpm/fcfs, block cache, no cache). The table ends with the component ordering of each workload (no cache <
block cache < fcfs < full, by programs/s and by hit rate). --kv-cache-tokens N instead sets one pool for all.

    PYTHONPATH=$PWD python benchmarks/gpu_programs.py                     # on the GPU host
    PYTHONPATH=$PWD python benchmarks/gpu_programs.py --workloads tree-of-thought,llm-judge --ablations full,no-cache
    PYTHONPATH=$PWD python benchmarks/gpu_programs.py --workloads llm-judge,mmlu \
        --ablations full,fcfs,block-cache,no-cache --pool-fraction-of-working-set 0.5   # under eviction
    PYTHONPATH=$PWD python benchmarks/gpu_programs.py --smoke /path/to/tiny-hf-folder   # ci shapes on the CPU
    PYTHONPATH=$PWD python benchmarks/gpu_programs.py --cpu-twin   # ci shapes on the CPU, hit rates as on the H200

--cpu-twin: the ci preset on the CPU with a 2-layer llama of random weights that uses --model's tokenizer, built in
a temporary folder, its weights drawn as --load-format dummy draws them. Token counts, and so hit rates, depend on
the tokenizer, and a program's answers on the weights (random ones write random tokens, often of other lengths
than a real model's before a stop string), so this twin, not Gemma-3-270M, is the CPU run whose hit rates compare
with the H200's ci_preset rows (docs/benchmarks-programs.md, "CPU against H200").
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time


def log(*a):
    print(*a, flush=True)


ORDERING = ("no-cache", "block-cache", "fcfs", "full")  # the paper's component ordering, worst first


def component_ordering(rows, pool: dict) -> str:
    """One line: programs/s and hit rate of no-cache, block-cache, fcfs and full, and whether each is strictly
    above the one before it (the paper's ordering under memory pressure)."""
    by = {r.ablation: r for r in rows}
    got = [a for a in ORDERING if a in by]
    parts = [f"{a} {by[a].programs_per_s:.2f}/s hit {by[a].hit_rate:.1%}" for a in got]
    speed = all(by[a].programs_per_s < by[b].programs_per_s for a, b in zip(got, got[1:]))
    hits = all(by[a].hit_rate < by[b].hit_rate for a, b in zip(got, got[1:]))
    return (f"ordering at pool {pool['kv_cache_tokens']} (working set {pool['working_set_tokens']}): "
            + " < ".join(parts) + f" | by speed: {'holds' if speed else 'no'}, by hit rate: {'holds' if hits else 'no'}")


def cpu_twin(model: str, path: str | None = None) -> str:
    """A folder (path, or a new temporary one) holding a 2-layer llama with random weights and `model`'s tokenizer
    (its vocabulary)."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from prefixrt.hub.registry import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(model))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    path = path or tempfile.mkdtemp(prefix="prefixrt-cpu-twin-")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    ap.add_argument("--workloads", default="all", help="comma list of workload names, or all")
    ap.add_argument("--ablations", default="all", help="comma list of full, no-cache, block-cache, fcfs, no-hint, "
                                                        "no-parallel, or all")
    ap.add_argument("--preset", default=None, choices=["ci", "gpu"], help="default gpu (ci with --smoke)")
    ap.add_argument("--num-threads", type=int, default=64, help="programs in flight at once")
    ap.add_argument("--budget-s", type=float, default=400.0, help="start no run past this many seconds")
    ap.add_argument("--kv-cache-tokens", type=int, default=None, help="one KV pool size for every engine")
    ap.add_argument("--pool-fraction-of-working-set", type=float, default=None, metavar="F",
                    help="size each workload's pool to F x its measured working set (e.g. 0.5): runs under eviction")
    ap.add_argument("--min-pool-tokens", type=int, default=4096, help="floor of a pool sized by the fraction")
    ap.add_argument("--out", default=None, help="folder for programs.json and programs.png (default $OUT or .)")
    ap.add_argument("--smoke", default=None, metavar="MODEL_DIR",
                    help="the ci preset on the CPU with a local HF folder (tests this script's logic)")
    ap.add_argument("--cpu-twin", action="store_true",
                    help="--smoke with a tiny random-weight llama that uses --model's tokenizer (see below)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    from prefixrt.bench.programs import WORKLOADS
    from prefixrt.bench.programs.cli import parse_names, run_matrix
    from prefixrt.bench.programs.runner import ABLATIONS, format_results
    from prefixrt.engine.engine import Engine

    workloads = [WORKLOADS[n] for n in parse_names(args.workloads, WORKLOADS, "workload")]
    order = ["full", "fcfs", "no-hint", "no-parallel", "no-cache", "block-cache"]  # the default engine's group first
    names = parse_names(args.ablations, ABLATIONS, "ablation")
    ablations = [ABLATIONS[n] for n in sorted(names, key=order.index)]
    out = args.out or os.environ.get("OUT") or "."
    os.makedirs(out, exist_ok=True)
    if args.cpu_twin:
        args.smoke = cpu_twin(args.model)
    if args.smoke:
        model, preset = args.smoke, args.preset or "ci"
        base = dict(device="cpu", dtype="float32", kv_cache_tokens=args.kv_cache_tokens or 16384)
        if args.cpu_twin:
            base["load_format"] = "dummy"  # the H200 run's random weights (hub/loader.init_dummy_weights)
    else:
        model, preset = args.model, args.preset or "gpu"
        base = dict(load_format=args.load_format, kv_cache_tokens=args.kv_cache_tokens)
    meta = {"date": datetime.date.today().isoformat(), "argv": sys.argv, "host": platform.node(), "model": model,
            "preset": preset}

    def make_engine(overrides):
        t = time.perf_counter()
        eng = Engine(model, progress=False, **{**base, **overrides})
        meta.update(device=str(eng.device), dtype=eng.probes.facts()["dtype"])
        log(f"  engine {overrides or 'default'} built in {time.perf_counter() - t:.1f}s")
        return eng

    skipped: list = []
    warm: list = []
    matrix = dict(num_threads=args.num_threads, log=log, skipped=skipped)
    if args.pool_fraction_of_working_set:
        reference = run_matrix(make_engine, workloads, [ABLATIONS["full"]], preset, budget_s=args.budget_s,
                               warm_results=warm, **matrix)
        meta["default_pool"] = [r.to_dict() for r in reference]
        results, meta["pools"] = [], {}
        for r in reference:
            pool = max(args.min_pool_tokens, int(args.pool_fraction_of_working_set * r.working_set_tokens))
            meta["pools"][r.workload] = {"working_set_tokens": r.working_set_tokens, "kv_cache_tokens": pool}
            log(f"# {r.workload}: working set {r.working_set_tokens} tokens, pool {pool}")
            results += run_matrix(lambda o, pool=pool: make_engine({**o, "kv_cache_tokens": pool}),
                                  [WORKLOADS[r.workload]], ablations, preset,
                                  budget_s=args.budget_s - (time.perf_counter() - t0), **matrix)
    else:
        results = run_matrix(make_engine, workloads, ablations, preset,
                             budget_s=args.budget_s - (time.perf_counter() - t0), warm_results=warm, **matrix)
    meta["wall_s"] = round(time.perf_counter() - t0, 1)
    for w in workloads:
        rows = [r for r in results if r.workload == w.name]
        if rows:
            log(f"\n## {w.title} ({w.name}): {w.describe(w.sizes_for(preset))}")
            log(format_results(rows))
            if "pools" in meta:
                log(component_ordering(rows, meta["pools"][w.name]))
    if "default_pool" in meta:
        log("\n## full at the default pool (the runs that measured each working set)")
        log(format_results(reference))
    if warm:
        log("\n## every workload at the ci preset (warm-up runs of the first engine): hit rates to compare with "
            "the CPU runs")
        log(format_results(warm))
    for w, a, why in skipped:
        log(f"skipped: {w} / {a}: {why}")
    path = os.path.join(out, "programs.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": [r.to_dict() for r in results],
                   "ci_preset": [r.to_dict() for r in warm], "skipped": skipped}, f, indent=1)
    log(f"wrote {path}")
    if results:
        from prefixrt.bench.programs.plot import plot_programs

        png = os.path.join(out, "programs.png")
        plot_programs(results, png, title=f"LM programs | {model} ({args.load_format if not args.smoke else 'cpu'})"
                      f" | {meta.get('device', '')} | {meta['date']}")
        log(f"wrote {png}")
    log(f"total wall time {time.perf_counter() - t0:.1f}s")
    return 1 if any(str(why).startswith("failed") for *_, why in skipped) else 0


if __name__ == "__main__":
    sys.exit(main())
