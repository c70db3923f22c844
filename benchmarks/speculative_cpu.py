"""Speculative decoding on the CPU with the embedded real models (radix lookahead by default, or a draft model):
acceptance and tokens per forward on a document-quoting and a code-editing workload (chat prompts, greedy), and
the outputs checked against plain decoding (identical), with wall time and forward passes of both.

    PYTHONPATH=$PWD python benchmarks/speculative_cpu.py                       # smollm2-135m-instruct, ~1-2 min
    PYTHONPATH=$PWD python benchmarks/speculative_cpu.py --model gemma-3-270m  # (a base model: a raw prompt)
    PYTHONPATH=$PWD python benchmarks/speculative_cpu.py --speculative draft:smollm2-135m-instruct  # a draft model
Prints a short table last and writes benchmarks/results/speculative_cpu-<model>[-draft-<draft>].json.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks.common import log, log_table, script_parser

RESULTS_DIR = Path(__file__).resolve().parent / "results"

DOCUMENT = (
    "The Lighthouse Keeper's Log. In the winter of 1887 the lamp at Carrow Point burned every night without fail. "
    "The keeper, Elias Marr, wrote that the oil was delivered by boat on the first Monday of each month, and that "
    "the boat was late only twice, both times because of ice in the harbour. He noted that the fog signal was "
    "sounded for a total of 212 hours that season, more than in any year before. In March a ship called the "
    "Northern Star ran aground two miles south of the point; all nine of her crew were brought ashore by the "
    "village lifeboat before dawn. Marr recorded that the lens was cleaned each morning at six and the wick "
    "trimmed at noon, and that his daughter Ann kept the log whenever he was ill."
)
QUESTIONS = [
    "Quote, word for word, the sentence of the document about the Northern Star.",
    "Quote, word for word, the sentence of the document about the fog signal.",
    "Copy the first three sentences of the document exactly.",
    "Quote exactly what the document says about the lens and the wick.",
]
CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item["price"] * item["quantity"]
    tax = subtotal * tax_rate
    return subtotal + tax


def cheapest(items):
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best
'''
EDITS = [
    "Rewrite this code with the variable `subtotal` renamed to `net`. Output only the code.",
    "Add a docstring to each function of this code. Output only the code.",
    "Rewrite this code so that `cheapest` returns None for an empty list explicitly. Output only the code.",
    "Rename the function `total_price` to `order_total` in this code. Output only the code.",
]


def prompts(eng, model: str) -> dict[str, list[list[int]]]:
    doc = [f"Document:\n{DOCUMENT}\n\n{q}" for q in QUESTIONS]
    code = [f"{e}\n\n```python\n{CODE}```" for e in EDITS]
    if "instruct" in model:
        enc = lambda text: eng.encode_chat([{"role": "user", "content": text}])  # noqa: E731
    else:
        enc = lambda text: eng.encode(text + "\n\nAnswer:\n")  # noqa: E731
    return {"document_quoting": [enc(t) for t in doc], "code_editing": [enc(t) for t in code]}


def run(eng, ps: list[list[int]], max_new: int, spec: bool) -> tuple[list, dict, float]:
    s0 = eng.stats()
    t0 = time.perf_counter()
    outs = [eng.generate(p, {"max_new_tokens": max_new, "temperature": 0, "speculative": spec}) for p in ps]
    dt = time.perf_counter() - t0
    s1 = eng.stats()
    d = {k: getattr(s1, k) - getattr(s0, k) for k in (
        "forward_passes_total", "generated_tokens_total", "spec_draft_tokens_total", "spec_accepted_tokens_total",
        "spec_emitted_tokens_total", "spec_verify_rows_total")}
    return outs, d, dt


def main() -> None:
    ap = script_parser(__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-new", type=int, default=160)
    ap.add_argument("--k", type=int, default=8, help="drafted tokens per step at most")
    ap.add_argument("--speculative", default="ngram", help="ngram, or draft:MODEL (a draft model)")
    ap.add_argument("--device", default="cpu", help="cpu (the figures), or cuda (a check of the same workloads)")
    args = ap.parse_args()
    import prefixrt

    eng = prefixrt.Engine(args.model, device=args.device, dtype="float32", speculative=args.speculative,
                          speculative_num_tokens=args.k)
    drafter = eng.probes.drafter
    results: dict = {"model": args.model, "device": args.device, "speculative": args.speculative, "k": args.k,
                     "max_new": args.max_new,
                     "date": time.strftime("%Y-%m-%d", time.gmtime())}
    rows = []
    try:
        for name, ps in prompts(eng, args.model).items():
            eng.flush_cache()
            plain, dp, tp = run(eng, ps, args.max_new, spec=False)
            eng.flush_cache()  # the plain answers must not be drafted from the tree: own context only
            draft_forwards = getattr(drafter, "draft_forwards", 0)
            spec, ds, ts = run(eng, ps, args.max_new, spec=True)
            ds["draft_model_forwards"] = getattr(drafter, "draft_forwards", 0) - draft_forwards
            acc = ds["spec_accepted_tokens_total"] / max(1, ds["spec_draft_tokens_total"])
            tpf = ds["spec_emitted_tokens_total"] / max(1, ds["spec_verify_rows_total"])
            r = {"identical": [o.token_ids for o in plain] == [o.token_ids for o in spec], "plain": dp, "spec": ds, "plain_s": round(tp, 2), "spec_s": round(ts, 2),
                 "acceptance": round(acc, 3), "tokens_per_verify_row": round(tpf, 2),
                 "tokens_per_forward_plain": round(dp["generated_tokens_total"] / dp["forward_passes_total"], 2),
                 "tokens_per_forward_spec": round(ds["generated_tokens_total"] / ds["forward_passes_total"], 2),
                 "speedup_wall": round(tp / ts, 2), "sample_output": spec[0].text[:300]}
            results[name] = r
            log(json.dumps(r, indent=1))
            rows.append((name, f"{acc:.2f}", f"{tpf:.2f} tok/verify row; {r['tokens_per_forward_spec']} vs "
                         f"{r['tokens_per_forward_plain']} tok/forward; wall {r['speedup_wall']}x; identical "
                         f"{r['identical']}"))
    finally:
        eng.shutdown()
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.device == "cpu" else f"-{args.device}"
    suffix += "" if args.speculative == "ngram" else "-" + args.speculative.replace(":", "-").replace("/", "_")
    (RESULTS_DIR / f"speculative_cpu-{args.model}{suffix}.json").write_text(json.dumps(results, indent=1))
    log(f"\n{args.speculative} speculation on {args.device}, {args.model}, k={args.k}, {args.max_new} new tokens")
    log_table([("workload", "accept", "")] + rows, 8)


if __name__ == "__main__":
    main()
