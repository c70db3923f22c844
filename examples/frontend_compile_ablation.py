"""Interpreter vs compiled (`prog.compile()`) on a short program run 64 times; prints one table.

The program: a constant instruction (system message), the essay (argument), two judge forks of 8 tokens and a
select. Both modes run on the same engine with its cache flushed before each mode; "one by one" runs the 64
programs sequentially (--sequential), "batch" through run_batch with 8 threads. Greedy results must be
identical.

    PYTHONPATH=. python examples/frontend_compile_ablation.py                 # Gemma-3-270M, CPU
    PYTHONPATH=. python examples/frontend_compile_ablation.py --model PATH   # any local checkpoint
"""

from __future__ import annotations

import argparse
import time

import prefixrt
from prefixrt.frontend import ProviderBackend, assistant, function, gen, select, system, user

INSTRUCTION = ("You grade student essays. Read the essay, then judge it on the dimension you are asked about "
               "in one short sentence. Be strict but fair: clarity means the argument can be followed, and "
               "evidence means claims are supported by examples or sources. ") * 2


@function
def grade(s, essay):
    s += system(INSTRUCTION)
    s += user(essay)
    forks = s.fork(2)
    for f, dim in zip(forks, ["clarity", "evidence"]):
        f += user(f"Judge {dim}.") + assistant(gen("verdict", max_tokens=8))
    s += user("Overall grade?") + assistant(select("grade", choices=["A", "B", "C", "D"]))


def results(states):
    return [([b["verdict"] for b in st.branches], st["grade"]) for st in states]


def measure(engine, label, fn):
    engine.flush_cache()
    s0 = engine.stats()
    t0 = time.perf_counter()
    states = fn()
    seconds = time.perf_counter() - t0
    s1 = engine.stats()
    prompt = s1.prompt_tokens_total - s0.prompt_tokens_total
    cached = s1.cached_tokens_total - s0.cached_tokens_total
    print(f"{label}: {seconds:.2f} s", flush=True)
    return label, seconds, prompt, prompt - cached, results(states)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--runs", type=int, default=64)
    ap.add_argument("--sequential", action="store_true", help="also run the programs one by one")
    args = ap.parse_args()
    engine = prefixrt.Engine(args.model, device=args.device)
    essays = [{"essay": f"Essay {i}: cities should plant more trees because shade lowers summer temperatures "
                        f"by {i % 7 + 1} degrees and trees clean the air."} for i in range(args.runs)]
    be = ProviderBackend(engine)

    def one_by_one(prog):
        return lambda: [prog.run(backend=be, temperature=0, **kw) for kw in essays]

    def batch(prog):
        return lambda: prog.run_batch(essays, backend=be, temperature=0, num_threads=8)

    try:
        # a fresh CompiledProgram per mode: its prefetch (after the flush) is part of the measured time
        rows = [measure(engine, "interpreter batch", batch(grade)),
                measure(engine, "compiled batch", batch(grade.compile()))]
        if args.sequential:
            rows += [measure(engine, "interpreter one by one", one_by_one(grade)),
                     measure(engine, "compiled one by one", one_by_one(grade.compile()))]
    finally:
        engine.shutdown()
    same = all(r[4] == rows[0][4] for r in rows)
    print(f"model {args.model}, device {args.device}, {args.runs} runs; greedy results identical: {same}")
    print("| mode | seconds | runs/s | prompt tokens | prefilled (not cached) |")
    print("|---|---|---|---|---|")
    for label, seconds, prompt, computed, _ in rows:
        print(f"| {label} | {seconds:.2f} | {args.runs / seconds:.2f} | {prompt} | {computed} |")


if __name__ == "__main__":
    main()
