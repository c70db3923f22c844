"""LoRA inside the network: the Triton kernels (under TRITON_INTERPRET=1 on the CPU) in a model forward equal the torch
reference, eagerly and through the CUDA-graph banks (emulated on the CPU: the static padded batch with its static
LoRA plan), for batches mixing adapters, an empty slot and the base model."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("peft")

from prefixrt.cache.kv_pool import KVPool  # noqa: E402
from prefixrt.lora.peft_format import read_adapter  # noqa: E402
from prefixrt.lora.registry import pack  # noqa: E402
from prefixrt.model.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from prefixrt.model.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from prefixrt.model.cuda_graphs import LoraGraphSpec  # noqa: E402
from prefixrt.model.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from prefixrt.model.lora import LoraBatch, attach_lora_slots  # noqa: E402
from prefixrt.model.runner import ModelRunner  # noqa: E402
from tests.lora.conftest import TARGET_SETS  # noqa: E402

SLOTS = 3


@pytest.fixture(scope="module")
def setup(tiny_checkpoints, peft_adapters):
    from prefixrt.hub.loader import load_model

    model = load_model(str(tiny_checkpoints("llama")[0]), dtype=torch.float32, device="cpu")
    linears = attach_lora_slots(model, SLOTS, 16, torch.float32)
    for slot, (key, targets, rank, seed) in ((0, ("m-a", "all", 8, 41)), (2, ("m-b", "mlp", 16, 42))):
        folder, _ = peft_adapters("llama", key, TARGET_SETS[targets], rank=rank, seed=seed)
        pack(read_adapter(key, folder), linears, 16, pin=False).copy_into(slot)  # slot 1 stays empty (zeros)
    pool = KVPool(2048, model.num_layers, model.num_kv_heads, model.head_dim, torch.float32, "cpu")
    rows, ctx = 12, 128
    table = torch.zeros(rows, ctx, dtype=torch.int32)
    graph_runner = ModelRunner(model, pool, TritonAttentionBackend(pool, max_batch_size=8))
    graph_runner.capture_graphs(table, rows - 1, 8, ctx, max_extend_tokens=64, emulate=True,
                                lora=LoraGraphSpec(SLOTS, kernels=True))
    ref_runner = ModelRunner(model, pool, TorchAttentionBackend(pool))
    return model, pool, table, graph_runner, ref_runner


def _batch(table, rows, prefix_lens, tokens, slots, lora_slots, kernels) -> ForwardBatch:
    ends, acc = [], 0
    for t in tokens:
        acc += len(t)
        ends.append(acc - 1)
    fb = ForwardBatch.build(req_pool_indices=rows, prefix_lens=prefix_lens, extend_tokens=tokens, out_cache_loc=slots,
                            req_to_token=table, logits_indices=ends, device="cpu")
    if any(s >= 0 for s in lora_slots):
        fb.lora = LoraBatch(list(lora_slots), [len(t) for t in tokens], torch.device("cpu"), kernels=kernels)
    return fb


def test_kernels_and_graphs_equal_the_reference(setup):
    model, pool, table, graph_runner, ref_runner = setup
    rng = random.Random(0)
    free = list(range(1, pool.num_slots))
    rng.shuffle(free)
    lens = {}
    row_slot = {0: 0, 1: -1, 2: 2, 3: 1, 4: 0, 5: 2}  # request row -> adapter slot (-1: base; 1: the empty slot)

    def fill(row, n):
        slots = [free.pop() for _ in range(n)]
        table[row, lens[row]:lens[row] + n] = torch.tensor(slots, dtype=torch.int32)
        return slots

    def run(step, check):
        rows = [r for r, _ in step]
        tokens = [[rng.randrange(3, model.vocab_size) for _ in range(n)] for _, n in step]
        prefix = [lens[r] for r in rows]
        slots = [s for r, n in step for s in fill(r, n)]
        lora = [row_slot[r] for r in rows]
        want = ref_runner.forward(_batch(table, rows, prefix, tokens, slots, lora, kernels=False)).clone()
        if check is not None:
            fb = _batch(table, rows, prefix, tokens, slots, lora, kernels=True)
            before = dict(graph_runner.replays)
            got = graph_runner.forward(fb).clone()
            assert graph_runner.replays[check] == before[check] + 1, graph_runner.replays
            assert ((got - want).norm() / want.norm()).item() < 1e-4
            with torch.inference_mode():  # the fused kernels eagerly, outside the graphs
                eager = graph_runner._forward_eager(_batch(table, rows, prefix, tokens, slots, lora, kernels=True))
            assert ((eager - want).norm() / want.norm()).item() < 1e-4
        for r, n in step:
            lens[r] += n
        return want

    for row in row_slot:  # prompts, through the reference
        lens[row] = 0
        run([(row, rng.randint(5, 30))], None)
    run([(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 1)], "decode")  # every slot kind in one decode batch
    run([(1, 1), (4, 1)], "decode")
    run([(0, 3), (1, 2), (2, 20), (5, 1)], "extend")  # mixed extend: forced tokens, a chunk, a decode row
    run([(1, 4)], "extend")  # the base model alone: the plan is all padding
    # the adapters matter: the same batch as the base model gives other logits
    probe = [(0, 1), (2, 1)]
    rows = [r for r, _ in probe]
    tokens = [[7], [9]]
    prefix = [lens[r] for r in rows]
    slots = [s for r, n in probe for s in fill(r, n)]
    with_lora = ref_runner.forward(_batch(table, rows, prefix, tokens, slots, [0, 2], kernels=False)).clone()
    base = ref_runner.forward(_batch(table, rows, prefix, tokens, slots, [-1, -1], kernels=False))
    assert not torch.allclose(with_lora, base, atol=1e-3)


def test_graph_plan_padding_and_mode(setup):
    _, _, table, graph_runner, _ = setup
    fb = _batch(table, [0, 1], [3, 3], [[1], [2]], [1, 2], [0, -1], kernels=True)
    assert fb.mode is ForwardMode.DECODE and graph_runner.graphs.can_run(fb)
    static = graph_runner.graphs.graphs[2][1].lora.plan
    with torch.inference_mode():  # (as the runner replays)
        graph_runner.graphs._fill_lora(2, fb)
        assert static.block_slot.tolist()[:1] == [0] and set(static.block_slot.tolist()[1:]) == {-1}
        assert static.sorted_tokens.tolist()[:2] == [0, 1]
        graph_runner.graphs._fill_lora(2, _batch(table, [0, 1], [3, 3], [[1], [2]], [1, 2], [-1, -1], True))
        assert set(static.block_slot.tolist()) == {-1}
