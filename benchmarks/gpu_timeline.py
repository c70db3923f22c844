"""Where a decode step's wall time goes on the GPU host: the device timeline of the loop, step by step.

CUDA events are recorded around each forward (inside EngineCore.launch) and around each draw (the sampling
kernels), so the device timestamps show, per step: the forward's device time, the sampling's, and the two
places the GPU can sit idle waiting for the host (between a forward's end and its draw being enqueued, and
between the draw's end and the next forward being enqueued). A gap near zero means the device had the next
work queued already; a positive gap is time the GPU waited for the host. Host wall time of each loop unit
is timed too. Cases: the RAG case streamed with text, decode at batch 256 (1024 prompt), batch-1 decode at
4k context; each against the captured graph replayed alone right after. `nvidia-smi dmon` runs beside it.

    PYTHONPATH=$PWD python benchmarks/gpu_timeline.py [--only rag,b256,b1] [--cascade 0|1]
    PYTHONPATH=$PWD python benchmarks/gpu_timeline.py --only hot   # one request over a cached prefix: its timeline
    PYTHONPATH=$PWD python benchmarks/gpu_timeline.py --smoke      # tiny shapes on the CPU, to test the script
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import statistics
import subprocess
import threading
import time

import torch

import prefixrt
from benchmarks.common import log, script_parser, stream_text, unpack_heads
from prefixrt.bench import workloads as W

RESULTS: dict = {}


class Timeline:
    """Device times of each forward and each draw, host times of the loop units and the collector's pauses, through
    Engine.probes (log_forwards, time_units) between install() and uninstall()."""

    UNITS = ("schedule", "build", "draw", "launch", "process", "prepare_sample")

    def __init__(self, eng):
        self.eng = eng
        self.cuda = torch.cuda.is_available() and eng.probes.facts()["device"].startswith("cuda")
        self.fwd: list = []  # (device start ms, device end ms, kind, tokens, seqs), filled by uninstall()
        self.draws: list = []  # (device start ms, device end ms)
        self.host = dict.fromkeys(self.UNITS, 0.0)
        self.steps = 0
        self.gcs: list = []  # (generation, ms, forwards launched so far, thread name): the collector's pauses
        self._gc_start = None
        self._stack = None

    def install(self):
        self._stack = contextlib.ExitStack()
        self._forwards = self._stack.enter_context(self.eng.probes.log_forwards())
        self._units = self._stack.enter_context(self.eng.probes.time_units(self.UNITS, fence_wait=False))
        self._draws = self._stack.enter_context(self.eng.probes.time_units(("draw",), fence_wait=False,
                                                                           record_calls=True, device_events=True))
        gc.callbacks.append(self._on_gc)
        return self

    def _on_gc(self, phase, info):
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            self.gcs.append((info["generation"], round((time.perf_counter() - self._gc_start) * 1000, 3),
                             len(self._forwards.rows),
                             threading.current_thread().name))
            self._gc_start = None

    def uninstall(self) -> dict:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        self._stack.close()
        self.fwd = [(r["device_start_ms"], r["device_end_ms"], r["kind"], r["tokens"], r["seqs"])
                    for r in self._forwards.rows]
        self.draws = [(r["device_start_ms"], r["device_end_ms"]) for r in self._draws.records]
        self.host, self.steps = self._units.seconds, self._units.calls["process"]
        return self.summary()

    def summary(self) -> dict:
        by_gen = {g: [ms for gen, ms, _, _ in self.gcs if gen == g] for g in (0, 1, 2)}
        out = {"gc": {f"gen{g}": {"count": len(v), "total_ms": round(sum(v), 2), "max_ms": max(v, default=0)}
                      for g, v in by_gen.items()},
               "gc_over_2ms": [list(x) for x in self.gcs if x[1] > 2][:12],
               "forwards": len(self.fwd), "draws": len(self.draws),
               "host_ms_per_step": {k: round(v / max(self.steps, 1) * 1000, 3) for k, v in self.host.items()}}
        if not self.cuda or not self.fwd:
            return out
        # Pair each forward with the draw that follows it in stream order (draw(N) is enqueued after
        # build(N+1) and before launch(N+1)): draw i belongs to the last forward enqueued before it.
        rows = []
        t0 = self.fwd[0][0]
        fwd_t = [(a - t0, b - t0, kind, n, s) for a, b, kind, n, s in self.fwd]
        draw_t = sorted((a - t0, b - t0) for a, b in self.draws if a is not None)
        j = 0
        for i, (fa, fb, kind, n, s) in enumerate(fwd_t):
            nxt = fwd_t[i + 1][0] if i + 1 < len(fwd_t) else None
            d = None
            while j < len(draw_t) and draw_t[j][0] < fb - 1e-3:
                j += 1
            if j < len(draw_t) and (nxt is None or draw_t[j][0] <= nxt + 1e-3):
                d = draw_t[j]
                j += 1
            rows.append({"kind": kind, "tokens": n, "seqs": s, "fwd_ms": fb - fa,
                         "gap_to_draw_ms": (d[0] - fb) if d else None, "draw_ms": (d[1] - d[0]) if d else None,
                         "gap_to_next_ms": (nxt - (d[1] if d else fb)) if nxt is not None else None,
                         "period_ms": (nxt - fa) if nxt is not None else None})
        groups: dict = {}
        for r in rows:
            groups.setdefault((r["kind"], 1 << max(0, r["tokens"] - 1).bit_length()), []).append(r)

        def med(rs, key):
            v = [r[key] for r in rs if r[key] is not None]
            return round(statistics.median(v), 4) if v else None

        def mean(rs, key):
            v = [r[key] for r in rs if r[key] is not None]
            return round(sum(v) / len(v), 4) if v else None
        out["by_kind"] = [{"kind": k, "tokens_le": b, "count": len(rs),
                           **{f"{key}_p50": med(rs, key) for key in ("fwd_ms", "gap_to_draw_ms", "draw_ms",
                                                                   "gap_to_next_ms", "period_ms")},
                           **{f"{key}_mean": mean(rs, key) for key in ("fwd_ms", "gap_to_draw_ms", "draw_ms",
                                                                    "gap_to_next_ms", "period_ms")}}
                          for (k, b), rs in sorted(groups.items())]
        # Where the GPU waited: the steps with the longest idle gaps (index, gap before the draw, before the next
        # forward, the forward's own time), and how many steps waited over 0.2 ms.
        idle = [(i, r["gap_to_draw_ms"] or 0, r["gap_to_next_ms"] or 0, r["fwd_ms"]) for i, r in enumerate(rows)]
        out["idle_top"] = [[i, round(a, 3), round(b, 3), round(f, 3)]
                           for i, a, b, f in sorted(idle, key=lambda t: -(t[1] + t[2]))[:8]]
        out["steps_idle_over_0p2ms"] = sum(1 for _, a, b, _ in idle if a + b > 0.2)
        out["device_span_ms"] = round(fwd_t[-1][1] - fwd_t[0][0], 2)
        out["fwd_total_ms"] = round(sum(r["fwd_ms"] for r in rows), 2)
        out["draw_total_ms"] = round(sum(r["draw_ms"] or 0 for r in rows), 2)
        out["idle_total_ms"] = round(sum((r["gap_to_draw_ms"] or 0) + (r["gap_to_next_ms"] or 0) for r in rows), 2)
        return out


def replay_alone(eng, bs: int, iters: int = 50) -> float | None:
    try:
        return round(eng.probes.graph_replay_ms("decode", bs, iters), 4)
    except ValueError:  # no graph captured for this batch size
        return None


def case_rag(eng, smoke: bool) -> dict:
    vocab = eng.vocab_size
    w = W.rag(vocab) if not smoke else W.rag(vocab, requests=4, shared_len=64, unique_len=8, output_len=6)
    prompts = [s[0].new_tokens for s in w.sessions]
    max_new = w.sessions[0][0].max_new_tokens
    res = {"warm": stream_text(eng, prompts, max_new, 64)}
    eng.flush_cache()
    res["plain"] = stream_text(eng, prompts, max_new, 64)
    eng.flush_cache()
    tl = Timeline(eng).install()
    res["timed"] = stream_text(eng, prompts, max_new, 64)
    res["timeline"] = tl.uninstall()
    eng.flush_cache()
    return res


def case_decode(eng, bs: int, ctx: int, steps: int, smoke: bool) -> dict:
    vocab = eng.vocab_size
    rng = random.Random(bs)
    prompts = [[rng.randrange(16, vocab) for _ in range(ctx)] for _ in range(bs)]
    p = {"temperature": 0, "ignore_eos": True, "detokenize": False}
    eng.flush_cache()
    eng.generate(prompts, {"max_new_tokens": 0})
    eng.generate(prompts, {**p, "max_new_tokens": 4})  # warm
    t0 = time.perf_counter()
    eng.generate(prompts, {**p, "max_new_tokens": 1})
    t1 = time.perf_counter()
    eng.generate(prompts, {**p, "max_new_tokens": 1 + steps})
    t2 = time.perf_counter()
    res = {"step_ms": round(((t2 - t1) - (t1 - t0)) / steps * 1000, 4)}
    cuda = eng.probes.facts()["device"].startswith("cuda")
    if cuda:
        res["replay_alone_ms"] = replay_alone(eng, bs)
    tl = Timeline(eng).install()
    eng.generate(prompts, {**p, "max_new_tokens": 1 + steps})
    res["timeline"] = tl.uninstall()
    if cuda:
        res["replay_alone_after_ms"] = replay_alone(eng, bs)
    eng.flush_cache()
    return res


class FirstToken:
    """Where one request's time to first token goes: host timestamps (perf_counter) of the loop units, of the
    step's outputs leaving the loop (flush_outputs) and of the detokenizer worker's delivery to the stream (deliver,
    when the engine has one), and the forward's device time, through Engine.probes (time_units, log_forwards)
    opened around each request."""

    UNITS = ("schedule", "build", "launch", "draw", "process", "flush_outputs")

    def __init__(self, eng):
        self.eng = eng

    def request(self, prompt) -> dict:
        """Stream prompt for one token; the time from submission to each unit's first start after it (ms)."""
        units = self.UNITS + ("deliver",)
        with contextlib.ExitStack() as stack:
            try:
                timed = stack.enter_context(self.eng.probes.time_units(units, fence_wait=False, record_calls=True))
            except ValueError:  # no detokenizer worker
                timed = stack.enter_context(self.eng.probes.time_units(self.UNITS, fence_wait=False,
                                                                       record_calls=True))
            forwards = stack.enter_context(self.eng.probes.log_forwards())
            t0 = time.perf_counter()
            for _ in self.eng.stream(prompt, {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}):
                break
            t1 = time.perf_counter()
            time.sleep(0.01)  # the loop's units of this step have returned
        out = {"ttft_ms": (t1 - t0) * 1000}
        for r in timed.records:
            unit = "flush" if r["unit"] == "flush_outputs" else r["unit"]
            if r["start"] < t0 or f"{unit}_start_ms" in out:
                continue
            out[f"{unit}_start_ms"], out[f"{unit}_ms"] = (r["start"] - t0) * 1000, r["wall_s"] * 1000
        first = next((r for r in forwards.rows if r["start"] >= t0), None)
        if first is not None and first["device_ms"] is not None:
            out["forward_device_ms"] = first["device_ms"]
        return out


def case_hot(eng, smoke: bool) -> dict:
    """The hot-prefix TTFT case (3500 cached + 80 new tokens, one request at a time): TTFT and its timeline."""
    from benchmarks.common import HotPrefix

    shared, new, n = (64, 8, 5) if smoke else (3500, 80, 20)
    hp = HotPrefix(eng, 300 if smoke else 32000, shared, new)
    ft = FirstToken(eng)
    rows = [ft.request(hp.shared + hp._tokens(new)) for _ in range(n)]
    keys = sorted({k for r in rows for k in r}, key=lambda k: statistics.median(r.get(k, 0) for r in rows))
    return {"n": n, "median_ms": {k: round(statistics.median(r[k] for r in rows if k in r), 3) for k in keys},
            "ttft_p99_ms": round(sorted(r["ttft_ms"] for r in rows)[-1], 3)}


def main():
    ap = script_parser(__doc__, smoke="tiny shapes on the CPU, to test the script")
    ap.add_argument("--only", default="rag,b256,b64,b8,b1", help="cases, comma-separated (also: hot, the hot-prefix "
                    "TTFT timeline)")
    ap.add_argument("--cascade", default=None, help="1/0: EngineConfig.cascade_decode (default: the engine's)")
    ap.add_argument("--pdl", default=None, help="1/0: EngineConfig.pdl (programmatic dependent launch)")
    ap.add_argument("--pack", default=None, help="1/0: extend attention packs a kv head's query heads (default: "
                    "kernels.extend_attention.pack_heads_by_default)")
    args = ap.parse_args()
    if args.pack == "0":
        unpack_heads(block_maps_only=False)
    smoke = args.smoke
    out = os.environ.get("OUT")
    tag = ("" if args.pdl is None else f"_pdl{args.pdl}") + ("" if args.pack is None else f"_pack{args.pack}")
    dmon = None
    if not smoke and out:
        dmon = subprocess.Popen(["nvidia-smi", "dmon", "-s", "pucm", "-d", "1", "-f", os.path.join(out, f"dmon{tag}.txt")],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kw = dict(load_format="dummy", kv_cache_tokens=330_000 if not smoke else 4000)
    if args.cascade is not None:
        kw["cascade_decode"] = args.cascade == "1"
    if args.pdl is not None:
        kw["pdl"] = args.pdl == "1"
    if smoke:
        kw.update(device="cpu", attention_backend="torch")
    t = time.perf_counter()
    eng = prefixrt.Engine("llama-3-8b" if not smoke else "qwen3-0.6b", **kw)
    RESULTS["startup_s"] = round(time.perf_counter() - t, 1)
    RESULTS["pdl"] = eng.probes.facts()["startup"].get("pdl")
    log(f"engine up in {RESULTS['startup_s']}s, pdl {RESULTS['pdl']}")
    only = args.only.split(",")
    try:
        if "hot" in only:  # first: its units are timed by wrappers the other cases do not expect
            RESULTS["hot"] = case_hot(eng, smoke)
            log("hot", json.dumps(RESULTS["hot"]))
        if "rag" in only:
            RESULTS["rag"] = case_rag(eng, smoke)
            log("rag", json.dumps(RESULTS["rag"]))
        for name, bs, ctx, steps in (("b256", 256, 1024, 64), ("b64", 64, 1024, 64), ("b8", 8, 2048, 64),
                                     ("b1", 1, 4096, 128)):
            if name in only:
                if smoke:
                    bs, ctx, steps = min(bs, 4), 32, 4
                RESULTS[name] = case_decode(eng, bs, ctx, steps, smoke)
                log(name, json.dumps(RESULTS[name]))
    finally:
        eng.shutdown()
        if dmon is not None:
            dmon.terminate()
    if out:
        with open(os.path.join(out, f"gpu_timeline{tag}.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)
    if "hot" in RESULTS:
        log("\nhot-prefix first token, median ms from submission (unit start / its own duration):")
        med = RESULTS["hot"]["median_ms"]
        for k, v in med.items():
            log(f"  {k:<22} {v}")
    log("\ncase | out tok/s or step ms | fwd p50 | gap->draw p50 | draw p50 | gap->next p50 | period p50 | replay alone")
    for name, r in RESULTS.items():
        if not isinstance(r, dict) or "timeline" not in r and "timed" not in r:
            continue
        tl = r.get("timeline", {})
        head = r["timed"]["out_tok_s"] if "timed" in r else r.get("step_ms")
        for k in tl.get("by_kind", []):
            if k["count"] < 3:
                continue
            log(f"{name} {k['kind']}<= {k['tokens_le']} x{k['count']} | {head} | {k['fwd_ms_p50']} | "
                f"{k['gap_to_draw_ms_p50']} | {k['draw_ms_p50']} | {k['gap_to_next_ms_p50']} | {k['period_ms_p50']} | "
                f"{r.get('replay_alone_ms')}/{r.get('replay_alone_after_ms')}")
        log(f"{name} host ms/step {tl.get('host_ms_per_step')} idle total {tl.get('idle_total_ms')} ms "
            f"of span {tl.get('device_span_ms')}")


if __name__ == "__main__":
    main()
