"""FP8 weights on the CPU with per-token against per-group activation scales: the perplexity of
tests/model/test_fp8_accuracy.py's text on an embedded model, bf16 against FP8 weights (per-channel, least-squares
scales) with activations quantized per token (`fp8_activation_scale="token"`) and per group of G values of a token
(one e4m3 scale per 1 x G block), and with 128 x 128 weight blocks and the same groups. The reference path
(kernels/fp8_reference.py) computes every variant. --group 0 (the default) takes the shipped rule,
fp8_reference.activation_group_size (64); another G swaps the reference's
activation quantization for groups of G here only.

    PYTHONPATH=$PWD python benchmarks/fp8_activation_groups.py --model smollm2-135m-instruct --group 64   # ~5 min
Prints a short table last and writes benchmarks/results/fp8_activation_groups-<model>-g<G>.json (g0: the rule).
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.common import log, log_table, script_parser

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def fixed_group_fp8_linear(group: int):
    """kernels/fp8_reference.fp8_linear with activations quantized per 1 x group block of each row, whatever K."""
    from prefixrt.kernels import fp8_reference as ref

    def fp8_linear(x, w_q, w_scale, bias=None, activation_scale="group"):
        x_q, scale = ref.quantize_groups(x, group)
        y = (x_q.float() * ref.expand_group_scales(scale, x.shape[1], group)) @ ref.dequantize_weight(w_q, w_scale).T
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
    ap.add_argument("--group", type=int, default=0,
                    help="activation values per e4m3 scale; 0: the shipped rule (activation_group_size)")
    args = ap.parse_args()
    import torch
    from prefixrt.kernels import fp8_reference as ref

    from prefixrt.hub.loader import load_model
    from prefixrt.hub.registry import load_tokenizer, resolve_model
    from prefixrt.model.quantize import quantize_fp8_weights, set_fp8_activation_scale
    from tests.model.test_fp8_accuracy import TEXT, perplexity_and_greedy

    torch.set_num_threads(2)
    resolved = resolve_model(args.model)
    ids = load_tokenizer(resolved).encode(TEXT.read_text())

    def ppl(model) -> float:
        return perplexity_and_greedy(model, ids, [ids[:8]])["ppl"]

    def fresh():
        return load_model(resolved.path, dtype="bfloat16", device="cpu")

    base = ppl(fresh())
    shipped = ref.fp8_linear
    groups = f"1 x {args.group}" if args.group else "1 x G (the rule)"
    rows = {}
    for label, weights, scheme in (("W per channel, A per token", quantize_fp8_weights, "token"),
                                   (f"W per channel, A per {groups}", quantize_fp8_weights, "group"),
                                   (f"W 128 x 128 blocks, A per {groups}", block_weights, "group")):
        model = fresh()
        weights(model)
        set_fp8_activation_scale(model, scheme)
        if scheme == "group" and args.group:
            ref.fp8_linear = fixed_group_fp8_linear(args.group)
        try:
            rows[label] = ppl(model)
        finally:
            ref.fp8_linear = shipped
        log(f"{label}: perplexity {rows[label]:.4f} ({100 * (rows[label] / base - 1):+.2f}% over bf16 {base:.4f})")
    out = {"model": args.model, "group": args.group, "tokens": len(ids), "bf16_ppl": base, "fp8_ppl": rows}
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"fp8_activation_groups-{args.model}-g{args.group}.json").write_text(json.dumps(out, indent=1))
    log_table([(label, f"{100 * (p / base - 1):+.2f}%", "target <= +2%") for label, p in rows.items()], 40)


if __name__ == "__main__":
    main()
