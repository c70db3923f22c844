"""Engine start-up per configuration (bf16, FP8 weights, FP8 K/V, both): each configuration started in a process of
its own with an empty compile cache (a freshly started machine), then again over the cache that start filled;
per start the seconds of each start-up stage (the engine's `start-up:` line), the Triton kernels it built or
loaded, the KV pool; with --profile, the functions one more cold start of that configuration spends its time in
(cProfile, cumulative). The ratio to bf16's cold start is the FP8 start-up line of docs/benchmarks.md.

    PYTHONPATH=$PWD python benchmarks/gpu_startup.py [--model llama-3-8b] [--configs bf16,fp8,kv,fp8+kv] [--profile fp8+kv]
    PYTHONPATH=$PWD python benchmarks/gpu_startup.py --smoke      # the same logic on the CPU: tiny checkpoint
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import log, log_table, script_parser, tiny_model_dir, write_results

CONFIGS = {
    "bf16": {},
    "fp8": {"quantization": "fp8"},
    "kv": {"kv_cache_dtype": "fp8_e4m3"},
    "fp8+kv": {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"},
}
RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPORT = "STARTUP "  # the line a child prints its report on


def start_once(model: str, label: str, cache: str, smoke: bool, profile: bool) -> dict:
    """One engine start (in this process): its start-up report, and the top functions when profiled."""
    import prefixrt

    kw = {**CONFIGS[label], "compile_cache_dir": cache}
    if smoke:
        kw.update(device="cpu", kv_cache_tokens=2048, max_running_requests=4)
    prof = cProfile.Profile() if profile else None
    t = time.perf_counter()
    if prof:
        prof.enable()
    eng = prefixrt.Engine(model, load_format="auto" if smoke else "dummy", **kw)
    if prof:
        prof.disable()
    wall = time.perf_counter() - t
    facts = eng.probes.facts()
    startup = facts["startup"]
    out = {"wall_s": round(wall, 2), "total_s": round(startup.get("total_s", wall), 2),
           "stages": {k: round(v, 2) for k, v in startup.get("stages", {}).items()},
           "compile": startup.get("compile"), "parallel_builds": startup.get("parallel_builds"),
           "kv_pool_tokens": eng.kv_total_tokens, "kv_dtype": facts.get("kv_dtype")}
    eng.generate([[5, 6, 7, 8]], {"max_new_tokens": 2})  # it serves
    eng.shutdown()
    if prof:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
        out["profile_top"] = [line for line in text.getvalue().splitlines() if line.strip()][-41:]
    return out


def start_in_child(model: str, label: str, cache: str, smoke: bool, profile: bool) -> dict:
    """start_once in a fresh Python process (nothing compiled or imported before it)."""
    cmd = [sys.executable, __file__, "--child", label, "--model", model, "--cache", cache]
    cmd += ["--smoke"] * smoke + ["--profile", label] * profile
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    reports = [line[len(REPORT):] for line in p.stdout.splitlines() if line.startswith(REPORT)]
    if p.returncode != 0 or not reports:
        raise RuntimeError(f"{label} start failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return json.loads(reports[-1])


def top_stages(report: dict, n: int = 3) -> str:
    stages = sorted(report["stages"].items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{k} {v:.1f}s" for k, v in stages)


def main() -> None:
    ap = script_parser(__doc__, smoke="the same logic on the CPU: tiny checkpoint, each start in its own process")
    ap.add_argument("--model", default="llama-3-8b", help="registry name or local folder (dummy weights)")
    ap.add_argument("--configs", default="bf16,fp8,kv,fp8+kv", help=f"a comma list of {', '.join(CONFIGS)}")
    ap.add_argument("--profile", default="", help="a configuration to start once more, cold, under cProfile")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--cache", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        report = start_once(args.model, args.child, args.cache, args.smoke, args.profile == args.child)
        print(REPORT + json.dumps(report, default=str), flush=True)
        return
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs + [args.profile] * bool(args.profile) if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configurations {unknown}; known: {', '.join(CONFIGS)}")
    tmp = tempfile.TemporaryDirectory(prefix="prefixrt-startup-")
    model = str(tiny_model_dir(Path(tmp.name))) if args.smoke else args.model
    results: dict = {"model": "tiny-llama (CPU)" if args.smoke else args.model, "runs": {}}
    for label in configs:
        cache = str(Path(tmp.name) / f"cache-{label}")
        cold = start_in_child(model, label, cache, args.smoke, False)
        warm = start_in_child(model, label, cache, args.smoke, False)
        results["runs"][label] = {"cold": cold, "warm": warm}
        log(f"[{label}] cold {cold['total_s']}s ({top_stages(cold)}); warm {warm['total_s']}s ({top_stages(warm)})")
    if args.profile:
        cache = str(Path(tmp.name) / "cache-profiled")
        results["profile"] = {"config": args.profile,
                              **start_in_child(model, args.profile, cache, args.smoke, True)}
        log("\n".join(results["profile"]["profile_top"]))
    write_results(results, "gpu-startup.json", None if args.smoke else RESULTS_DIR)
    base = results["runs"].get("bf16", {}).get("cold", {}).get("total_s")
    rows = []
    for label, run in results["runs"].items():
        cold, warm = run["cold"], run["warm"]
        ratio = f"{cold['total_s'] / base:.2f}x bf16" if base else ""
        rows.append((label, f"cold {cold['total_s']:.1f}s  warm {warm['total_s']:.1f}s",
                     f"{ratio}; cold: {top_stages(cold)}; pool {cold['kv_pool_tokens']} ({cold['kv_dtype']})"))
    log_table(rows, 26)


if __name__ == "__main__":
    main()
