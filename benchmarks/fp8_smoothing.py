"""FP8 weights on the CPU with and without smoothing (model/smoothing.py): the perplexity of tests/data/fp8_eval.txt
(~2,000 tokens, one teacher-forced prefill) on an embedded model, bf16 against FP8 weights quantized at load
(quantize.quantize_fp8_at_load: per-channel least-squares scales) under each activation scheme for tall inputs
(`none` weight-only, `group` 1 x 64, `token` per token), for each smoothing alpha (0: off), with the teacher-forced
top-1 agreement with bf16 and the KL divergence from bf16's next-token distribution (nats a token). The perplexity text is
one prefill, so the scheme decides it; decode batches (at most 64 rows) always run weight-only, so the `none` rows
are what smoothing does to decode. The reference path (kernels/fp8_reference.py) computes every variant.
--kv adds FP8 K/V (scales calibrated on the model the row ran, as an engine does) to every FP8 row.

    PYTHONPATH=$PWD python benchmarks/fp8_smoothing.py --model smollm2-135m-instruct --alphas 0,0.5   # ~10 min
Prints a table last and writes benchmarks/results/fp8_smoothing-<model>.json (the runs of every invocation for
that model are merged into it, keyed by alpha, scheme and K/V dtype).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from benchmarks.common import log, log_table, script_parser

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "fp8_eval.txt"


def prefill_logits(model, ids: list[int], kv_scales=None):
    """float32 logits [len(ids) - 1, vocab] of one prefill of ids (each position given its true prefix) over a
    paged pool with torch attention (an e4m3 pool with kv_scales)."""
    import torch

    from tests.helpers.harness import PagedHarness

    h = PagedHarness(model, num_slots=len(ids) + 8, max_rows=2, max_context=len(ids) + 8,
                     kv_dtype=torch.float8_e4m3fn if kv_scales else None, kv_scales=kv_scales)
    with torch.no_grad():
        return h.forward([(h.new_row(), ids)])[0][:-1].float()


def perplexity(logits, ids: list[int]) -> float:
    import torch

    logprobs = torch.log_softmax(logits, dim=-1)
    return math.exp(-logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].mean().item())


def main() -> None:
    ap = script_parser(__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--alphas", default="0,0.5", help="comma-separated smoothing alphas; 0: no smoothing")
    ap.add_argument("--schemes", default="none,group,token", help="fp8_activation_scale values to run")
    ap.add_argument("--kv", action="store_true", help="FP8 K/V as well (calibrated scales)")
    args = ap.parse_args()
    import torch

    from prefixrt.hub.loader import load_model
    from prefixrt.hub.registry import load_tokenizer, resolve_model
    from prefixrt.model.kv_calibration import calibrate_kv_scales, calibration_tokens
    from prefixrt.model.quantize import quantize_fp8_at_load, set_fp8_activation_scale

    torch.set_num_threads(2)
    resolved = resolve_model(args.model)
    tokenizer = load_tokenizer(resolved)
    ids = tokenizer.encode(TEXT.read_text())
    calibration = calibration_tokens(tokenizer)
    out_file = RESULTS_DIR / f"fp8_smoothing-{args.model}.json"
    saved = json.loads(out_file.read_text()) if out_file.is_file() else {}
    runs = saved.get("runs", {})

    def fresh():
        return load_model(resolved.path, dtype="bfloat16", device="cpu")

    t0 = time.perf_counter()
    base_logits = prefill_logits(fresh(), ids)
    base = perplexity(base_logits, ids)
    base_top1 = base_logits.argmax(-1)
    base_logprobs = torch.log_softmax(base_logits, -1)
    log(f"{args.model}: {len(ids)} tokens, bf16 perplexity {base:.4f} ({time.perf_counter() - t0:.0f}s)")
    for alpha in (float(a) for a in args.alphas.split(",")):
        model = fresh()
        t0 = time.perf_counter()
        quantize_fp8_at_load(model, alpha or None, calibration)
        log(f"alpha {alpha}: smoothed and quantized in {time.perf_counter() - t0:.0f}s")
        scales = calibrate_kv_scales(model, calibration, "cpu") if args.kv else None
        for scheme in args.schemes.split(","):
            set_fp8_activation_scale(model, scheme)
            t0 = time.perf_counter()
            logits = prefill_logits(model, ids, scales)
            ppl = perplexity(logits, ids)
            key = f"alpha={alpha:g} scheme={scheme} kv={'fp8' if args.kv else 'bf16'}"
            kl = torch.nn.functional.kl_div(torch.log_softmax(logits, -1), base_logprobs, log_target=True,
                                            reduction="batchmean").item()  # KL(bf16 || FP8), nats a token
            runs[key] = {"ppl": ppl, "over_bf16": ppl / base - 1, "kl_to_bf16": kl,
                         "teacher_forced_top1": (logits.argmax(-1) == base_top1).float().mean().item()}
            log(f"{key}: perplexity {ppl:.4f} ({100 * (ppl / base - 1):+.2f}% over bf16 {base:.4f}), teacher-forced "
                f"top-1 {runs[key]['teacher_forced_top1']:.1%}, KL {kl:.4f} ({time.perf_counter() - t0:.0f}s)")
    RESULTS_DIR.mkdir(exist_ok=True)
    out_file.write_text(json.dumps({"model": args.model, "tokens": len(ids), "bf16_ppl": base, "runs": runs},
                                   indent=1))
    log_table([(key, f"{100 * r['over_bf16']:+.2f}%", f"top-1 {r['teacher_forced_top1']:.1%}, KL "
                f"{r.get('kl_to_bf16', math.nan):.4f}")
               for key, r in sorted(runs.items())], 8)


if __name__ == "__main__":
    main()
