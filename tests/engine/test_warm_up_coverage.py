"""Start-up leaves nothing to compile: every kernel variant and CUDA graph the dispatch code can choose for a
configured engine is one that start-up compiles or captures.

Eager EXTEND batches: the real dispatch (TritonAttentionBackend.prepare/forward -> kernels/extend_attention.py) runs
over real batches (ForwardBatch.build) of every longest extend a chunked prefill can give, with a recorder in place
of the kernel launch: the recorded launch keys (every constexpr and launch parameter) are what a served workload
compiles. The start-up warm-up's batches (engine/warm_up.warm_up_batches, as engine/builder.py builds them) go
through the same recorder, and must have launched each of those keys. GPU choices are recorded on the CPU (the
dispatch is told it is not interpreting; nothing launches), so a variant the dispatch picks without a warm-up
batch for it fails here."""

from __future__ import annotations

import pytest
import torch
from prefixrt.kernels import _common
from prefixrt.kernels import extend_attention as extend_module

from prefixrt.cache.kv_pool import KVPool
from prefixrt.engine.warm_up import EXTEND_GRAPH_TOKENS, eager_extend_variants, warm_up_batches
from prefixrt.model.attention.base import AttentionLayer
from prefixrt.model.attention.triton_backend import TritonAttentionBackend
from prefixrt.model.cuda_graphs import decode_buckets, extend_buckets, extend_key_for, pick
from prefixrt.model.forward_batch import ForwardBatch

# (query heads per kv head, head dim): Llama-3-8B, a 1:1 small model, Gemma-3 (head dim 256), MQA-like 8:1, 32:1
LAYOUTS = [[(4, 128)], [(1, 64)], [(2, 256)], [(8, 128)], [(32, 128)], [(4, 128), (2, 256)]]
CHUNKS = [8192, 512, 48]
KV_HEADS = 8


class LaunchRecorder:
    """Stands in for extend_attention's `_extend_kernel`: `kernel[grid](*args, **kwargs)` records the launch key
    (every non-tensor keyword: the constexprs and launch parameters a compiled variant is keyed on) and launches
    nothing."""

    def __init__(self):
        self.keys: list[tuple] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.keys.append(tuple(sorted((k, v) for k, v in kwargs.items() if not isinstance(v, torch.Tensor))))
        return launch


class RecordingDispatch:
    """A real TritonAttentionBackend per head layout (a bf16 pool of KV_HEADS kv heads; queries on the meta
    device), whose extend launches go to a LaunchRecorder. run(batch) -> {(heads per kv, head dim): launch key}."""

    def __init__(self, layouts, monkeypatch):
        self.recorder = LaunchRecorder()
        monkeypatch.setattr(extend_module, "_extend_kernel", self.recorder)
        monkeypatch.setattr(_common, "interpreting", lambda: False)  # the GPU's launch choices
        self.backends = {}
        for g, d in layouts:
            pool = KVPool(16, 1, KV_HEADS, d, torch.bfloat16, "cpu")
            layer = AttentionLayer(layer_id=0, num_heads=g * KV_HEADS, num_kv_heads=KV_HEADS, head_dim=d,
                                   scaling=d**-0.5)
            self.backends[(g, d)] = (TritonAttentionBackend(pool), layer)

    def run(self, batch: ForwardBatch) -> dict[tuple[int, int], tuple]:
        out = {}
        for layout, (backend, layer) in self.backends.items():
            backend.prepare(batch)
            q = torch.empty(len(batch.input_ids), layer.num_heads * layer.head_dim, dtype=torch.bfloat16,
                            device="meta")
            before = len(self.recorder.keys)
            backend.forward(q, None, None, layer, batch)  # k, v None: stored already (nothing to write)
            assert len(self.recorder.keys) == before + 1, "an EXTEND forward launches extend_attention once"
            out[layout] = self.recorder.keys[-1]
        return out


def _extend_batch(table: torch.Tensor, extends: list[int], prefixes: list[int]) -> ForwardBatch:
    n = sum(extends)
    batch = ForwardBatch.build(req_pool_indices=[0] * len(extends), prefix_lens=prefixes,
                               extend_tokens=[[5] * e for e in extends], out_cache_loc=[0] * n, req_to_token=table,
                               logits_indices=[n - 1], device="cpu")
    assert batch.mode.name == "EXTEND"
    return batch


ALL_LAYOUTS = sorted({layout for layouts in LAYOUTS for layout in layouts})


@pytest.fixture(scope="module")
def dispatched():
    """{layout: {longest extend n: the launch key the real dispatch chose}} for n in 2..max(CHUNKS), each from a
    real EXTEND batch: a sequence extending n tokens over a cached prefix beside one extending a single token.
    (A batch whose every extend is 1 token is a DECODE batch: no extend kernel.)"""
    with pytest.MonkeyPatch.context() as mp:
        dispatch = RecordingDispatch(ALL_LAYOUTS, mp)
        table = torch.zeros(1, 1, dtype=torch.int32)
        out: dict = {layout: {} for layout in ALL_LAYOUTS}
        for n in range(2, max(CHUNKS) + 1):
            for layout, key in dispatch.run(_extend_batch(table, [n, 1], [7, 3])).items():
                out[layout][n] = key
    return out


@pytest.mark.parametrize("layouts", LAYOUTS, ids=str)
@pytest.mark.parametrize("chunk", CHUNKS)
def test_warm_up_launches_every_variant_the_real_dispatch_launches(layouts, chunk, dispatched, monkeypatch):
    max_context = 8192 + 1
    table = torch.zeros(2, max_context, dtype=torch.int32)
    dispatch = RecordingDispatch(layouts, monkeypatch)
    warmed: dict[tuple, set] = {layout: set() for layout in layouts}
    for batch in warm_up_batches(table, 1, max_context, 256, chunk, torch.device("cpu"), layouts, interpret=False):
        for layout, key in dispatch.run(batch).items():
            warmed[layout].add(key)
    for layout in layouts:
        served = {n: key for n, key in dispatched[layout].items() if n <= chunk}
        missing = {key: min(n for n, k in served.items() if k == key) for key in set(served.values()) - warmed[layout]}
        assert not missing, f"{layout}: variants first launched by an extend of n tokens, not at start-up: {missing}"


def test_the_dispatch_launches_more_than_one_variant(dispatched):
    """Llama-3-8B's layout launches two eager variants (short packed extends take 64-row blocks), and the
    warm-up's own enumeration counts the same two: the coverage check above is not comparing one-element sets."""
    assert len(set(dispatched[(4, 128)].values())) == 2
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
