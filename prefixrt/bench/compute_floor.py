"""The bf16 compute floor of prefill: how fast the computed (uncached) prompt tokens of a run could go if
the GPU did nothing but their matmul FLOPs at its dense peak.

FLOPs of computing the prompt tokens [cached, prompt) of one request:
    2 * linear_params * (prompt - cached)                    (every linear of every layer, once per token)
  + sum over layers of 4 * heads * head_dim * keys(p)        (q.k and p.v, for each computed position p)
with keys(p) = p + 1 (causal), or min(p + 1, window) on a sliding-window layer. linear_params counts the
decoder layers' projections only: the embedding is a lookup, and prefill evaluates lm_head on one token.
"""

from __future__ import annotations

from dataclasses import dataclass

H200_BF16_DENSE_TFLOPS = 790.0


@dataclass(frozen=True)
class ModelShape:
    linear_params: int  # weights of the decoder layers' linears (q/k/v/o, MLP)
    attention: tuple[tuple[int, int, int | None], ...]  # per layer: (num_heads, head_dim, sliding_window)

    @classmethod
    def of(cls, model) -> ModelShape:
        """From a CausalLM (model.model.layers and model.attention_layers)."""
        import torch

        params = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
        layers = tuple((a.num_heads, a.head_dim, a.sliding_window) for a in model.attention_layers)
        return cls(params, layers)


def _keys_sum(lo: int, hi: int, window: int | None) -> int:
    """sum over p in [lo, hi) of the keys position p attends: p + 1, capped at window."""
    def causal(a: int, b: int) -> int:  # sum of (p + 1) for p in [a, b)
        return (b * (b + 1) - a * (a + 1)) // 2

    if window is None or hi <= window:
        return causal(lo, hi)
    split = max(lo, min(hi, window))  # positions >= window - 1 attend exactly `window` keys
    return causal(lo, split) + (hi - split) * window


def prefill_flops(shape: ModelShape, prompt_len: int, cached_len: int) -> float:
    computed = prompt_len - cached_len
    attn = sum(4 * h * d * _keys_sum(cached_len, prompt_len, w) for h, d, w in shape.attention)
    return 2.0 * shape.linear_params * computed + attn


def floor_report(shape: ModelShape, requests: list[tuple[int, int]], duration_s: float,
                 peak_tflops: float = H200_BF16_DENSE_TFLOPS) -> dict:
    """requests: (prompt_tokens, cached_tokens) each. -> computed tokens, their throughput over the run's
    duration, the floor's throughput (the same tokens at peak_tflops) and the fraction of it reached."""
    computed = sum(p - c for p, c in requests)
    flops = sum(prefill_flops(shape, p, c) for p, c in requests)
    floor_s = flops / (peak_tflops * 1e12)
    tok_s = computed / duration_s if duration_s else 0.0
    floor_tok_s = computed / floor_s if floor_s else 0.0
    return {"computed_prompt_tokens": computed, "prefill_tflop": round(flops / 1e12, 3),
            "computed_tok_s": round(tok_s, 1), "floor_tok_s": round(floor_tok_s, 1),
            "fraction_of_floor": round(tok_s / floor_tok_s, 4) if floor_tok_s else 0.0,
            "achieved_tflops": round(flops / duration_s / 1e12, 1) if duration_s else 0.0,
            "peak_tflops": peak_tflops}


def format_floor(label: str, report: dict) -> str:
    return (f"{label}: computed prompt tokens {report['computed_prompt_tokens']} at "
            f"{report['computed_tok_s']:.0f} tok/s ({report['achieved_tflops']:.0f} TFLOP/s) | bf16 floor "
            f"{report['floor_tok_s']:.0f} tok/s at {report['peak_tflops']:.0f} TFLOP/s | "
            f"{report['fraction_of_floor']:.1%} of the floor")
