"""The engine loop's host work per decode step, without a GPU: a tiny checkpoint on the CPU whose forward is
replaced by a constant logits tensor, so what is timed is scheduling, batch building, sampling and
post-processing (and the detokenizer and caller threads contending for the GIL). Per-unit thread CPU time
and wall time per step, at several batch sizes, minimum over repeats (robust to a loaded machine).

    PYTHONPATH=$PWD python benchmarks/host_loop.py [--batch 64,256] [--steps 96] [--repeats 3]

--json MODEL_DIR: the constrained case instead (benchmarks/common.py's long-keys JSON schema, greedy, jump-forward on and
off) on a checkpoint directory with a real tokenizer (e.g. a tiny Llama-3-tokenizer model, load_format="dummy"):
per step, the CPU time of the grammar masks (the backend's fill_bitmasks_native and finish_bitmasks, every row on the
timing thread —
llguidance with mask_threads 0 — so the figure is independent of the mask worker's threads and of the load on the
machine) and of process(), and the wall time
per step. Each row's logits differ (a fixed pool of random rows, picked by the request's table row and
position), so rows diverge as a real batch's do.

    PYTHONPATH=$PWD python benchmarks/host_loop.py --json /tmp/tl3 [--grammar-backend xgrammar] [--batch 64]
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import LONG_KEYS_SCHEMA, constant_logits_engine, script_parser, tiny_model_dir
from prefixrt.engine.engine import Engine
from prefixrt.engine.probes import LOOP_UNITS


def build(batch: int) -> Engine:
    path = tiny_model_dir(Path(tempfile.mkdtemp()))
    return constant_logits_engine(path, kv_cache_tokens=batch * 140, max_running_requests=batch)


def measure(eng: Engine, batch: int, steps: int) -> dict:
    rng = random.Random(batch)
    prompts = [[rng.randrange(3, 300) for _ in range(8)] for _ in range(batch)]
    params = {"temperature": 0, "ignore_eos": True, "detokenize": False}
    eng.generate(prompts, {"max_new_tokens": 0})
    t0 = time.perf_counter()
    eng.generate(prompts, {**params, "max_new_tokens": 1})
    t1 = time.perf_counter()
    with eng.probes.time_units(LOOP_UNITS, clock=time.thread_time, fence_wait=False) as units:
        c0 = time.process_time()
        eng.generate(prompts, {**params, "max_new_tokens": 1 + steps})
        c1 = time.process_time()
        t2 = time.perf_counter()
    acc = units.seconds
    out = {f"{k}_cpu_ms": v / steps * 1000 for k, v in acc.items()}
    out["loop_cpu_ms"] = sum(acc.values()) / steps * 1000
    out["all_threads_cpu_ms"] = (c1 - c0) / steps * 1000  # loop, detokenizer, caller
    out["wall_ms"] = ((t2 - t1) - (t1 - t0)) / steps * 1000
    return out


def build_json(model_dir: str, batch: int, grammar_backend: str) -> Engine:
    eng = Engine(model_dir, load_format="dummy", dtype="float32", device="cpu", kv_cache_tokens=batch * 400,
                 max_running_requests=batch, overlap_schedule=True, grammar_backend=grammar_backend, seed=0)
    vocab = eng.vocab_size
    pool = torch.randn(127, vocab, generator=torch.Generator().manual_seed(0))

    def varied_forward(fb):  # a row's logits follow from its request's table row and position: two requests never
        # see the same logits at the same position (rows < 127, 131 = 4 mod 127), so their outputs stay apart as
        # a real model's would (their prompts differ); which row a request gets varies between runs
        pos = fb.positions[fb.logits_indices]
        seq = torch.searchsorted(fb.extend_start_loc.to(torch.int64), fb.logits_indices, right=True) - 1
        rows = fb.req_pool_indices[seq]
        return pool[(rows * 131 + pos) % pool.shape[0]]

    eng.probes.replace_forward(varied_forward)
    return eng


def measure_json(eng: Engine, batch: int, jump_forward: bool) -> dict:
    """One greedy batch of the long-keys schema; CPU ms per step of the masks and of process()."""
    backend = eng.grammar_compiler().backend
    rng = random.Random(11)
    prompts = [[rng.randrange(16, min(1000, eng.vocab_size)) for _ in range(16)] for _ in range(batch)]
    params = {"max_new_tokens": 200, "temperature": 0, "json_schema": LONG_KEYS_SCHEMA, "jump_forward": jump_forward,
              "detokenize": False}
    eng.flush_cache()
    if backend.name == "llguidance":  # every row filled on the mask worker itself, so its thread time is all of it
        eng.probes.set_mask_threads(0)
    with eng.probes.time_masks(clock=time.thread_time) as masks, \
            eng.probes.time_units(("process",), clock=time.thread_time, fence_wait=False) as units:
        t0 = time.perf_counter()
        res = eng.generate(prompts, params)
        wall = time.perf_counter() - t0
    if backend.name == "llguidance":
        eng.probes.set_mask_threads(2)  # the backend's default
    acc = {"mask": masks.fill_s + masks.finish_s, "mask_rows": masks.rows, "process": units.seconds["process"],
           "steps": units.calls["process"]}
    steps = max(1, acc["steps"])
    texts = [eng.tokenizer.decode(r.token_ids) for r in res]
    valid = sum(r.finish_reason == "stop" and isinstance(json.loads(t), dict) for r, t in zip(res, texts))
    return {"steps": acc["steps"], "mask_ms_per_step": acc["mask"] / steps * 1000,
            "mask_ms_per_row": acc["mask"] / max(1, acc["mask_rows"]) * 1000,
            "mask_ms_per_64_rows": acc["mask"] / max(1, acc["mask_rows"]) * 64000,
            "process_ms_per_step": acc["process"] / steps * 1000, "wall_ms_per_step": wall / steps * 1000,
            "valid": valid, "output_tokens": sum(len(r.token_ids) for r in res)}


def main_json(args) -> None:
    rows = []
    for b in (int(x) for x in args.batch.split(",")):
        eng = build_json(args.json, b, args.grammar_backend)
        backend = eng.grammar_compiler().backend
        for lengths in args.string_lengths.split(","):
            if hasattr(backend, "string_lengths"):  # llguidance: maxLength beside the grammar (on) or in it (off)
                backend.string_lengths = lengths == "on"
            measure_json(eng, min(b, 8), True)  # warm: compile the schema, first steps
            for jf in (True, False):
                runs = [measure_json(eng, b, jf) for _ in range(args.repeats)]
                best = {k: min(r[k] for r in runs) for k in runs[0] if k != "digest"}
                rows.append((b, jf, lengths, best))
        eng.shutdown()
    keys = list(rows[0][3])
    print(f"grammar backend {args.grammar_backend}")
    print("batch   jf lengths " + " ".join(f"{k:>19}" for k in keys))
    for b, jf, lengths, best in rows:
        print(f"{b:>5} {'on ' if jf else 'off'} {lengths:>7} " + " ".join(
            f"{best[k]:19.3f}" if isinstance(best[k], float) else f"{best[k]:>19}" for k in keys))


def main() -> None:
    ap = script_parser(__doc__)
    ap.add_argument("--batch", default="64,256", help="batch sizes, comma-separated (--json: default 64)")
    ap.add_argument("--steps", type=int, default=96, help="decode steps timed per run")
    ap.add_argument("--repeats", type=int, default=3, help="runs per batch size; the minimum is reported")
    ap.add_argument("--json", metavar="MODEL_DIR", default=None,
                    help="the constrained case on this checkpoint folder (a real tokenizer, dummy weights)")
    ap.add_argument("--string-lengths", default="on", help="(--json, llguidance) on,off: JSON string lengths checked "
                    "beside the grammar or compiled into it, one row set each")
    ap.add_argument("--grammar-backend", default="llguidance")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.json:
        if args.batch == "64,256":
            args.batch = "64"
        main_json(args)
        return
    rows = []
    for b in (int(x) for x in args.batch.split(",")):
        eng = build(b)
        runs = [measure(eng, b, args.steps) for _ in range(args.repeats)]
        eng.shutdown()
        best = {k: min(r[k] for r in runs) for k in runs[0]}
        rows.append((b, best))
    keys = list(rows[0][1])
    print("batch " + " ".join(f"{k:>16}" for k in keys))
    for b, best in rows:
        print(f"{b:>5} " + " ".join(f"{best[k]:16.3f}" for k in keys))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
