"""Fork benchmark: a tree-of-thought program (levels x branches) with the fork prefix hint on and off.

    python -m prefixrt.bench.fork_bench [--model gemma-3-270m] [--levels 3] [--branches 3] [--max-tokens 16]

Prints, per setting: wall time, prompt tokens, cached tokens and computed (= prompt - cached) tokens from the
engine counters. Settings: the fork hint on/off, with the engine's in-batch shared-prefill dedup on (default)
and off (switched off on the scheduler's config, to stand in for an engine that does not dedup requests
arriving together: there the hint is what keeps the branches from prefilling the prefix k times).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from prefixrt.default_models import BASE_MODEL
from prefixrt.frontend import ProviderBackend, function, gen

CONTEXT = (
    "A small bakery sells bread, cakes and pastries. Each morning the baker bakes forty loaves, twelve cakes "
    "and sixty croissants. Bread sells for three dollars, cakes for twenty dollars and croissants for two "
    "dollars. On weekdays about three quarters of everything is sold; on weekends everything is sold by noon. "
    "Flour costs rise by ten percent this year, and the shop can either raise prices, bake less, or open a "
    "second counter at the train station where commuters buy coffee and croissants early in the morning."
)


@function
def tree_of_thought(s, question: str, levels: int = 3, branches: int = 3, max_tokens: int = 16,
                    context_repeat: int = 1):
    s += f"{' '.join([CONTEXT] * context_repeat)}\nQuestion: {question}\nLet us explore several ideas step by step.\n"
    s.leaves = []
    _expand(s, s.leaves, levels, branches, max_tokens, "")


def _expand(s, leaves: list, levels: int, branches: int, max_tokens: int, path: str) -> None:
    if levels == 0:
        leaves.append(s)
        return
    for i, f in enumerate(s.fork(branches)):
        label = f"{path}.{i + 1}" if path else f"{i + 1}"
        f += f"Idea {label}:" + gen("idea", max_tokens=max_tokens, stop="\n") + "\n"
        _expand(f, leaves, levels - 1, branches, max_tokens, label)


def run_once(engine, prefix_hints: bool, levels: int, branches: int, max_tokens: int, dedup: bool = True,
             context_repeat: int = 1) -> dict:
    scheduler = engine.core.scheduler  # benchmark-only switch of an engine setting on a running engine
    scheduler.settings = dataclasses.replace(scheduler.settings, dedup_shared_prefill=dedup)
    engine.flush_cache()
    before = engine.stats()
    backend = ProviderBackend(engine, prefix_hints=prefix_hints)
    t0 = time.perf_counter()
    st = tree_of_thought.run(question="How should the bakery respond to the flour price rise?", levels=levels,
                             branches=branches, max_tokens=max_tokens, context_repeat=context_repeat,
                             backend=backend, temperature=0)
    seconds = time.perf_counter() - t0
    after = engine.stats()
    prefix_len = len(backend.encode(st.text()))  # the root's text: the prefix shared by every branch
    firsts = [leaf for leaf in st.leaves]
    return {
        "prefix_hints": prefix_hints,
        "engine_dedup": dedup,
        "seconds": round(seconds, 2),
        "gens": branches * (branches ** levels - 1) // (branches - 1),
        "prompt_tokens": after.prompt_tokens_total - before.prompt_tokens_total,
        "cached_tokens": after.cached_tokens_total - before.cached_tokens_total,
        "generated_tokens": after.generated_tokens_total - before.generated_tokens_total,
        "root_prefix_tokens": prefix_len,
        "leaf_ideas": [leaf["idea"] for leaf in firsts],
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=BASE_MODEL)
    ap.add_argument("--levels", type=int, default=3)
    ap.add_argument("--branches", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--context-repeat", type=int, default=1, help="repeat the shared context (longer prefix)")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    from prefixrt.engine.engine import Engine

    with Engine(args.model, load_format=args.load_format) as eng:
        run_once(eng, True, 1, 2, 2)  # warm-up (first forward passes are slower)
        rows = [run_once(eng, hint, args.levels, args.branches, args.max_tokens, dedup, args.context_repeat)
                for dedup in (True, False) for hint in (True, False)]
        same = all(r["leaf_ideas"] == rows[0]["leaf_ideas"] for r in rows)
    print(f"model={args.model} tree={args.levels}x{args.branches} max_tokens={args.max_tokens} "
          f"root prefix={rows[0]['root_prefix_tokens']} tokens")
    print(f"{'dedup':>5} {'hint':>5} {'seconds':>8} {'gens':>5} {'prompt_tok':>10} {'cached_tok':>10} {'computed':>9} {'gen_tok':>8}")
    for r in rows:
        print(f"{'on' if r['engine_dedup'] else 'off':>5} {'on' if r['prefix_hints'] else 'off':>5} {r['seconds']:>8} {r['gens']:>5} {r['prompt_tokens']:>10} "
              f"{r['cached_tokens']:>10} {r['prompt_tokens'] - r['cached_tokens']:>9} {r['generated_tokens']:>8}")
    print(f"same leaf outputs in every setting: {same}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "same_outputs": same}, fh, indent=1)


if __name__ == "__main__":
    main()
