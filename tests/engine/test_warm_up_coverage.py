"""Start-up leaves nothing to compile: every kernel variant and CUDA graph the dispatch code can choose for a
configured engine is one that start-up compiles or captures. The dispatch side is enumerated over every batch
it can see; the warm-up side is read off the batches and graph keys start-up actually builds. GPU choices
(interpret=False) are enumerated here on the CPU; a variant added to the dispatch without a warm-up for it
fails."""

from __future__ import annotations

import pytest
import torch
from prefixrt.kernels.extend_attention import eager_variant

from prefixrt.engine.warm_up import EXTEND_GRAPH_TOKENS, eager_extend_variants, warm_up_batches
from prefixrt.model.cuda_graphs import decode_buckets, extend_buckets, extend_key_for, pick

# (query heads per kv head, head dim): Llama-3-8B, a 1:1 small model, Gemma-3 (head dim 256), MQA-like 8:1, 32:1
LAYOUTS = [[(4, 128)], [(1, 64)], [(2, 256)], [(8, 128)], [(32, 128)], [(4, 128), (2, 256)]]


@pytest.mark.parametrize("layouts", LAYOUTS, ids=str)
@pytest.mark.parametrize("chunk", [8192, 512, 48])
def test_eager_extend_warm_up_covers_every_variant_the_dispatch_can_choose(layouts, chunk):
    max_context = 8192 + 1
    table = torch.zeros(2, max_context, dtype=torch.int32)
    batches = warm_up_batches(table, 1, max_context, 256, chunk, torch.device("cpu"), layouts, interpret=False)
    warmed = {(g, d, eager_variant(d, g, max(b.extend_lens_cpu), interpret=False))
              for b in batches for g, d in layouts}
    # The dispatch: an eager EXTEND batch's longest extend is 1..chunk tokens (chunked prefill).
    reachable = {(g, d, eager_variant(d, g, n, interpret=False)) for g, d in layouts for n in range(1, chunk + 1)}
    assert reachable == warmed
    assert set(eager_extend_variants(layouts, chunk, interpret=False)) == reachable


def test_the_enumeration_sees_more_than_one_variant():
    """Llama-3-8B's layout has two eager variants (short packed extends take 64-row blocks): the coverage
    check above is not comparing one-element sets."""
    assert len(eager_extend_variants([(4, 128)], 8192, interpret=False)) == 2


@pytest.mark.parametrize("max_running", [1, 7, 64, 256, 300])
def test_every_decode_batch_size_replays_a_captured_graph(max_running):
    captured = decode_buckets(max_running)
    chosen = {pick(captured, bs) for bs in range(1, max_running + 1)}
    assert None not in chosen and chosen <= set(captured)


@pytest.mark.parametrize("max_seqs", [1, 16, 64, 256])
def test_every_small_extend_batch_replays_a_captured_graph(max_seqs):
    keys = extend_buckets(EXTEND_GRAPH_TOKENS, max_seqs)
    for tokens in range(1, EXTEND_GRAPH_TOKENS + 1):
        for seqs in range(1, min(tokens, max_seqs) + 1):
            key = extend_key_for(keys, tokens, seqs)
            assert key in keys, (tokens, seqs)
    assert extend_key_for(keys, EXTEND_GRAPH_TOKENS + 1, 1) is None  # beyond: eager (the warm-up above)
