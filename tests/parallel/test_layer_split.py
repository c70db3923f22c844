"""Layer-split K/V for context-parallel prefill (parallel/experimental/layer_split.py): W ranks as threads over a gloo group
(local_groups), each with its own copy of a tiny checkpoint's weights.

Oracles: the unsplit engine's greedy tokens on the same prompt, and transformers' logits of the last prompt token.
The run is a cold prefill (split across ranks), a second extend that reuses it as a cached prefix (every layer's
prefix broadcast from its owner), then replicated decode steps.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from prefixrt.parallel.experimental.layer_split import LayerSplitRunner, chunk_bounds, owner
from prefixrt.parallel.kv_transport import local_groups


def test_chunk_bounds_cover_the_tokens_in_order():
    assert chunk_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert chunk_bounds(2, 3) == [(0, 1), (1, 2), (2, 2)]
    assert [owner(layer, 3) for layer in range(5)] == [0, 1, 2, 0, 1]


@pytest.mark.parametrize("arch, world", [("llama", 2), ("gemma3", 2), ("qwen3", 3)])
def test_greedy_outputs_equal_the_unsplit_run(arch, world, tiny_checkpoints, make_engine):
    from prefixrt.hub.loader import load_model

    rng = random.Random(world)
    first = [1] + [rng.randrange(3, 320) for _ in range(40)]
    turn = [rng.randrange(3, 320) for _ in range(23)]
    path, hf = tiny_checkpoints(arch)
    want = make_engine(arch).generate(first + turn, {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
    with torch.no_grad():
        hf_logits = hf(torch.tensor([first + turn])).logits[0, -1].float()
    groups = local_groups(world)
    results: list = [None] * world
    errors: list = []

    def rank(r: int) -> None:
        try:
            runner = LayerSplitRunner(load_model(path, dtype="float32", device="cpu"), groups[r], r, world)
            runner.extend(first)
            logits = runner.extend(turn)  # its prefix: the first extend's K/V, split by layer
            toks = [int(torch.argmax(logits))]
            for _ in range(5):
                toks.append(int(torch.argmax(runner.step(toks[-1]))))
            results[r] = (toks, logits, runner)
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for toks, logits, _ in results:
        assert toks == want.token_ids
        torch.testing.assert_close(logits, hf_logits, atol=1e-4, rtol=1e-4)
    runner = results[0][2]
    model = runner.model
    num_layers, length = model.num_layers, len(first) + len(turn) + 5
    per_layer = 2 * length * model.attention_layers[0].num_kv_heads * model.attention_layers[0].head_dim * 4
    stored = [res[2].kv.bytes_stored for res in results]
    for r, got in enumerate(stored):  # each rank keeps its own layers only
        assert got == per_layer * sum(owner(layer, world) == r for layer in range(num_layers))
    assert sum(stored) == per_layer * num_layers  # together: one copy of the sequence's K/V
    for res in results:
        for log in res[2].logs[1:]:  # with a cached prefix: layer l+1's broadcast is issued before layer l attends
            for layer in range(num_layers - 1):
                assert log.index(("broadcast", layer + 1)) < log.index(("attend", layer)), log
