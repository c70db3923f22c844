"""Essay judge (docs/api.md's frontend example): three forked judgments, then a graded select.

    python examples/frontend_judge.py                                  # SmolLM2-135M-Instruct in-process (CPU)
    python examples/frontend_judge.py --remote http://127.0.0.1:30000  # RemoteEngine on `prefixrt serve`
    python examples/frontend_judge.py --base-url http://127.0.0.1:30000/v1 --model smollm2-135m-instruct   # any OpenAI API

In-process and on RemoteEngine the program sends the same prompts, so greedy results are identical.
"""

from __future__ import annotations

import argparse
import time

import prefixrt
from prefixrt import assistant, function, gen, select, system, user

ESSAY = (
    "Cities should plant more trees. Trees cool streets in summer, clean the air and make people walk more. "
    "A study in Melbourne found that shaded streets were four degrees cooler. Planting is cheap compared with "
    "air conditioning, and neighbours can care for young trees together."
)


@function
def judge(s, essay):
    s += system("Evaluate an essay.")
    s += user(essay)
    forks = s.fork(3)
    for f, dim in zip(forks, ["clarity", "originality", "evidence"]):
        f += user(f"Judge {dim}.") + assistant(gen("j", max_tokens=64, stop="END"))
    s += user("Grade?") + assistant(select("grade", choices=["A", "B", "C", "D"]))
    s.forks = forks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--remote", help="a prefixrt serve server (RemoteEngine) instead of in-process")
    ap.add_argument("--base-url", help="an OpenAI-compatible endpoint (OpenAIBackend) instead of in-process")
    args = ap.parse_args()
    engine = None
    if args.remote:
        backend = prefixrt.RemoteEngine(args.remote)
    elif args.base_url:
        import openai

        backend = prefixrt.OpenAIBackend(args.model, client=openai.OpenAI(base_url=args.base_url, api_key="EMPTY"))
    else:
        engine = backend = prefixrt.Engine(args.model)
    t0 = time.perf_counter()
    state = judge.run(essay=ESSAY, backend=backend, temperature=0)
    for f, dim in zip(state.forks, ["clarity", "originality", "evidence"]):
        print(f"--- {dim}\n{f['j'].strip()}")
    print(f"--- grade: {state['grade']}  scores: {state.select_scores('grade')}")
    print(f"time: {time.perf_counter() - t0:.1f}s")
    for f in state.forks:
        print(f"branch first request: prompt {f.requests[0].prompt_tokens} tokens, "
              f"cached {f.requests[0].cached_tokens}")
    if engine is not None:
        s = engine.stats()
        print(f"engine: prompt {s.prompt_tokens_total} tokens, cached {s.cached_tokens_total} "
              f"(hit rate {s.cache_hit_rate:.0%})")
        engine.shutdown()


if __name__ == "__main__":
    main()
