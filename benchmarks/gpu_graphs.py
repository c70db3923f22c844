"""One H200 run for CUDA graphs beyond decode, warm start and engine release (Llama-3-8B shape, dummy
bf16). Correctness first (EXTEND graph replay vs eager inside the engine; shutdown memory), then timings:
first vs warm RAG batch, hot/cold-prefix TTFT, JSON jump-forward on/off at batch 64, constrained vs
unconstrained decode step, start-up and capture cost. Prints a table last; writes $OUT/gpu_graphs.json.

    PYTHONPATH=$PWD python benchmarks/gpu_graphs.py            # on the GPU host (<= 5 minutes)
    PYTHONPATH=$PWD python benchmarks/gpu_graphs.py --smoke    # tiny shapes on the CPU, to test the script
"""

from __future__ import annotations

import gc
import json
import os
import random
import statistics
import sys
import time

import torch

import prefixrt
from benchmarks import common as C
from benchmarks.common import forward_counts_since, log, rel_err, script_parser, set_cascade
from prefixrt.bench import runner as R
from prefixrt.bench import workloads as W
from prefixrt.engine import builder

RESULTS: dict = {}
ROWS: list[tuple[str, str, str]] = []  # (what, figure, target) for the closing table


def row(what: str, figure: str, target: str = "") -> None:
    ROWS.append((what, figure, target))
    log(f"[{time.strftime('%H:%M:%S')}] {what}: {figure} {('(target ' + target + ')') if target else ''}")
    save()


def save() -> None:
    """Write what is known so far (a run cut short still leaves its figures)."""
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_graphs.json"), "w") as f:
            json.dump({**RESULTS, "rows": ROWS}, f, indent=1, default=str)


def mem() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def check_cascade(eng, prompts: list[list[int]], smoke: bool) -> dict:
    """Greedy RAG prompts with shared-prefix decode on vs off: tokens equal, and the relative error of
    the top-5 logprobs at every decode step while the tokens agree."""
    params = {"max_new_tokens": 16 if not smoke else 4, "temperature": 0, "ignore_eos": True, "logprobs": 5}
    outs, replays = {}, {}
    for on in (True, False):
        set_cascade(eng, on)
        eng.flush_cache()
        before = eng.probes.forward_counts()
        outs[on] = eng.generate(prompts, params)
        replays[on] = forward_counts_since(eng, before)
    set_cascade(eng, True)
    errs, same = [], 0
    for a, b in zip(outs[True], outs[False]):
        same += a.token_ids == b.token_ids
        for j, (la, lb) in enumerate(zip(a.logprobs, b.logprobs)):
            if j == 0:
                continue  # the first token comes from the prefill (EXTEND), not from decode
            va = {t["token_id"]: t["logprob"] for t in la["top_logprobs"]}
            vb = {t["token_id"]: t["logprob"] for t in lb["top_logprobs"]}
            common = sorted(set(va) & set(vb))
            if common:
                errs.append(rel_err([va[t] for t in common], [vb[t] for t in common]))
            if la["token_id"] != lb["token_id"]:
                break
    return {"prompts": len(prompts), "greedy_equal": same, "decode_logprob_rel_err_max": max(errs, default=0.0),
            "replays_on": replays[True], "replays_off": replays[False]}


def check_extend_graphs(eng, vocab: int, smoke: bool) -> dict:
    """Same engine, graphs on vs off: prompts over a cached prefix with ragged new parts, so the first
    forward of each is an EXTEND batch; first-token logprobs and 4 greedy tokens compared."""
    rng = random.Random(1)
    shared = [rng.randrange(16, vocab) for _ in range(1000 if not smoke else 40)]
    prompts = [shared + [rng.randrange(16, vocab) for _ in range(rng.randint(1, 60 if not smoke else 6))]
               for _ in range(16 if not smoke else 3)]
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 5}
    outs = {}
    for on in (True, False):
        eng.probes.set_cuda_graphs(on)
        eng.flush_cache()
        eng.cache_prefix(shared)
        before = eng.probes.forward_counts()
        outs[on] = eng.generate(prompts, params)
        outs[f"replays_{on}"] = forward_counts_since(eng, before)
    eng.probes.set_cuda_graphs(True)
    errs, same = [], 0
    for a, b in zip(outs[True], outs[False]):
        la, lb = a.logprobs[0], b.logprobs[0]
        va = {t["token_id"]: t["logprob"] for t in la["top_logprobs"]}
        vb = {t["token_id"]: t["logprob"] for t in lb["top_logprobs"]}
        common = sorted(set(va) & set(vb))
        if common:
            errs.append(rel_err([va[t] for t in common], [vb[t] for t in common]))
        same += a.token_ids == b.token_ids
    return {"prompts": len(prompts), "first_token_logprob_rel_err_max": max(errs) if errs else 0.0,
            "greedy_equal": same, "replays_graphs_on": outs["replays_True"],
            "replays_graphs_off": outs["replays_False"]}


def replay_times(eng) -> dict:
    """Replay time of a few captured graphs alone (no scheduler, no copies; Engine.probes.graph_replay_ms, which
    points their K/V writes at the padding slot first)."""
    out = {}
    for kind, key, name in (("decode", 1, "decode_b1"), ("decode", 64, "decode_b64"),
                            *(("extend", k, f"extend_t{k[0]}_b{k[1]}") for k in ((96, 1), (128, 64), (256, 64),
                                                                                 (512, 64)))):
        try:
            out[name] = eng.probes.graph_replay_ms(kind, key)
        except ValueError:  # not captured at this engine's sizes
            continue
    return out


def release_check(model: str, kw: dict, baseline: int, n: int) -> list[int]:
    """Build and shut down n engines; bytes still allocated after each, relative to baseline."""
    left = []
    for i in range(n):
        with prefixrt.Engine(model, load_format="dummy", seed=i, **kw) as eng:
            eng.generate([[5, 6, 7, 8] * 10], {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True})
        gc.collect()
        left.append(mem() - baseline)
    return left


def main():
    ap = script_parser(__doc__, smoke="tiny shapes on the CPU, to test the script")
    ap.add_argument("--skip-json", action="store_true", help="leave out the JSON jump-forward rows")
    args = ap.parse_args()
    smoke = args.smoke
    on_gpu = torch.cuda.is_available() and not smoke
    big = "llama-3-8b" if not smoke else "qwen3-0.6b"
    small = "llama-3.2-1b" if not smoke else "qwen3-0.6b"
    kw = {} if not smoke else dict(device="cpu", attention_backend="torch", kv_cache_tokens=4000)
    t_start = time.perf_counter()
    if on_gpu:
        x = torch.randn(64, 64, device="cuda")
        (x @ x).sum().item()  # CUDA context and cuBLAS workspace exist before the memory baseline
        del x
        builder.clear_blas_workspaces()  # shutdown() drops them too
    baseline = mem()

    # ---------------------------------------------------------------- start-up, then the first RAG batch
    t = time.perf_counter()
    eng = prefixrt.Engine(big, load_format="dummy", cascade_decode=True, **kw)  # toggled per section below
    RESULTS["engine_up_s"] = time.perf_counter() - t
    RESULTS["startup"] = st = eng.probes.facts()["startup"]
    RESULTS["mem_after_startup_GiB"] = mem() / 2**30
    row("start-up (8B dummy)", f"{RESULTS['engine_up_s']:.1f}s (weights {st.get('load_s', 0):.1f}s, warm-up "
        f"{st.get('warm_up_s', 0):.1f}s, capture {st.get('capture_s', 0):.1f}s)")
    for line in st.get("graphs", []):
        log("  " + line)
    vocab = eng.vocab_size
    rag = W.rag(vocab) if not smoke else W.rag(vocab, requests=4, shared_len=64, unique_len=8, output_len=4)
    first = R.run_workload(eng, rag, "RAG first after start-up", show_progress=False)
    eng.flush_cache()
    warm = R.run_workload(eng, rag, "RAG warm", show_progress=False)
    log(R.format_table([first, warm]))
    RESULTS["rag_first"], RESULTS["rag_warm"] = first.to_dict(), warm.to_dict()
    ratio = first.output_throughput / warm.output_throughput
    row("RAG first batch / warm (out tok/s)", f"{first.output_throughput:.0f} / {warm.output_throughput:.0f} = "
        f"{ratio:.2f}; TTFT p50 {first.ttft_ms.get('p50', 0):.0f} vs {warm.ttft_ms.get('p50', 0):.0f} ms",
        ">= 0.90")

    # ---------------------------------------------------------------- shared-prefix (cascade) decode
    if eng.probes.facts()["cascade"] or smoke:
        RESULTS["check_cascade"] = cc = check_cascade(eng, [s[0].new_tokens for s in rag.sessions], smoke)
        row("cascade vs plain decode (RAG, 64 prompts: greedy equal, logprob rel err max)",
            f"{cc['greedy_equal']}/{cc['prompts']}, {cc['decode_logprob_rel_err_max']:.3g} "
            f"(cascade replays {cc['replays_on'].get('cascade', 0)})", ">= 95%, <= 1e-2")
        set_cascade(eng, False)
        eng.flush_cache()
        plain = R.run_workload(eng, rag, "RAG plain decode", show_progress=False)
        set_cascade(eng, True)
        RESULTS["rag_plain_decode"] = plain.to_dict()
        row("RAG out tok/s cascade on / off (token ids, in-process)",
            f"{warm.output_throughput:.0f} / {plain.output_throughput:.0f} = "
            f"{warm.output_throughput / plain.output_throughput:.2f}x; TPOT p50 {warm.tpot_ms.get('p50', 0):.2f} "
            f"vs {plain.tpot_ms.get('p50', 0):.2f} ms", ">= 9000 with text")
    else:
        row("cascade decode", "off (no prefix grouper: no cascade graphs)")

    # ---------------------------------------------------------------- correctness: graphs on vs off
    RESULTS["check_extend_graphs"] = chk = check_extend_graphs(eng, vocab, smoke)
    row("EXTEND graphs vs eager (first-token top-5 logprob rel err max, greedy equal of 4)",
        f"{chk['first_token_logprob_rel_err_max']:.3g}, {chk['greedy_equal']}/{chk['prompts']} "
        f"(extend replays {chk['replays_graphs_on'].get('extend', 0)})", "bf16 <= 2e-2")

    # ---------------------------------------------------------------- hot / cold prefix TTFT
    case = C.HotPrefix(eng, vocab, 3500 if not smoke else 64, 80 if not smoke else 8)
    with eng.probes.time_units(("step",), fence_wait=False, record_calls=True) as loop_steps:
        hot = case.hot(20)
    steps = [r["wall_s"] for r in loop_steps.records]
    RESULTS["ttft_hot_step_ms_p50"] = statistics.median(steps) * 1000 if steps else 0.0
    eng.probes.set_cuda_graphs(False)
    hot_eager = case.hot(7)
    eng.probes.set_cuda_graphs(True)
    cold = case.cold(3)
    RESULTS["ttft_hot_ms"] = {"p50": statistics.median(hot) * 1000, "p99": pct(hot, 0.99) * 1000,
                              "all": [x * 1000 for x in hot]}
    RESULTS["ttft_hot_eager_ms_p50"] = statistics.median(hot_eager) * 1000
    RESULTS["ttft_cold_ms_p50"] = statistics.median(cold) * 1000
    row("hot-prefix TTFT p50 / p99 (3500 cached + 80 new, 20 req)",
        f"{RESULTS['ttft_hot_ms']['p50']:.2f} / {RESULTS['ttft_hot_ms']['p99']:.2f} ms "
        f"(eager p50 {RESULTS['ttft_hot_eager_ms_p50']:.2f}; loop step p50 {RESULTS['ttft_hot_step_ms_p50']:.2f})",
        "<= 10 / <= 15 ms")
    row("cold TTFT p50 (3580 new)", f"{RESULTS['ttft_cold_ms_p50']:.1f} ms")

    # ---------------------------------------------------------------- JSON jump-forward
    if not args.skip_json:
        try:
            # jump-forward on twice: the second run is the figure (the first warms its shapes)
            RESULTS["json"] = js = C.json_bench(eng, vocab, 64 if not smoke else 4, order=(True, False, True),
                                                instrument=False)
            row("JSON jump-forward on / off (batch 64, out tok/s)",
                f"{js['jf_on']['tok_s']:.0f} / {js['jf_off']['tok_s']:.0f} = {js['jf_speedup']:.2f}x "
                f"(passes {js['jf_on']['forward_passes']} vs {js['jf_off']['forward_passes']}; valid "
                f"{js['jf_on']['valid']}/{js['jf_off']['valid']}; on-run replays {js['jf_on']['replays']})",
                ">= 1.6x")
            row("constrained / unconstrained decode step",
                f"{js['jf_off']['step_ms']:.2f} / {js['unconstrained']['step_ms']:.2f} ms = "
                f"{js['constrained_step_over_unconstrained']:.2f}", "<= 1.10")
        except ImportError as e:
            row("JSON jump-forward", f"skipped: {e}")
    RESULTS["replays_total"] = eng.probes.forward_counts()
    if on_gpu:
        RESULTS["replay_ms"] = replay_times(eng)
        row("graph replay alone (ms)", json.dumps({k: round(v, 2) for k, v in RESULTS["replay_ms"].items()}))

    # ---------------------------------------------------------------- release: this engine + two more
    eng.shutdown()
    eng = None
    gc.collect()
    RESULTS["release_left_bytes"] = left = [mem() - baseline]
    if on_gpu and time.perf_counter() - t_start < 200:  # CPU engines keep their memory until collected
        left += release_check(small, kw, baseline, 2)
    row("memory left after shutdown (bytes, per engine)", str(left), "all 0")

    RESULTS["total_s"] = time.perf_counter() - t_start
    save()
    log("")
    log(f"{'what':<62} {'figure':<70} target")
    for what, fig, target in ROWS:
        log(f"{what:<62} {fig:<70} {target}")
    log(f"total {RESULTS['total_s']:.0f}s")


if __name__ == "__main__":
    sys.exit(main())
