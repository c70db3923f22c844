"""FP8 weights on the CPU with finer activation scales: the perplexity of tests/model/test_fp8_accuracy.py's text
on an embedded model, bf16 against FP8 weights (per-channel, least-squares scales) with activations quantized
per token (what the kernels do) and per group of G values of a token (one e4m3 scale per 1 x G block, what a
kernel with a scale per K group would do), and with 128 x 128 weight blocks and the same groups. The reference
path (kernels/fp8_reference.py) computes every variant; the groups swap its activation quantization here only.

    PYTHONPATH=$PWD python benchmarks/fp8_activation_groups.py --model smollm2-135m-instruct --group 64   # ~5 min
Prints a short table last and writes benchmarks/results/fp8_activation_groups-<model>-g<G>.json.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.common import log, log_table, script_parser

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def grouped_fp8_linear(group: int):
    """kernels/fp8_reference.fp8_linear with activations quantized per 1 x group block of each row."""
    from prefixrt.kernels import fp8_reference as ref

    def fp8_linear(x, w_q, w_scale, bias=None):
        m, k = x.shape
        if k % group:
            raise ValueError(f"K = {k} is not a multiple of the group size {group}")
        blocks = x.float().reshape(m, k // group, group)
        scale = ref._per_max(blocks.abs().amax(-1).clamp_min(ref.MIN_AMAX))
        x_q = (blocks / scale[..., None]).clamp(-ref.FP8_MAX, ref.FP8_MAX).to(ref.FP8)
        y = (x_q.float() * scale[..., None]).reshape(m, k) @ ref.dequantize_weight(w_q, w_scale).T
        return (y + bias.float() if bias is not None else y).to(x.dtype)

    return fp8_linear


def block_weights(model) -> None:
    """Every FP8-capable linear quantized in 128 x 128 blocks (kernels/fp8_reference.quantize_blocks)."""
    from prefixrt.kernels.fp8_reference import quantize_blocks
    from torch import nn

    from prefixrt.model.quantize import fp8_linears

    for module in fp8_linears(model).values():
        w_q, scale = quantize_blocks(module.weight.data)
        module.weight = nn.Parameter(w_q, requires_grad=False)
        module.weight_scale = nn.Parameter(scale, requires_grad=False)


def main() -> None:
    ap = script_parser(__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--group", type=int, default=64, help="activation values per e4m3 scale (must divide K)")
    args = ap.parse_args()
    import torch
    from prefixrt.kernels import fp8_reference as ref

    from prefixrt.hub.loader import load_model
    from prefixrt.hub.registry import load_tokenizer, resolve_model
    from prefixrt.model.quantize import quantize_fp8_weights
    from tests.model.test_fp8_accuracy import TEXT, perplexity_and_greedy

    torch.set_num_threads(2)
    resolved = resolve_model(args.model)
    ids = load_tokenizer(resolved).encode(TEXT.read_text())

    def ppl(model) -> float:
        return perplexity_and_greedy(model, ids, [ids[:8]])["ppl"]

    def fresh():
        return load_model(resolved.path, dtype="bfloat16", device="cpu")

    base = ppl(fresh())
    per_token = ref.fp8_linear
    rows = {}
    for label, weights, grouped in (("W per channel, A per token", quantize_fp8_weights, False),
                                    (f"W per channel, A per 1 x {args.group}", quantize_fp8_weights, True),
                                    (f"W 128 x 128 blocks, A per 1 x {args.group}", block_weights, True)):
        model = fresh()
        weights(model)
        ref.fp8_linear = grouped_fp8_linear(args.group) if grouped else per_token
        try:
            rows[label] = ppl(model)
        finally:
            ref.fp8_linear = per_token
        log(f"{label}: perplexity {rows[label]:.4f} ({100 * (rows[label] / base - 1):+.2f}% over bf16 {base:.4f})")
    out = {"model": args.model, "group": args.group, "tokens": len(ids), "bf16_ppl": base, "fp8_ppl": rows}
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"fp8_activation_groups-{args.model}-g{args.group}.json").write_text(json.dumps(out, indent=1))
    log_table([(label, f"{100 * (p / base - 1):+.2f}%", "target <= +2%") for label, p in rows.items()], 40)


if __name__ == "__main__":
    main()
