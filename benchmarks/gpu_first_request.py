"""The first constrained request after start-up, with the grammar backend built at start-up
(EngineConfig.grammar_warm_up, the CUDA default) and without it: one engine each, in that order. Per engine: the
start-up report's seconds (total, grammar warm-up), then the latency of a first and a second long-keys JSON request
(benchmarks/common.py's long-keys schema, greedy, 64 tokens at most), of a request with a schema not seen before (the same keys, other
bounds: compile and cold per-schema caches, without the first-use costs) and of an unconstrained request.

    PYTHONPATH=$PWD python benchmarks/gpu_first_request.py [--model llama-3-8b]
"""

from __future__ import annotations

import json
import os
import random
import time

import prefixrt
from benchmarks.common import LONG_KEYS_SCHEMA, script_parser


def timed(eng, prompt, params) -> float:
    t = time.perf_counter()
    eng.generate(prompt, params)
    return (time.perf_counter() - t) * 1000


def main() -> None:
    ap = script_parser(__doc__)
    ap.add_argument("--model", default="llama-3-8b", help="registry name or local folder (dummy weights)")
    ap.add_argument("--kv-tokens", type=int, default=100_000, help="each engine's KV pool, in tokens")
    args = ap.parse_args()
    rng = random.Random(3)
    rows = []
    for warm in (True, False):
        eng = prefixrt.Engine(args.model, load_format="dummy", kv_cache_tokens=args.kv_tokens, grammar_warm_up=warm)
        startup = eng.probes.facts()["startup"]
        prompts = [[rng.randrange(16, eng.vocab_size) for _ in range(64)] for _ in range(4)]
        other = json.loads(json.dumps(LONG_KEYS_SCHEMA).replace('"maxLength": 16', '"maxLength": 15'))
        json_params = {"max_new_tokens": 64, "temperature": 0, "json_schema": LONG_KEYS_SCHEMA}
        row = {"grammar_warm_up": warm, "startup_s": round(startup.get("total_s", 0), 2),
               "grammar_warm_s": round(startup.get("grammar_warm_s", 0), 2),
               "first_json_ms": round(timed(eng, prompts[0], json_params), 1),
               "second_json_ms": round(timed(eng, prompts[1], json_params), 1),
               "new_schema_ms": round(timed(eng, prompts[3], {**json_params, "json_schema": other}), 1),
               "plain_ms": round(timed(eng, prompts[2], {"max_new_tokens": 64, "temperature": 0,
                                                          "ignore_eos": True}), 1)}
        eng.shutdown()
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("grammar warm-up | start-up s | of which grammar s | first JSON request ms | second JSON ms | "
          "new schema ms | plain ms")
    for r in rows:
        print(" | ".join(str(r[k]) for k in ("grammar_warm_up", "startup_s", "grammar_warm_s", "first_json_ms",
                                             "second_json_ms", "new_schema_ms", "plain_ms")))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "first_request.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
