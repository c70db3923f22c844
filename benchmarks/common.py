"""What the benchmark scripts share, in one place: the long-keys JSON schema and its benchmark, the engine probes
(hot-prefix TTFT, streaming with text, the cascade switch, a captured graph replayed alone, the loop units' phase
timer and the per-forward step log), CPU engines whose forward returns constant logits, the tiny server model, and
CPU time from /proc.

Scripts import it as `benchmarks.common` (run from the repo root with PYTHONPATH=$PWD). It imports torch and
prefixrt only inside the functions that need them, so a script's `--help` never loads a model or touches CUDA.
What they observe of the engine they read through its public probes (`Engine.probes`, prefixrt/engine/probes.py;
docs/api.md "Probes"), never its internals (tests/benchmarks/test_public_api_only.py checks every script).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import time
from pathlib import Path

# Six long fixed keys, three bounded strings, an enum, an integer and a boolean: most of a reply is forced text,
# which is what jump-forward skips (gpu_engine.py, gpu_graphs.py, gpu_json_diag.py, gpu_first_request.py,
# host_loop.py --json, mask_fill.py).
LONG_KEYS_SCHEMA = {
    "type": "object",
    "properties": {
        "customer_full_name": {"type": "string", "maxLength": 12},
        "customer_email_address": {"type": "string", "maxLength": 16},
        "shipping_address_line_one": {"type": "string", "maxLength": 16},
        "preferred_delivery_window": {"enum": ["morning", "afternoon", "evening"]},
        "order_total_in_cents": {"type": "integer", "minimum": 0, "maximum": 99999},
        "gift_wrapping_requested": {"type": "boolean"},
    },
    "required": ["customer_full_name", "customer_email_address", "shipping_address_line_one",
                 "preferred_delivery_window", "order_total_in_cents", "gift_wrapping_requested"],
    "additionalProperties": False,
}


def script_parser(doc: str, smoke: str | None = None) -> argparse.ArgumentParser:
    """A benchmark script's argument parser: `--help` prints the script's docstring as written. smoke: the help of
    a --smoke flag (the script's logic on tiny shapes on the CPU), if the script has one."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if smoke is not None:
        ap.add_argument("--smoke", action="store_true", help=smoke)
    return ap


def int_flags(ap: argparse.ArgumentParser, **defaults: int) -> None:
    """Integer flags without help text, in order: int_flags(ap, prompts_per_group=8) adds --prompts-per-group."""
    for name, default in defaults.items():
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=default)


def log(*a) -> None:
    print(*a, flush=True)


def run_section(results: dict, summary: list, name: str, fn) -> None:
    """results[name] = fn(); a failure is printed and recorded (results and a FAILED summary row) instead of raised,
    so one failing section never loses the others' figures. Says how long it took."""
    t = time.perf_counter()
    try:
        results[name] = fn()
    except Exception:
        import traceback

        traceback.print_exc()
        results[name] = {"error": traceback.format_exc().splitlines()[-1]}
        summary.append((name, "FAILED", results[name]["error"][:120]))
    log(f"section {name}: {time.perf_counter() - t:.0f}s")


def write_results(results: dict, name: str, results_dir: Path | None) -> None:
    """The JSON of a GPU script's results, as `name` under results_dir (None: not kept, e.g. a smoke run) and under
    $OUT when set; then printed."""
    for out_dir in (results_dir, os.environ.get("OUT")):
        if out_dir:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            (Path(out_dir) / name).write_text(json.dumps(results, indent=1, default=str))
    log(json.dumps(results, indent=1, default=str))


def log_table(rows: list[tuple[str, str, str]], value_width: int) -> None:
    """The short table a GPU script prints last: (what, value, note) rows in aligned columns."""
    w = max([len(a) for a, _, _ in rows] + [1])
    for a, b, c in rows:
        log(f"{a:<{w}}  {b:<{value_width}}  {c}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rel_err(a, b) -> float:
    """||a - b|| / ||b||: tensors in float32 (as the kernels' checks compare), lists of floats in float64."""
    import torch

    if isinstance(a, torch.Tensor):
        a, b = a.float(), b.float()
    else:
        a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


# ------------------------------------------------------------------------------------------ engine probes


def ttft_once(eng, prompt) -> float:
    """Seconds from submitting one greedy request to its first streamed token."""
    t0 = time.perf_counter()
    for _ in eng.stream(prompt, {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}):
        break
    return time.perf_counter() - t0


class HotPrefix:
    """The hot-prefix TTFT case: a shared prefix of `shared_len` random tokens cached (after a flush, then 3 warm
    requests), and requests of that prefix + `new_len` fresh tokens. One random stream (seeded) draws the prefix,
    the suffixes and the cold prompts, in the order they are asked for."""

    def __init__(self, eng, vocab: int, shared_len: int, new_len: int, seed: int = 5):
        self.eng, self.vocab, self.new_len = eng, vocab, new_len
        self.rng = random.Random(seed)
        self.shared = self._tokens(shared_len)
        eng.flush_cache()
        eng.cache_prefix(self.shared)
        self.hot(3)

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(16, self.vocab) for _ in range(n)]

    def hot(self, n: int) -> list[float]:
        """TTFT in seconds of n requests over the cached prefix, in submission order."""
        return [ttft_once(self.eng, self.shared + self._tokens(self.new_len)) for _ in range(n)]

    def cold(self, n: int = 3) -> list[float]:
        """TTFT in seconds of n prompts as long, nothing cached (the cache flushed before each)."""
        out = []
        for _ in range(n):
            self.eng.flush_cache()
            out.append(ttft_once(self.eng, self._tokens(len(self.shared) + self.new_len)))
        return out


def stream_text(eng, prompts: list[list[int]], max_new: int, concurrency: int) -> dict:
    """Every prompt streamed WITH text (detokenized, as the server does), `concurrency` at a time: wall time,
    output tokens per second, TTFT p50."""
    async def run() -> dict:
        sem = asyncio.Semaphore(concurrency)
        ttfts, toks, chars = [], [0], [0]

        async def one(p):
            async with sem:
                t0 = time.perf_counter()
                first = None
                async for ch in eng.astream(p, {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}):
                    if first is None and ch.token_ids:
                        first = time.perf_counter()
                    toks[0] += len(ch.token_ids)
                    chars[0] += len(ch.text)
                ttfts.append((first or time.perf_counter()) - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        dt = time.perf_counter() - t0
        ttfts.sort()
        return {"seconds": round(dt, 3), "out_tok_s": round(toks[0] / dt, 1),
                "ttft_p50_ms": round(ttfts[len(ttfts) // 2] * 1000, 1), "text_chars": chars[0],
                "output_tokens": toks[0]}

    return asyncio.run(run())


def set_cascade(eng, on: bool) -> None:
    """Switch shared-prefix (cascade) decode groups off or back on, between steps; nothing to switch on an engine
    built without them (a CPU smoke run), whose runs then compare plain decode with itself."""
    if eng.probes.facts()["cascade_built"]:
        eng.probes.set_cascade(on)


def unpack_heads(block_maps_only: bool) -> None:
    """A/B runs of extend attention's packed query heads: after this call kernels.extend_attention packs no launch by
    default (block_maps_only: no block-mapped launch, i.e. the CUDA graphs'; eager launches keep the default rule).
    Call it before the engine is built (graph capture sizes its splits by the same rule)."""
    from prefixrt.kernels import extend_attention as ext

    default_rule = ext.pack_heads_by_default
    ext.pack_heads_by_default = lambda g, has_map, block_m=None: (
        not has_map and block_maps_only and default_rule(g, has_map, block_m))


def replay_ms(graph, iters: int = 20) -> float:
    """A captured CUDA graph replayed alone, back to back (3 warm replays first): wall ms per replay."""
    import torch

    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1000


def device_ms(fn, iters: int = 20, warm: int = 3) -> float:
    """fn's CUDA time per call (events around iters back-to-back calls after warm ones): ms. Eager launches
    included, so a short kernel's figure is mostly its launch."""
    import torch

    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


class PhaseTimer:
    """Wall time per step of each loop unit (schedule, build, draw, launch, process, prepare_sample), the wait for
    the device inside process, and the host work left after removing that wait: Engine.probes.time_units(),
    opened by install() and closed by uninstall()."""

    def __init__(self, eng):
        self.eng, self._ctx, self.acc = eng, None, {}

    def install(self):
        self._ctx = self.eng.probes.time_units()
        self._times = self._ctx.__enter__()
        self.acc = self._times.seconds
        return self

    def uninstall(self) -> dict:
        self._ctx.__exit__(None, None, None)
        return self.acc

    def per_step_ms(self, steps: int) -> dict:
        return self._times.per_step_ms(steps)


class StepLog:
    """Every forward of the engine while installed (Engine.probes.log_forwards()): its kind (decode / cascade /
    extend graph, or eager), its token and sequence counts, its device time and the wall time from its launch to the
    next launch. summary() groups them by kind and token count bucket."""

    def __init__(self, eng):
        self.eng, self.rows, self._ctx = eng, [], None

    def install(self):
        self._ctx = self.eng.probes.log_forwards()
        self._log = self._ctx.__enter__()
        self.rows = self._log.rows
        return self

    def uninstall(self):
        self._ctx.__exit__(None, None, None)
        return self

    def summary(self) -> list[dict]:
        return self._log.summary()


def forward_counts_since(eng, before: dict) -> dict:
    """Forwards by how they ran since `before` (an earlier eng.probes.forward_counts())."""
    return {k: v - before.get(k, 0) for k, v in eng.probes.forward_counts().items()}


def torch_profile(eng, prompts, name: str, params: dict) -> dict:
    """torch.profiler over one generate call: the top host ops and CUDA API calls by self CPU time (to
    $OUT/profile_NAME.txt), GPU busy time against wall time, and how the forwards ran."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    eng.generate(prompts, {"max_new_tokens": 0})
    replays0 = eng.probes.forward_counts()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        eng.generate(prompts, params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    if os.environ.get("TORCH_TRACE"):
        prof.export_chrome_trace(os.path.join(os.environ["OUT"], f"trace_{name}.json"))
    ka = prof.key_averages()
    with open(os.path.join(os.environ["OUT"], f"profile_{name}.txt"), "w") as f:
        f.write(ka.table(sort_by="self_cpu_time_total", row_limit=45))
        f.write("\n\n")
        f.write(ka.table(sort_by="self_device_time_total", row_limit=25))
    gpu_us = sum(e.self_device_time_total for e in ka)
    sync = {e.key: (e.count, round(e.self_cpu_time_total / 1000, 2)) for e in ka
            if any(w in e.key for w in ("Synchronize", "HostAlloc", "cudaMemcpy", "GraphLaunch", "cudaLaunchKernel"))}
    replays = forward_counts_since(eng, replays0)
    return {"wall_ms": round(wall * 1000, 2), "gpu_busy_ms": round(gpu_us / 1000, 2), "cuda_api": sync,
            "replays": replays}


def _json_valid(completion) -> bool:
    try:
        return completion.finish_reason == "stop" and isinstance(json.loads(completion.text), dict)
    except ValueError:
        return False


def json_bench(eng, vocab: int, batch: int, order: tuple[bool, ...] = (True, False), instrument: bool = True) -> dict:
    """Constrained JSON (LONG_KEYS_SCHEMA, 200 tokens at most) at batch `batch`: jump-forward on vs off, one run per
    entry of `order` (a setting's last run is its figure), then the constrained step against unconstrained
    decoding of the same length. instrument: also the loop units per step (PhaseTimer) and the forwards
    (StepLog) of each run; MASK_THREADS=a,b times the grammar mask fill with that many executor threads;
    TORCH_PROFILE=1 (with OUT) profiles a short jump-forward-off run."""
    import torch

    rng = random.Random(11)
    prompts = [[rng.randrange(16, vocab) for _ in range(64)] for _ in range(batch)]
    base = {"max_new_tokens": 200, "temperature": 0, "json_schema": LONG_KEYS_SCHEMA}
    eng.generate(prompts[:2], base)  # grammar compiled, warm
    out = {}
    for jf in order:
        key = "jf_on" if jf else "jf_off"
        eng.flush_cache()
        s0 = eng.stats().forward_passes_total
        replays0 = eng.probes.forward_counts()
        timer = PhaseTimer(eng).install() if instrument else None
        steps = StepLog(eng).install() if instrument else None
        t0 = time.perf_counter()
        res = eng.generate(prompts, {**base, "jump_forward": jf})
        dt = time.perf_counter() - t0
        passes = eng.stats().forward_passes_total - s0
        if instrument:
            timer.uninstall()
            out[f"{key}_phases_ms_per_step"] = timer.per_step_ms(passes)
            out[f"{key}_steps"] = steps.uninstall().summary()
        toks = sum(c.completion_tokens for c in res)
        out[key] = {"seconds": dt, "forward_passes": passes, "output_tokens": toks, "tok_s": toks / dt,
                    "valid": sum(map(_json_valid, res)), "step_ms": dt / passes * 1000,
                    "replays": forward_counts_since(eng, replays0)}
    n = max(1, out["jf_off"]["output_tokens"] // batch)
    eng.flush_cache()
    s0 = eng.stats().forward_passes_total
    timer = PhaseTimer(eng).install() if instrument else None
    t0 = time.perf_counter()
    eng.generate(prompts, {"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
    dt = time.perf_counter() - t0
    passes = eng.stats().forward_passes_total - s0
    if instrument:
        timer.uninstall()
        out["unconstrained_phases_ms_per_step"] = timer.per_step_ms(passes)
    out["unconstrained"] = {"seconds": dt, "forward_passes": passes, "step_ms": dt / passes * 1000}
    out["jf_speedup"] = out["jf_on"]["tok_s"] / out["jf_off"]["tok_s"]
    if os.environ.get("MASK_THREADS") and eng.grammar_compiler().backend.name == "llguidance":
        out["mask_fill"] = _mask_fill_by_threads(eng, prompts, base)
    if torch.cuda.is_available() and os.environ.get("TORCH_PROFILE") and os.environ.get("OUT"):
        out["profile_jf_off"] = torch_profile(eng, prompts, "json_jf_off",
                                              {**base, "max_new_tokens": 24, "jump_forward": False})
    out["constrained_step_over_unconstrained"] = out["jf_off"]["step_ms"] / out["unconstrained"]["step_ms"]
    return out


def _mask_fill_by_threads(eng, prompts, base: dict) -> dict:
    """The grammar mask fill per call with MASK_THREADS=a,b backend threads (jump-forward off, same prompts): the
    worker's part (the native fill; its Python part runs at the draw)."""
    out = {}
    for threads in (int(x) for x in os.environ["MASK_THREADS"].split(",")):
        eng.probes.set_mask_threads(threads)
        eng.flush_cache()
        t0 = time.perf_counter()
        s0 = eng.stats().forward_passes_total
        with eng.probes.time_masks() as masks:
            eng.generate(prompts, {**base, "jump_forward": False})
        dt, passes = time.perf_counter() - t0, eng.stats().forward_passes_total - s0
        out[threads] = {"fill_ms_per_call": masks.fill_s / max(1, masks.fills) * 1000, "calls": masks.fills,
                        "step_ms": dt / passes * 1000}
    return out


# ------------------------------------------------------------------------------------ CPU engines, servers


def constant_logits_engine(checkpoint: Path, kv_cache_tokens: int, max_running_requests: int, **engine_kwargs):
    """An overlapped CPU Engine on a tiny checkpoint folder with its tokenizer (tiny_model_dir) whose forward
    returns the same random logits for the same number of rows (Engine.probes.replace_forward): what is left to
    time is the loop's host work. engine_kwargs: more Engine settings."""
    import torch

    from prefixrt.engine.engine import Engine

    eng = Engine(str(checkpoint), dtype="float32", device="cpu", kv_cache_tokens=kv_cache_tokens,
                 max_running_requests=max_running_requests, overlap_schedule=True, **engine_kwargs)
    vocab = eng.vocab_size
    cache: dict[int, torch.Tensor] = {}

    def constant_forward(fb):
        n = int(fb.logits_indices.shape[0])
        if n not in cache:
            cache[n] = torch.randn(n, vocab, generator=torch.Generator().manual_seed(n))
        return cache[n]

    eng.probes.replace_forward(constant_forward)
    return eng


def tiny_model_dir(root: Path) -> Path:
    """The test suite's tiny random Llama (2 layers, hidden 64, vocab 320) with its byte-level BPE tokenizer, saved
    under root: a model step so cheap that every serving overhead shows."""
    from tests.helpers.checkpoints import save_tiny_checkpoint
    from tests.helpers.engines import make_tiny_tokenizer

    path = root / "tiny-llama"
    save_tiny_checkpoint("llama", path)
    make_tiny_tokenizer().save_pretrained(path)
    return path


def cpu_seconds(pid: int) -> float:
    """user + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]
