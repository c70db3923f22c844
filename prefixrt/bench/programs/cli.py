"""`prefixrt bench --program NAME`: LM-program workloads under ablations, on an in-process engine (one engine per
engine configuration the ablations need, each reused by every workload) or on a `prefixrt serve` URL.

run_matrix is the loop that benchmarks/gpu_programs.py drives too: every workload under every ablation that
applies to it, an engine configuration at a time, with a wall-time budget past which the remaining runs are
skipped (reported as such, never silently).
"""

from __future__ import annotations

import datetime
import gc
import json
import platform
import sys
import time

from prefixrt.bench.programs import WORKLOADS, ProgramWorkload
from prefixrt.bench.programs.runner import ABLATIONS, Ablation, ProgramResult, format_results, run_workload


def parse_names(text: str, known: dict, what: str) -> list[str]:
    names = list(known) if text == "all" else [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown {what} {unknown[0]!r}: one of {', '.join(known)} (or 'all')")
    return names


def engine_groups(ablations: list[Ablation]) -> list[tuple[dict, list[Ablation]]]:
    """Ablations grouped by the engine configuration they need, in first-appearance order."""
    groups: dict[tuple, tuple[dict, list[Ablation]]] = {}
    for a in ablations:
        key = tuple(sorted(a.engine.items()))
        groups.setdefault(key, (a.engine, []))[1].append(a)
    return list(groups.values())


def run_matrix(make_engine, workloads: list[ProgramWorkload], ablations: list[Ablation], preset: str, *,
               num_threads: int = 64, budget_s: float | None = None, log=print, skipped: list | None = None,
               warm_up: bool = True, warm_results: list | None = None) -> list[ProgramResult]:
    """Every workload under every ablation that applies to it. make_engine(engine_overrides) -> Engine, called
    once per engine configuration (each engine is shut down before the next is built). Runs that would start
    after budget_s seconds are skipped and appended to `skipped` as (workload, ablation, reason); a run that
    fails is logged and skipped likewise.

    warm_up: each engine first runs every workload once at the "ci" preset under its group's first ablation
    (kernels compiled, grammars of the json workload compiled and cached: costs no measured run pays alone);
    those runs of the first engine are appended to warm_results when given (the small shapes the CPU test
    suite runs, for comparing hit rates)."""
    t_start = time.perf_counter()
    results: list[ProgramResult] = []
    skipped = [] if skipped is None else skipped
    for overrides, group in engine_groups(ablations):
        runs = [(w, a) for w in workloads for a in group if a.applies(w)]
        if not runs:
            continue
        if budget_s is not None and time.perf_counter() - t_start > budget_s:
            skipped += [(w.name, a.name, "time budget") for w, a in runs]
            continue
        log(f"# engine {overrides or 'default'}: {len(runs)} runs")
        engine = make_engine(overrides)
        try:
            if warm_up:
                for w in workloads:
                    try:
                        r = run_workload(engine, w, group[0], w.sizes_for("ci"), num_threads=num_threads)
                    except Exception as e:
                        log(f"  warm-up {w.name}: {type(e).__name__}: {e}")
                        continue
                    if warm_results is not None and not results and not skipped:
                        warm_results.append(r)
            for w, a in runs:
                if budget_s is not None and time.perf_counter() - t_start > budget_s:
                    skipped.append((w.name, a.name, "time budget"))
                    continue
                try:
                    r = run_workload(engine, w, a, w.sizes_for(preset), num_threads=num_threads)
                except Exception as e:  # one broken run must not cost the others
                    log(f"  {w.name:<20} {a.name:<12} FAILED: {type(e).__name__}: {e}")
                    skipped.append((w.name, a.name, f"failed: {type(e).__name__}: {e}"))
                    continue
                results.append(r)
                log(f"  {w.name:<20} {a.name:<12} {r.duration_s:7.2f}s  {r.programs_per_s:8.2f} prog/s  "
                    f"hit {r.hit_rate:6.1%} (ideal {r.ideal_hit_rate:6.1%})")
        finally:
            engine.shutdown()
            del engine
            gc.collect()
            try:
                import torch

                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            except ImportError:
                pass
    order = {a.name: i for i, a in enumerate(ablations)}
    names = [w.name for w in workloads]
    results.sort(key=lambda r: (names.index(r.workload), order[r.ablation]))
    return results


def run_programs(args, argv) -> int:
    """The --program path of `prefixrt bench` (args from prefixrt/bench/cli.py's parser)."""
    workloads = [WORKLOADS[n] for n in parse_names(args.program, WORKLOADS, "program")]
    ablations = [ABLATIONS[n] for n in parse_names(args.ablations, ABLATIONS, "ablation")]
    meta = {"date": datetime.date.today().isoformat(), "argv": ["prefixrt", "bench", *(argv or sys.argv[1:])],
            "host": platform.node(), "python": platform.python_version(), "preset": args.preset}
    skipped: list = []
    if args.url:
        results = _run_remote(args, workloads, ablations, skipped, meta)
    else:
        from prefixrt.config.flags import progress_printer
        from prefixrt.engine.engine import Engine

        base = dict(load_format=args.load_format, device=args.device, dtype=args.dtype,
                    attention_backend=args.attention_backend, kv_cache_tokens=args.kv_cache_tokens,
                    page_size=args.page_size, schedule_policy=args.schedule_policy,
                    prefix_cache=args.prefix_cache, chunked_prefill_tokens=args.chunked_prefill_tokens,
                    max_running_requests=args.max_running_requests, seed=args.seed,
                    progress=None if args.no_progress else progress_printer())

        def make_engine(overrides):
            eng = Engine(args.model, **{**base, **overrides})
            meta.update(model=eng.model_name, device=str(eng.device))
            return eng

        results = run_matrix(make_engine, workloads, ablations, args.preset, num_threads=args.num_threads,
                             skipped=skipped)
    print(f"# LM programs ({args.preset}) | model {meta.get('model', args.model)} | device {meta.get('device', '')}"
          f" | {meta['date']}")
    print(format_results(results))
    for w, a, why in skipped:
        print(f"skipped: {w} / {a}: {why}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": [r.to_dict() for r in results], "skipped": skipped}, f, indent=1)
    if args.plot:
        from prefixrt.bench.programs.plot import plot_programs

        plot_programs(results, args.plot, title=f"LM programs | {meta.get('model', args.model)} | {meta['date']}")
        print(f"plot written to {args.plot}")
    return 1 if any(why.startswith("failed") for *_, why in skipped) else 0


def _run_remote(args, workloads, ablations, skipped, meta) -> list[ProgramResult]:
    from prefixrt.hub.registry import load_tokenizer, resolve_model
    from prefixrt.remote import RemoteEngine

    remote = RemoteEngine(args.url)
    meta.update(model=remote.model_name, device=f"server {args.url}")
    tokenizer = load_tokenizer(resolve_model(args.tokenizer or remote.model_name))
    results = []
    for w in workloads:
        for a in ablations:
            if a.engine or a.scheduler:
                skipped.append((w.name, a.name, "an engine ablation: start the server with that setting"))
            elif a.applies(w):
                try:
                    results.append(run_workload(remote, w, a, w.sizes_for(args.preset), num_threads=args.num_threads,
                                                tokenizer=tokenizer))
                except Exception as e:
                    skipped.append((w.name, a.name, f"failed: {type(e).__name__}: {e}"))
    return results
