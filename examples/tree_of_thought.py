"""Tree of thought: 3 levels x 3 branches of forked ideas; every fork commits its shared prefix first.

    python examples/tree_of_thought.py [--model smollm2-135m-instruct] [--levels 3] [--branches 3] [--no-hint]
"""

from __future__ import annotations

import argparse
import time

import prefixrt
from prefixrt.bench.fork_bench import tree_of_thought
from prefixrt.frontend import ProviderBackend


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--levels", type=int, default=3)
    ap.add_argument("--branches", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--no-hint", action="store_true", help="do not cache fork prefixes first (ablation)")
    args = ap.parse_args()
    with prefixrt.Engine(args.model) as eng:
        backend = ProviderBackend(eng, prefix_hints=not args.no_hint)
        t0 = time.perf_counter()
        st = tree_of_thought.run(question="How should the bakery respond to the flour price rise?",
                                 levels=args.levels, branches=args.branches, max_tokens=args.max_tokens,
                                 backend=backend, temperature=0)
        seconds = time.perf_counter() - t0
        for leaf in st.leaves:
            print(leaf.text()[len(st.text()):].rstrip().replace("\n", " | "))
        s = eng.stats()
        print(f"{len(st.leaves)} leaves in {seconds:.1f}s; prompt {s.prompt_tokens_total} tokens, "
              f"cached {s.cached_tokens_total} ({s.cache_hit_rate:.0%})")


if __name__ == "__main__":
    main()
