"""Long-keys JSON at batch 64 (benchmarks/common.py's json_bench) under matcher set-ups in one engine, each with its own
unconstrained baseline: string lengths checked beside the grammar (LLGuidanceBackend string_lengths=True, the
default) or compiled into it (False, as before), then optionally the older set-ups (SETUPS=all): matchers copied
from a warmed per-grammar template (warm_lexer=True) and the budget rule switched off; SWITCH_INTERVALS=a,b runs
every set-up under each GIL switch interval (seconds); MASK_PARTS=4,1 under each GrammarMasks.parts;
ALLOCS=numpy,full runs every set-up with the step's host bitmask allocated as now (numpy fill, one thread) and as
before (torch.full, which wakes torch's OpenMP workers); TORCH_THREADS=n sets torch's intra-op threads (torch.set_num_threads) before the engine starts; PROFILE=n prints the loop thread's cProfile (n lines)
of one more batch of the last set-up, jump-forward off (PROFILE_JF=on: on).

    PYTHONPATH=$PWD python benchmarks/gpu_json_diag.py [--order on,off]
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch

import prefixrt
import prefixrt.engine.engine as E
from benchmarks.common import LONG_KEYS_SCHEMA, json_bench, script_parser


def profile_batch(eng, lines: int, jump_forward: bool) -> None:
    """cProfile of the loop thread over one batch (cumulative, then own time)."""
    import io
    import pstats
    import random

    rng = random.Random(11)
    prompts = [[rng.randrange(16, eng.vocab_size) for _ in range(64)] for _ in range(64)]
    eng.flush_cache()
    with eng.probes.profile_loop() as prof:
        eng.generate(prompts, {"max_new_tokens": 200, "temperature": 0, "json_schema": LONG_KEYS_SCHEMA,
                               "jump_forward": jump_forward})
    for key in ("cumulative", "tottime"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(lines)
        print(s.getvalue(), flush=True)


def main() -> None:
    ap = script_parser(__doc__)
    ap.add_argument("--order", default="on,off", help="string lengths beside the grammar (on) or in it (off), "
                    "one set-up each, in this order")
    args = ap.parse_args()
    if os.environ.get("TORCH_THREADS"):
        torch.set_num_threads(int(os.environ["TORCH_THREADS"]))
    eng = prefixrt.Engine("llama-3-8b", load_format="dummy", kv_cache_tokens=200_000)
    print("torch threads after start-up:", torch.get_num_threads(), flush=True)
    backend = eng.grammar_compiler().backend
    plain_budget = E.budget_matcher
    rows, raw = [], {}
    order = args.order.split(",")
    setups = [(f"string lengths {'beside' if o == 'on' else 'in'} the grammar", False, True, o == "on") for o in order]
    if os.environ.get("SETUPS") == "all":
        setups += [("template copies", True, True, True), ("template copies, no budget rule", True, False, True)]
    if os.environ.get("SWITCH_INTERVALS"):  # the same set-ups again under other GIL switch intervals (seconds)
        setups = [(f"{n}, switch interval {x}", w, b, ln, float(x)) for x in os.environ["SWITCH_INTERVALS"].split(",")
                  for n, w, b, ln in setups]
    else:
        setups = [(*s, None) for s in setups]
    if os.environ.get("MASK_PARTS"):  # the same set-ups again with the next step's masks in other numbers of parts
        setups = [(f"{n}, mask parts {k}", w, b, ln, x, int(k)) for k in os.environ["MASK_PARTS"].split(",")
                  for n, w, b, ln, x in setups]
    else:
        setups = [(*s, None) for s in setups]
    import prefixrt.constrained.logits as L

    allocs = {"numpy": L.allocate_bitmask,
              "full": lambda b, v, device="cpu", pinned=False: torch.full(
                  (b, L.bitmask_width(v)), -1, dtype=torch.int32, device=device, pin_memory=pinned)}
    if os.environ.get("ALLOCS"):
        setups = [(f"{n}, bitmask {a}", w, b, ln, x, k, a) for a in os.environ["ALLOCS"].split(",")
                  for n, w, b, ln, x, k in setups]
    else:
        setups = [(*s, "numpy") for s in setups]
    default_interval = sys.getswitchinterval()
    for name, warm, budget, lengths, interval, parts, alloc in setups:
        L.allocate_bitmask = allocs[alloc]
        sys.setswitchinterval(interval or default_interval)
        eng.probes.set_mask_parts(parts or 4)
        backend.warm_lexer = warm
        backend.string_lengths = lengths
        E.budget_matcher = plain_budget if budget else (lambda b, c, n: b.matcher(c))
        try:
            r = json_bench(eng, eng.vocab_size, 64)
            raw[f"{len(raw)}: {name}"] = r
            rows.append((name, round(r["jf_on"]["tok_s"]), round(r["jf_off"]["tok_s"]), round(r["jf_off"]["step_ms"], 2),
                         round(r["unconstrained"]["step_ms"], 2), round(r["jf_speedup"], 3),
                         round(r["constrained_step_over_unconstrained"], 3)))
        except Exception as e:
            traceback.print_exc()
            rows.append((name, "FAILED", str(e)[:100], None, None))
        print(rows[-1], flush=True)
    L.allocate_bitmask = allocs["numpy"]
    print("set-up | jump-forward on tok/s | off tok/s | constrained step ms | unconstrained step ms | jf on/off | "
          "constrained/unconstrained")
    for r in rows:
        print(" | ".join(str(x) for x in r))
    if os.environ.get("PROFILE"):
        profile_batch(eng, int(os.environ["PROFILE"]), os.environ.get("PROFILE_JF") == "on")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "json_diag.json"), "w") as f:
            json.dump({"rows": rows, "raw": raw}, f, indent=1, default=str)
    eng.shutdown()


if __name__ == "__main__":
    main()
