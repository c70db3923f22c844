"""One H200 run for the engine loop on the Llama-3-8B shape with dummy weights (bf16): (a) the RAG case
(64 x (3500 shared + 80 unique), 200 out, concurrency 64) streamed WITH text, overlap on and off, and the
first batch after start-up against a warm one; (b) decode at batch 64 and 256: wall time per step against the
captured graph replayed alone; (c) greedy outputs overlap on vs off on 64 prompts; (d) the no-reuse `random`
case, radix vs no-radix, median of 3 interleaved runs; (e) hot-prefix TTFT and constrained JSON (jump-forward
on/off, constrained vs unconstrained step); (f) shared-prefix (cascade) decode on vs off. Prints a short table last
and writes JSON to $OUT/gpu_engine.json.

Environment: OUT (the JSON's folder; profiles too); CASCADE=0|1 builds the engine without / with cascade decode
(default: the engine's); GRAMMAR_BACKENDS=llguidance,xgrammar runs (e)'s JSON part on each; MASK_THREADS=a,b times
the mask fill per executor thread count; TORCH_PROFILE=1 (TORCH_TRACE=1: also a Chrome trace) profiles (b) and (e);
PYSPY=path samples the GIL holder at batch 256; CASCADE_TORCH_BASELINE=1 adds (f)'s torch-backend baseline;
CASCADE_FP32=0 skips (f)'s fp32 engine.

    PYTHONPATH=$PWD python benchmarks/gpu_engine.py            # on the GPU host
    PYTHONPATH=$PWD python benchmarks/gpu_engine.py --smoke    # tiny shapes on the CPU, to test the script
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
from benchmarks.common import PhaseTimer, StepLog, log, rel_err, script_parser
from prefixrt.bench import runner as R
from prefixrt.bench import workloads as W

RESULTS: dict = {}


def free(eng):
    """Shut down and drop the engine's GPU memory (the caller must drop its own reference too)."""
    eng.shutdown()  # releases the model, the pool and the graphs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def set_overlap(eng, on: bool) -> None:
    eng.probes.set_overlap(on)


def rag_text(eng, w, concurrency: int = 64) -> dict:
    prompts = [s[0].new_tokens for s in w.sessions]
    return C.stream_text(eng, prompts, w.sessions[0][0].max_new_tokens, concurrency)


def replay_ms(eng, bs: int, iters: int = 20) -> float:
    """The captured decode graph of bucket bs replayed alone (its static batch as the last step left it)."""
    return eng.probes.graph_replay_ms("decode", bs, iters)


def in_loop_replay_ms(eng, prompts: list[list[int]], steps: int) -> float:
    """Median device time of the decode graph replays of one timed decode run, measured with CUDA events
    recorded around each decode forward in the loop (Engine.probes.log_forwards: what the GPU spends on the
    forward itself)."""
    eng.generate(prompts, {"max_new_tokens": 0})
    with eng.probes.log_forwards() as forwards:
        eng.generate(prompts, {"temperature": 0, "ignore_eos": True, "detokenize": False, "max_new_tokens": 1 + steps})
    times = sorted(r["device_ms"] for r in forwards.rows[1:] if r["kind"] == "decode")
    IN_LOOP_SPREAD.append({"p10": times[len(times) // 10], "p50": times[len(times) // 2],
                           "p90": times[len(times) * 9 // 10], "max": times[-1]})
    return times[len(times) // 2]


IN_LOOP_SPREAD: list[dict] = []  # the spread of each in_loop_replay_ms call's replays


def decode_step_ms(eng, prompts: list[list[int]], steps: int) -> float:
    """Wall time per decode step at batch len(prompts): prompts cached first, then (1 + steps) tokens minus
    1 token, over `steps` steps."""
    eng.generate(prompts, {"max_new_tokens": 0})
    p = {"temperature": 0, "ignore_eos": True, "detokenize": False}
    t0 = time.perf_counter()
    eng.generate(prompts, {**p, "max_new_tokens": 1})
    t1 = time.perf_counter()
    eng.generate(prompts, {**p, "max_new_tokens": 1 + steps})
    t2 = time.perf_counter()
    return ((t2 - t1) - (t1 - t0)) / steps * 1000


def _compare(xs, ys) -> dict:
    """Greedy runs xs vs ys: identical outputs, and over the positions before the first diverging token the
    largest absolute and the largest relative (norm) difference of the top-20 logprobs."""
    same, abs_err, max_rel = 0, 0.0, 0.0
    for a, b in zip(xs, ys):
        same += a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            va = {t["token_id"]: t["logprob"] for t in la["top_logprobs"]}
            vb = {t["token_id"]: t["logprob"] for t in lb["top_logprobs"]}
            common = sorted(set(va) & set(vb))
            abs_err = max([abs_err] + [abs(va[t] - vb[t]) for t in common])
            max_rel = max(max_rel, rel_err([va[t] for t in common], [vb[t] for t in common]))
            if la["token_id"] != lb["token_id"]:
                break
    return {"identical": same, "fraction_identical": same / len(xs), "max_abs_logprob_diff": abs_err,
            "max_rel_logprob_err": max_rel}


def overlap_exactness(eng, vocab: int, n: int, new_tokens: int, scale: int = 1) -> dict:
    """Greedy outputs with overlap on vs off (same engine, cache flushed between runs). Baseline in the same
    run: overlap off against overlap off with the prompts submitted in reverse order (other batch
    compositions), which is what bf16 batch-shape noise alone does."""
    rng = random.Random(21)
    shared = [rng.randrange(16, vocab) for _ in range(256 // scale)]
    prompts = [shared[: rng.randint(8, 256 // scale)] + [rng.randrange(16, vocab) for _ in range(rng.randint(4, 200 // scale))]
               for _ in range(n)]
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 20}
    outs = {}
    for key, overlap, order in (("on", True, 1), ("off", False, 1), ("off_reversed", False, -1)):
        set_overlap(eng, overlap)
        eng.flush_cache()
        res = eng.generate(prompts[::order], params)
        outs[key] = res[::order]
    # Prompts that share nothing: both loops then run the same batch compositions (with shared prefixes the
    # overlapped loop publishes a prefill chunk one step later, so followers join other batches), which
    # isolates the loop itself from bf16 batch-shape noise.
    unique = [[rng.randrange(16, vocab) for _ in range(rng.randint(12, 456 // scale))] for _ in range(n)]
    for key, overlap in (("unique_on", True), ("unique_off", False)):
        set_overlap(eng, overlap)
        eng.flush_cache()
        outs[key] = eng.generate(unique, params)
    set_overlap(eng, True)
    return {"prompts": n, "on_vs_off": _compare(outs["on"], outs["off"]),
            "baseline_off_vs_off_reversed": _compare(outs["off_reversed"], outs["off"]),
            "unique_prompts_on_vs_off": _compare(outs["unique_on"], outs["unique_off"])}


def cascade_agreement(eng, prompts, new_tokens: int) -> dict:
    """Greedy RAG prompts with shared-prefix decode on vs off, and the same-run baseline of plain decode
    against plain decode with the prompts in reverse order (other batch compositions)."""
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 20}
    outs = {}
    for key, on, order in (("on", True, 1), ("off", False, 1), ("off_reversed", False, -1)):
        eng.probes.set_cascade(on)
        eng.flush_cache()
        before = eng.probes.forward_counts()
        outs[key] = eng.generate(prompts[::order], params)[::order]
        outs[key + "_replays"] = C.forward_counts_since(eng, before)
    eng.probes.set_cascade(True)
    return {"prompts": len(prompts), "on_vs_off": _compare(outs["on"], outs["off"]),
            "baseline_off_vs_off_reversed": _compare(outs["off_reversed"], outs["off"]),
            "replays_on": outs["on_replays"], "replays_off": outs["off_replays"]}


def section_f(eng, rag, smoke, summary) -> None:
    """Shared-prefix (cascade) decode: RAG streamed with text on vs off (interleaved, best of 2), greedy
    agreement in bf16 with its same-run baseline, and the same agreement on an fp32 engine."""
    if not eng.probes.facts()["cascade"]:
        summary.append(("cascade decode", "off (engine built without cascade graphs)", "set CASCADE=1"))
        return
    runs = {True: [], False: []}
    for on in (True, False, True, False):
        eng.probes.set_cascade(on)
        eng.flush_cache()
        runs[on].append(rag_text(eng, rag))
    eng.probes.set_cascade(True)
    best = {k: max(v, key=lambda r: r["out_tok_s"]) for k, v in runs.items()}
    prompts = [s[0].new_tokens for s in rag.sessions]
    agree = cascade_agreement(eng, prompts, 16 if not smoke else 4)
    RESULTS["cascade"] = {"rag_text_on": best[True], "rag_text_off": best[False], "bf16": agree}
    eng.flush_cache()
    summary.append(("RAG text, cascade on / off (warm, overlap on)",
                    f"{best[True]['out_tok_s']:.0f} / {best[False]['out_tok_s']:.0f} tok/s",
                    f"{best[True]['out_tok_s'] / best[False]['out_tok_s']:.2f}x; TTFT p50 {best[True]['ttft_p50_ms']} ms"))
    for label, key in (("cascade vs plain, bf16, 64 RAG prompts x 16", "on_vs_off"),
                       ("  baseline: plain vs plain, reversed order", "baseline_off_vs_off_reversed")):
        c = agree[key]
        summary.append((label, f"{c['identical']}/{agree['prompts']} identical",
                        f"top-20 logprobs max abs {c['max_abs_logprob_diff']:.4f}, max rel {c['max_rel_logprob_err']:.2e}"))
    if smoke or not torch.cuda.is_available():
        return
    if os.environ.get("CASCADE_TORCH_BASELINE") == "1":
        # Two correct implementations of plain attention, same weights: the Triton backend (cascade off) and the
        # torch backend. How often they agree is the bf16 noise floor for the cascade-vs-plain figure.
        params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True, "logprobs": 20}
        eng.probes.set_cascade(False)
        eng.flush_cache()
        plain = eng.generate(prompts, params)
        eng.probes.set_cascade(True)
        eng.flush_cache()
        casc = eng.generate(prompts, params)
        eng.flush_cache()
        ref = prefixrt.Engine(eng.model_name, load_format="dummy", attention_backend="torch", cuda_graph=False,
                              kv_cache_tokens=len(prompts) * 3900)
        try:
            same_weights = all(torch.equal(a, b) for a, b in zip(list(eng.probes.model.parameters())[:3],
                                                                 list(ref.probes.model.parameters())[:3]))
            torch_out = ref.generate(prompts, params)
        finally:
            ref.shutdown()
        RESULTS["cascade"]["torch_backend"] = {"same_weights": same_weights,
                                               "triton_plain_vs_torch": _compare(plain, torch_out),
                                               "triton_cascade_vs_torch": _compare(casc, torch_out)}
        for label, key in (("  plain Triton vs torch backend, bf16", "triton_plain_vs_torch"),
                           ("  cascade Triton vs torch backend, bf16", "triton_cascade_vs_torch")):
            c = RESULTS["cascade"]["torch_backend"][key]
            summary.append((label, f"{c['identical']}/{len(prompts)} identical",
                            f"max rel {c['max_rel_logprob_err']:.2e} (same weights: {same_weights})"))
    if os.environ.get("CASCADE_FP32") == "0":
        return
    small = prefixrt.Engine("llama-3.2-1b", load_format="dummy", dtype="float32", cascade_decode=True,
                            kv_cache_tokens=300_000)
    try:
        w = W.rag(small.vocab_size)
        agree32 = cascade_agreement(small, [s[0].new_tokens for s in w.sessions], 16)
    finally:
        small.shutdown()
    RESULTS["cascade"]["fp32_1b"] = agree32
    for label, key in (("cascade vs plain, fp32 (1B shape), 64 RAG x 16", "on_vs_off"),
                       ("  baseline: plain vs plain, reversed order", "baseline_off_vs_off_reversed")):
        c = agree32[key]
        summary.append((label, f"{c['identical']}/{agree32['prompts']} identical",
                        f"max abs {c['max_abs_logprob_diff']:.2e}, max rel {c['max_rel_logprob_err']:.2e}; "
                        f"cascade replays {agree32['replays_on'].get('cascade', 0)}"))


def main():
    ap = script_parser(__doc__, smoke="tiny shapes on the CPU, to test the script")
    ap.add_argument("--only", default="abcde", help="sections to run, any of abcdef (default abcde)")
    args = ap.parse_args()
    smoke = args.smoke
    big = "llama-3-8b" if not smoke else "qwen3-0.6b"
    t_start = time.perf_counter()
    cuda = torch.cuda.is_available() and not smoke
    # Both engines stay up for the interleaved radix/no-radix runs: fixed pools that fit the random case.
    kv_tokens = 330_000 if not smoke else 3000
    kw = dict(load_format="dummy", kv_cache_tokens=kv_tokens)
    if os.environ.get("CASCADE") is not None:  # CASCADE=1: build with shared-prefix decode (section f toggles it)
        kw["cascade_decode"] = os.environ["CASCADE"] == "1"
    if smoke:
        kw.update(device="cpu", attention_backend="torch")
    summary = []  # (what, value, note)

    t = time.perf_counter()
    eng = prefixrt.Engine(big, **kw)
    RESULTS["startup_s"] = time.perf_counter() - t
    log(f"engine up in {RESULTS['startup_s']:.1f}s")
    vocab = eng.vocab_size
    RESULTS["cuda_graphs"] = eng.probes.facts()["cuda_graphs"]
    # (a) RAG streamed with text, in-process: the first batch after start-up, then warm, overlap on and off.
    rag = W.rag(vocab) if not smoke else W.rag(vocab, requests=4, shared_len=64, unique_len=8, output_len=4)
    sections = {"a": lambda: section_a(eng, rag, summary), "b": lambda: section_b(eng, vocab, smoke, cuda, summary),
                "c": lambda: section_c(eng, vocab, smoke, summary), "e": lambda: section_e(eng, vocab, smoke, big, kw, summary),
                "f": lambda: section_f(eng, rag, smoke, summary),
                "d": lambda: section_d(eng, vocab, smoke, big, kw, summary)}
    for key, run in sections.items():
        if key in args.only:
            t = time.perf_counter()
            try:
                run()
            except Exception:  # report and go on: one failing section must not lose the others' figures
                import traceback

                traceback.print_exc()
                summary.append((f"section {key}", "FAILED", traceback.format_exc().splitlines()[-1][:120]))
            log(f"section {key}: {time.perf_counter() - t:.0f}s")

    free(eng)
    eng = None

    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_engine.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
    log(json.dumps(RESULTS, indent=1, default=str))
    log(f"\nprefixrt {big} dummy {'bf16 on ' + torch.cuda.get_device_name() if cuda else 'fp32 on the CPU (smoke)'}, "
        f"total {time.perf_counter() - t_start:.0f}s, start-up {RESULTS['startup_s']:.0f}s")
    w = max([len(a) for a, _, _ in summary] + [1])
    for a, b, c in summary:
        log(f"{a:<{w}}  {b:<28}  {c}")


def section_a(eng, rag, summary) -> None:
    """RAG streamed with text, in-process: the first batch after start-up, then warm, overlap on and off."""
    first = rag_text(eng, rag)
    eng.flush_cache()
    warm = {}
    for overlap in (True, False, True):
        set_overlap(eng, overlap)
        warm.setdefault(overlap, []).append(rag_text(eng, rag))
        eng.flush_cache()
    set_overlap(eng, True)
    best = {k: max(v, key=lambda r: r["out_tok_s"]) for k, v in warm.items()}
    RESULTS["rag_text"] = {"first_after_startup": first, "warm_overlap_on": best[True], "warm_overlap_off": best[False]}
    # Where the warm run's time goes: every forward's kind, device time and wall time to the next launch.
    steps = StepLog(eng).install()
    logged = rag_text(eng, rag)
    steps.uninstall()
    eng.flush_cache()
    RESULTS["rag_steps"] = {"run": logged, "by_kind": steps.summary(),
                            "device_ms_total": round(sum(r["device_ms"] or 0.0 for r in steps.rows), 1),
                            "forwards": len(steps.rows)}
    log("RAG steps", RESULTS["rag_steps"])
    # The GIL switch interval: the loop thread, the detokenizer worker and the 64 streaming consumers share
    # the GIL; a shorter interval lets the loop take it back sooner. Interleaved, best of 2 each.
    default_interval = sys.getswitchinterval()
    by_interval: dict = {}
    for interval in (default_interval, 0.0005, default_interval, 0.0005):
        sys.setswitchinterval(interval)
        try:
            by_interval.setdefault(interval, []).append(rag_text(eng, rag))
        finally:
            sys.setswitchinterval(default_interval)
        eng.flush_cache()
    RESULTS["rag_switch_interval"] = {str(k): max(v, key=lambda r: r["out_tok_s"]) for k, v in by_interval.items()}
    summary.append(("RAG text, GIL switch 5 ms (default) / 0.5 ms",
                    " / ".join(f"{max(v, key=lambda r: r['out_tok_s'])['out_tok_s']:.0f}" for v in by_interval.values()),
                    "tok/s, best of 2 interleaved"))
    log("RAG text", RESULTS["rag_text"])
    summary += [("RAG text, overlap on (warm)", f"{best[True]['out_tok_s']:.0f} tok/s", f"TTFT p50 {best[True]['ttft_p50_ms']} ms"),
                ("RAG text, overlap off (warm)", f"{best[False]['out_tok_s']:.0f} tok/s", f"TTFT p50 {best[False]['ttft_p50_ms']} ms"),
                ("RAG text, first batch after start-up", f"{first['out_tok_s']:.0f} tok/s",
                 f"{first['out_tok_s'] / best[True]['out_tok_s']:.2f}x warm, TTFT p50 {first['ttft_p50_ms']} ms")]



def section_b(eng, vocab, smoke, cuda, summary) -> None:
    """Decode at batch 64 and 256: wall time per step vs the captured graph replayed alone."""
    dec = {}
    for bs in (64, 256) if not smoke else (2, 4):
        rng = random.Random(bs)
        prompts = [[rng.randrange(16, vocab) for _ in range(1024 if not smoke else 16)] for _ in range(bs)]
        row = {}
        for overlap in (True, False):
            set_overlap(eng, overlap)
            eng.flush_cache()
            row["step_ms_overlap_on" if overlap else "step_ms_overlap_off"] = decode_step_ms(eng, prompts, 64 if not smoke else 4)
        set_overlap(eng, True)
        if cuda and RESULTS["cuda_graphs"]:  # right after the timed runs: the static batch holds their contexts
            row["replay_ms"] = replay_ms(eng, bs)
            # The same graph replayed back to back for as many steps as a timed run has and more (clocks
            # under sustained load), then the short burst again.
            row["replay_ms_sustained_200"] = replay_ms(eng, bs, iters=200)
            row["replay_ms_again_20"] = replay_ms(eng, bs)
            row["on_over_replay"] = row["step_ms_overlap_on"] / row["replay_ms"]
            row["off_over_replay"] = row["step_ms_overlap_off"] / row["replay_ms"]
        if cuda and RESULTS["cuda_graphs"]:
            # The decode graph's device time inside the loop (events around each replay), for the same run.
            row["step_ms_overlap_on_again"] = decode_step_ms(eng, prompts, 64)
            row["in_loop_replay_ms"] = in_loop_replay_ms(eng, prompts, 64)
            row["on_over_in_loop_replay"] = row["step_ms_overlap_on_again"] / row["in_loop_replay_ms"]
            row["in_loop_spread"] = IN_LOOP_SPREAD[-1]
            # The same with a 0.5 ms GIL switch interval: a replay delayed by another thread holding the GIL
            # shows up as a longer in-loop time (the GPU waits between the start event and the launch).
            interval = sys.getswitchinterval()
            sys.setswitchinterval(0.0005)
            try:
                row["step_ms_switch_0p5ms"] = decode_step_ms(eng, prompts, 64)
                row["in_loop_replay_ms_switch_0p5ms"] = in_loop_replay_ms(eng, prompts, 64)
                row["in_loop_spread_switch_0p5ms"] = IN_LOOP_SPREAD[-1]
            finally:
                sys.setswitchinterval(interval)
            summary.append((f"decode b{bs}: in-loop replay p10/p50/p90, default / 0.5 ms GIL switch",
                            "/".join(f"{row['in_loop_spread'][k]:.1f}" for k in ("p10", "p50", "p90")) + " / " +
                            "/".join(f"{row['in_loop_spread_switch_0p5ms'][k]:.1f}" for k in ("p10", "p50", "p90")),
                            f"step {row['step_ms_overlap_on_again']:.2f} / {row['step_ms_switch_0p5ms']:.2f} ms"))
        # Where a step's time goes (overlap on): the units' wall time per step, the device wait inside process.
        eng.flush_cache()
        eng.generate(prompts, {"max_new_tokens": 0})
        steps = 64 if not smoke else 4
        timer = PhaseTimer(eng).install()
        eng.generate(prompts, {"temperature": 0, "ignore_eos": True, "detokenize": False, "max_new_tokens": steps})
        timer.uninstall()
        row["phases_ms_per_step"] = timer.per_step_ms(steps)
        spy = os.environ.get("PYSPY")  # a py-spy binary: sample the thread holding the GIL over 240 steps
        if spy and bs == 256 and os.environ.get("OUT"):
            import subprocess
            path = os.path.join(os.environ["OUT"], f"pyspy_b{bs}.txt")
            eng.generate(prompts, {"max_new_tokens": 0})
            proc = subprocess.Popen([spy, "record", "--pid", str(os.getpid()), "--gil", "--rate", "250",
                                     "--duration", "5", "--format", "raw", "--output", path],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            time.sleep(1.0)
            eng.generate(prompts, {"temperature": 0, "ignore_eos": True, "detokenize": False, "max_new_tokens": 240})
            proc.wait(timeout=30)
        if cuda and os.environ.get("TORCH_PROFILE") and os.environ.get("OUT"):
            row["profile"] = C.torch_profile(eng, prompts, f"b{bs}", {"temperature": 0, "ignore_eos": True,
                                                                    "detokenize": False, "max_new_tokens": 10})
        dec[f"b{bs}"] = row
        log(f"decode b{bs}", row)
        if "replay_ms_sustained_200" in row:
            summary.append((f"decode b{bs}: replay alone x20 / x200 / x20 again",
                            f"{row['replay_ms']:.2f} / {row['replay_ms_sustained_200']:.2f} / "
                            f"{row['replay_ms_again_20']:.2f} ms",
                            f"step / sustained {row['step_ms_overlap_on'] / row['replay_ms_sustained_200']:.3f}x"))
        if "in_loop_replay_ms" in row:
            summary.append((f"decode b{bs}: step again / in-loop graph time", f"{row['step_ms_overlap_on_again']:.2f} / "
                            f"{row['in_loop_replay_ms']:.2f} ms", f"{row['on_over_in_loop_replay']:.3f}x"))
        summary.append((f"decode b{bs} step (ctx ~1.1k)", f"on {row['step_ms_overlap_on']:.2f} / off {row['step_ms_overlap_off']:.2f} ms",
                        f"replay {row['replay_ms']:.2f} ms: {row['on_over_replay']:.3f}x / {row['off_over_replay']:.3f}x"
                        if "replay_ms" in row else "no graphs"))
        eng.flush_cache()
    RESULTS["decode"] = dec



def section_c(eng, vocab, smoke, summary) -> None:
    """Greedy outputs overlap on vs off (bf16)."""
    ex = overlap_exactness(eng, vocab, 64 if not smoke else 4, 32 if not smoke else 4, 1 if not smoke else 8)
    RESULTS["overlap_exactness"] = ex
    log("overlap exactness", ex)
    for label, key in (("greedy on vs off (64 prompts, shared-prefix tree)", "on_vs_off"),
                       ("  baseline: off vs off, reversed", "baseline_off_vs_off_reversed"),
                       ("greedy on vs off (64 prompts sharing nothing)", "unique_prompts_on_vs_off")):
        c = ex[key]
        summary.append((label, f"{c['identical']}/{ex['prompts']} identical",
                        f"top-20 logprobs: max abs {c['max_abs_logprob_diff']:.4f}, max rel {c['max_rel_logprob_err']:.2e}"))


def section_e(eng, vocab, smoke, big, kw, summary) -> None:
    """Hot-prefix TTFT over 20 requests (p50/p99, with the loop units of those steps), cold TTFT, and the
    constrained JSON step against the unconstrained one at batch 64 (jump-forward on/off)."""
    case = C.HotPrefix(eng, vocab, 3500 if not smoke else 40, 80 if not smoke else 8)
    timer = PhaseTimer(eng).install()
    steps = StepLog(eng).install()
    s0 = eng.stats().forward_passes_total
    hot_in_order = case.hot(20)
    hot = sorted(hot_in_order)
    timer.uninstall()
    steps.uninstall()
    phases = timer.per_step_ms(max(1, eng.stats().forward_passes_total - s0))
    # Where a slow one comes from: Python's garbage collector (its pauses, timed by gc.callbacks) and the GIL
    # hand-off between threads (20 more requests with a 0.5 ms switch interval instead of 5 ms).
    import gc as _gc
    pauses, started = [], []

    def on_gc(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append((info.get("generation"), round((time.perf_counter() - started.pop()) * 1000, 3)))
    _gc.callbacks.append(on_gc)
    gc_hot = case.hot(20)
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    fast_switch = case.hot(20)
    sys.setswitchinterval(old_interval)
    _gc.callbacks.remove(on_gc)
    cold = case.cold(3)
    RESULTS["ttft"] = {"hot_ms": [round(x * 1000, 3) for x in hot], "hot_p50_ms": statistics.median(hot) * 1000,
                       "hot_p99_ms": hot[-1] * 1000, "cold_p50_ms": statistics.median(cold) * 1000,
                       "hot_phases_ms_per_forward": phases,
                       "hot_in_order_ms": [round(x * 1000, 3) for x in hot_in_order],
                       "again_ms": [round(x * 1000, 3) for x in gc_hot], "gc_pauses_ms": pauses,
                       "switch_0p5ms_ms": [round(x * 1000, 3) for x in fast_switch],
                       "hot_forwards": [(r["kind"], r["tokens"], round(r["device_ms"] or 0.0, 3)) for r in steps.rows]}
    log("ttft", RESULTS["ttft"])
    for label, xs in (("  again (gc pauses timed)", gc_hot), ("  again, GIL switch interval 0.5 ms", fast_switch)):
        summary.append((label, f"{statistics.median(xs) * 1000:.2f} / {max(xs) * 1000:.2f} ms",
                        f"gc pauses {pauses}" if "gc" in label else ""))
    summary.append(("hot-prefix TTFT p50 / p99 (3500 cached + 80, 20 req)",
                    f"{RESULTS['ttft']['hot_p50_ms']:.2f} / {RESULTS['ttft']['hot_p99_ms']:.2f} ms",
                    f"cold p50 {RESULTS['ttft']['cold_p50_ms']:.1f} ms; per forward {phases}"))
    try:
        js = C.json_bench(eng, vocab, 64 if not smoke else 4)
    except ImportError as e:
        summary.append(("JSON", f"skipped: {e}", ""))
        return
    RESULTS["json"] = js
    log("json", js)
    for name in (b for b in os.environ.get("GRAMMAR_BACKENDS", "").split(",") if b and b != eng.config.grammar_backend):
        # An engine of that backend beside this one (as section d's no-radix engine), dropped after.
        other_eng = prefixrt.Engine(big, grammar_backend=name, **kw)
        try:
            other = C.json_bench(other_eng, vocab, 64 if not smoke else 4)
        finally:
            free(other_eng)
            other_eng = None
        RESULTS[f"json_{name}"] = other
        log(f"json {name}", other)
        summary.append((f"  {name}: jump-forward on / off; constrained / unconstrained step",
                        f"{other['jf_speedup']:.2f}x (valid {other['jf_on']['valid']}/{other['jf_off']['valid']})",
                        f"{other['jf_off']['step_ms']:.2f} / {other['unconstrained']['step_ms']:.2f} ms = "
                        f"{other['constrained_step_over_unconstrained']:.2f}x"))
    for key in ("jf_on_steps", "jf_off_steps"):
        summary.append((f"  {key}: kind tokens<=b: count x device / wall ms",
                        "; ".join(f"{g['kind']} {g['tokens_le']}: {g['count']}x {g['device_ms']:.2f}/{g['wall_ms'] or 0:.2f}"
                                  for g in js.get(key, [])), ""))
    summary.append(("JSON long keys b64: jump-forward on / off", f"{js['jf_on']['tok_s']:.0f} / {js['jf_off']['tok_s']:.0f} tok/s",
                    f"{js['jf_speedup']:.2f}x; valid {js['jf_on']['valid']}/{js['jf_off']['valid']}"))
    summary.append(("constrained / unconstrained step (b64)", f"{js['jf_off']['step_ms']:.2f} / {js['unconstrained']['step_ms']:.2f} ms",
                    f"{js['constrained_step_over_unconstrained']:.2f}x"))


def section_d(eng, vocab, smoke, big, kw, summary) -> None:
    """No reuse: radix vs no-radix, median of 3 interleaved runs (both engines up)."""
    rand = W.random_prompts(vocab) if not smoke else W.random_prompts(vocab, 4, 32, 4)
    eng.flush_cache()
    other = prefixrt.Engine(big, radix_cache=False, **kw)
    tput = {"radix": [], "no-radix": []}
    for _ in range(3):
        for label, e in (("radix", eng), ("no-radix", other)):
            e.flush_cache()
            r = R.run_workload(e, rand, f"random {label}", show_progress=False)
            tput[label].append(r.output_throughput)
    ratio = statistics.median(a / b for a, b in zip(tput["radix"], tput["no-radix"]))
    RESULTS["random"] = {"radix_tok_s": tput["radix"], "noradix_tok_s": tput["no-radix"], "median_ratio": ratio}
    log("random", RESULTS["random"])
    summary.append(("random 256x1024/256 radix / no-radix", f"{ratio:.3f}x",
                    f"median of 3 interleaved; radix {statistics.median(tput['radix']):.0f} tok/s"))
    free(other)
    other = None


if __name__ == "__main__":
    sys.exit(main())
