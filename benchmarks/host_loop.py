"""The engine loop's host work per decode step, without a GPU: a tiny checkpoint on the CPU whose forward is
replaced by a constant logits tensor, so what is timed is scheduling, batch building, sampling and
post-processing (and the detokenizer and caller threads contending for the GIL). Per-unit thread CPU time
and wall time per step, at several batch sizes, minimum over repeats (robust to a loaded machine).

    PYTHONPATH=$PWD python benchmarks/host_loop.py [--batch 64,256] [--steps 96] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prefixrt.engine.engine import Engine  # noqa: E402
from prefixrt.hub.loader import load_model  # noqa: E402
from tests.helpers.checkpoints import save_tiny_checkpoint  # noqa: E402
from tests.helpers.engines import make_tiny_tokenizer  # noqa: E402

UNITS = ("schedule", "build", "draw", "launch", "process", "prepare_sample")


def build(batch: int) -> Engine:
    path = Path(tempfile.mkdtemp())
    save_tiny_checkpoint("llama", path)
    model = load_model(path, dtype="float32", device="cpu")
    resolved = SimpleNamespace(name="tiny-llama", revision="bench", extra_eos_token_ids=(), path=str(path))
    eng = Engine("tiny-llama", _parts=(model, make_tiny_tokenizer(), resolved), device="cpu",
                 kv_cache_tokens=batch * 140, max_running_requests=batch, overlap_schedule=True)
    vocab = model.vocab_size
    cache: dict[int, torch.Tensor] = {}

    def constant_forward(fb):
        n = int(fb.logits_indices.shape[0])
        if n not in cache:
            cache[n] = torch.randn(n, vocab, generator=torch.Generator().manual_seed(n))
        return cache[n]

    eng._run_on_loop(lambda: setattr(eng.core.runner, "forward", constant_forward))
    return eng


def measure(eng: Engine, batch: int, steps: int) -> dict:
    rng = random.Random(batch)
    prompts = [[rng.randrange(3, 300) for _ in range(8)] for _ in range(batch)]
    params = {"temperature": 0, "ignore_eos": True, "detokenize": False}
    eng.generate(prompts, {"max_new_tokens": 0})
    acc = dict.fromkeys(UNITS, 0.0)
    core = eng.core

    def install():
        for name in UNITS:
            f = getattr(core, name)

            def timed(*a, _f=f, _name=name, **k):
                t = time.thread_time()
                try:
                    return _f(*a, **k)
                finally:
                    acc[_name] += time.thread_time() - t
            setattr(core, name, timed)

    def uninstall():
        for name in UNITS:
            core.__dict__.pop(name, None)

    t0 = time.perf_counter()
    eng.generate(prompts, {**params, "max_new_tokens": 1})
    t1 = time.perf_counter()
    eng._run_on_loop(install)
    c0 = time.process_time()
    eng.generate(prompts, {**params, "max_new_tokens": 1 + steps})
    c1 = time.process_time()
    t2 = time.perf_counter()
    eng._run_on_loop(uninstall)
    out = {f"{k}_cpu_ms": v / steps * 1000 for k, v in acc.items()}
    out["loop_cpu_ms"] = sum(acc.values()) / steps * 1000
    out["all_threads_cpu_ms"] = (c1 - c0) / steps * 1000  # loop, detokenizer, caller
    out["wall_ms"] = ((t2 - t1) - (t1 - t0)) / steps * 1000
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="64,256")
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
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
