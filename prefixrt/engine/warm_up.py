"""The start-up warm-up's shapes: the eager EXTEND batches whose kernel variants compile (and whose activation
memory is reserved) at start-up rather than inside a user's request. engine/builder.py runs them before the CUDA
graphs are captured; tests/engine/test_warm_up_coverage.py checks they cover every variant a served workload
reaches outside the graphs.
"""

from __future__ import annotations

import torch

EXTEND_GRAPH_TOKENS = 1024  # EXTEND batches up to this many tokens replay CUDA graphs (model/cuda_graphs.py)


def head_layouts(model) -> list[tuple[int, int]]:
    """(query heads per kv head, head dim) of the model's attention layers, each once: what fixes the attention
    kernels' shape constexprs."""
    return sorted({(layer.num_heads // layer.num_kv_heads, layer.head_dim) for layer in model.attention_layers})


def eager_extend_variants(layouts: list[tuple[int, int]], max_extend_len: int, interpret: bool | None = None
                          ) -> dict[tuple, int]:
    """Every extend-attention variant an eager EXTEND batch can compile (kernels/extend_attention.eager_variant)
    for extends of 1..max_extend_len tokens (a chunked prefill never extends a request by more), each with the
    longest extend that picks it. Keys are (heads per kv, head dim, variant)."""
    from prefixrt.kernels.extend_attention import eager_variant

    out: dict[tuple, int] = {}
    for g, d in layouts:
        for n in range(1, max_extend_len + 1):
            out[(g, d, eager_variant(d, g, n, interpret))] = n
    return out


def warm_up_batches(req_to_token: torch.Tensor, pad_row: int, max_context: int, max_running: int,
                    chunk_tokens: int, device: torch.device, layouts: list[tuple[int, int]] = (),
                    interpret: bool | None = None) -> list:
    """Eager EXTEND batches with the shapes a served workload hits outside the graphs (a long prefill
    chunk; many sequences with short extends over long cached prefixes), so their kernel variants compile
    and their activation memory is reserved at start-up, not inside a user's request; then one more for each
    extend-attention variant (eager_extend_variants over the model's head layouts) those shapes leave out.
    They write only the padding slot 0 and read only the reserved page 0 (slot 0; slots 0..page_size-1 when
    paged) through the all-zero pad_row."""
    from prefixrt.model.forward_batch import ForwardBatch

    out = []
    chunk = max(1, min(chunk_tokens, max_context - 1))
    shapes = [(1, 0, chunk)]  # (sequences, cached prefix, new tokens each): a whole prefill chunk
    n_seqs = min(max_running, max(1, (EXTEND_GRAPH_TOKENS + 64) // 60))
    prefix = min(3500, max_context - 61)
    if prefix > 0:
        shapes.append((1, prefix, min(100, chunk, max_context - prefix - 1)))  # hot prefix, tall query blocks
        shapes.append((n_seqs, prefix, min(60, chunk, max_context - prefix - 1)))  # many short extends
    shapes = [s for s in shapes if s[2] >= 1]
    if layouts:
        from prefixrt.kernels.extend_attention import eager_variant

        covered = {(g, d, eager_variant(d, g, e, interpret)) for g, d in layouts for _, _, e in shapes}
        for key, e in sorted(eager_extend_variants(layouts, chunk, interpret).items(), key=lambda kv: kv[1]):
            if key not in covered:
                shapes.append((1, 0, e))
                covered |= {(g, d, eager_variant(d, g, e, interpret)) for g, d in layouts}
    for n, p, e in shapes:
        tokens = [[0] * e for _ in range(n)]
        ends = [(i + 1) * e - 1 for i in range(n)]
        out.append(ForwardBatch.build(
            req_pool_indices=[pad_row] * n, prefix_lens=[p] * n, extend_tokens=tokens,
            out_cache_loc=[0] * (n * e), req_to_token=req_to_token, logits_indices=ends, device=device,
        ))
    return out
