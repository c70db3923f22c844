"""Long-keys JSON at batch 64 (gpu_engine.json_bench) under three matcher set-ups in one engine: matchers copied
from a warmed per-grammar template (LLGuidanceBackend warm_lexer=True), fresh matchers built from the grammar
text (the default), and the budget rule switched off (with template copies, as in the run of 2026-12-01).

    PYTHONPATH=$PWD python benchmarks/gpu_json_diag.py
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_engine as G  # noqa: E402

import prefixrt  # noqa: E402
import prefixrt.engine.engine as E  # noqa: E402


def main() -> None:
    eng = prefixrt.Engine("llama-3-8b", load_format="dummy", kv_cache_tokens=200_000)
    backend = eng.core.grammar_backend
    plain_budget = E.budget_matcher
    rows = []
    for name, warm, budget in (("template copies", True, True), ("fresh matchers", False, True),
                               ("template copies, no budget rule", True, False)):
        backend.warm_lexer = warm
        E.budget_matcher = plain_budget if budget else (lambda b, c, n: b.matcher(c))
        try:
            r = G.json_bench(eng, eng.vocab_size, 64)
            rows.append((name, round(r["jf_on"]["tok_s"]), round(r["jf_off"]["tok_s"]), round(r["jf_off"]["step_ms"], 2),
                         round(r["unconstrained"]["step_ms"], 2)))
        except Exception as e:
            traceback.print_exc()
            rows.append((name, "FAILED", str(e)[:100], None, None))
        print(rows[-1], flush=True)
    print("set-up | jump-forward on tok/s | off tok/s | constrained step ms | unconstrained step ms")
    for r in rows:
        print(" | ".join(str(x) for x in r))
    eng.shutdown()


if __name__ == "__main__":
    main()
