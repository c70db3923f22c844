"""The grammar mask fill alone, without an engine: benchmarks/common.py's long-keys JSON schema on the Llama-3 tokenizer,
`--batch` matchers walked in lock step (each step a seeded random allowed token per row, one token a step, as
greedy decoding on dummy weights does), and at every step the rows' masks filled as the engine's mask worker fills
them (`fill_bitmasks_native`, then `finish_bitmasks`). The same walk is replayed for every executor thread count
and torch intra-op thread count, so each variant computes exactly the same masks; per variant: milliseconds per
step of each part and of one row (native part's wall time x threads / rows).

It tells apart the cost of the masks themselves from what the engine around them adds: run it on the machine
whose engine figures it explains.

    PYTHONPATH=$PWD python benchmarks/mask_fill.py [--batch 64] [--threads 0,1,2,4,8,14] [--torch-threads default,1]
"""

from __future__ import annotations

import json
import os
import random
import time

import numpy as np
import torch

from benchmarks.common import LONG_KEYS_SCHEMA, script_parser

VOCAB = 128256


def walk(backend, compiled, batch: int, steps: int, seed: int) -> list[list[int]]:
    """Each row's tokens: at every step a random token its mask allows (rows that finished stop)."""
    rng = random.Random(seed)
    ms = [backend.matcher(compiled) for _ in range(batch)]
    out: list[list[int]] = [[] for _ in range(batch)]
    mask = torch.zeros(batch, (VOCAB + 31) // 32, dtype=torch.int32)
    for _ in range(steps):
        live = [i for i, m in enumerate(ms) if not m.is_finished()]
        if not live:
            break
        backend.fill_bitmasks([(ms[i], i) for i in live], mask)
        for i in live:
            bits = np.unpackbits(mask[i].numpy().view(np.uint8), bitorder="little")[:VOCAB]
            allowed = np.flatnonzero(bits)
            t = int(allowed[rng.randrange(len(allowed))])
            if not ms[i].accept_token(t):
                raise RuntimeError(f"row {i} refused token {t}")
            out[i].append(t)
    return out


def replay(backend, compiled, tokens: list[list[int]]) -> dict:
    """Fill every step's masks for the recorded walk; the time of each part per step."""
    batch = len(tokens)
    ms = [backend.matcher(compiled) for _ in range(batch)]
    mask = torch.zeros(batch, (VOCAB + 31) // 32, dtype=torch.int32)
    native = finish = 0.0
    steps = rows = 0
    for step in range(max(len(t) for t in tokens)):
        live = [i for i in range(batch) if step < len(tokens[i])]
        pairs = [(ms[i], i) for i in live]
        t0 = time.perf_counter()
        backend.fill_bitmasks_native(pairs, mask)
        t1 = time.perf_counter()
        backend.finish_bitmasks(pairs, mask)
        t2 = time.perf_counter()
        native += t1 - t0
        finish += t2 - t1
        steps += 1
        rows += len(live)
        for i in live:
            ms[i].accept_token(tokens[i][step])
    return {"steps": steps, "rows": rows, "native_ms_per_step": native / steps * 1e3,
            "finish_ms_per_step": finish / steps * 1e3, "native_ms_per_row": native / rows * 1e3}


def main() -> None:
    ap = script_parser(__doc__)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--threads", default="0,1,2,4,8,14")
    ap.add_argument("--torch-threads", default="default,1")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    from prefixrt.constrained.llguidance_backend import LLGuidanceBackend
    from prefixrt.hub.catalogue import _llama3_tokenizer

    t0 = time.perf_counter()
    backend = LLGuidanceBackend(_llama3_tokenizer(None), vocab_size=VOCAB)
    compiled = backend.compile("json_schema", LONG_KEYS_SCHEMA)
    setup_s = time.perf_counter() - t0
    tokens = walk(backend, compiled, args.batch, args.steps, seed=5)
    default_torch = torch.get_num_threads()
    rows = []
    for tt in args.torch_threads.split(","):
        torch.set_num_threads(default_torch if tt == "default" else int(tt))
        for th in (int(x) for x in args.threads.split(",")):
            backend.set_mask_threads(th)
            best = min((replay(backend, compiled, tokens) for _ in range(args.repeats)),
                       key=lambda r: r["native_ms_per_step"])
            best.update(torch_threads=torch.get_num_threads(), mask_threads=th,
                        thread_ms_per_row=best["native_ms_per_row"] * max(1, th))
            rows.append(best)
            print(json.dumps(best), flush=True)
    torch.set_num_threads(default_torch)
    print(f"host: {os.cpu_count()} cpus; set-up {setup_s:.1f} s; batch {args.batch}, "
          f"{rows[0]['steps']} steps, {rows[0]['rows']} rows")
    print("torch threads | mask threads | native ms/step | finish ms/step | native ms/row (wall) | x threads")
    for r in rows:
        print(f"{r['torch_threads']} | {r['mask_threads']} | {r['native_ms_per_step']:.3f} | "
              f"{r['finish_ms_per_step']:.3f} | {r['native_ms_per_row']:.4f} | {r['thread_ms_per_row']:.4f}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "mask_fill.json"), "w") as f:
            json.dump({"cpus": os.cpu_count(), "batch": args.batch, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
