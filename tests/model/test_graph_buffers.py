"""CUDA-graph logic that runs on the CPU: bucket choice, block maps, padding and static-buffer filling.

The graph banks run in emulation (the static padded batch through the Triton backend under
TRITON_INTERPRET=1, see conftest.py) and must give the logits of the eager forward through the torch
reference backend on the same batch. On a GPU the same test captures real graphs."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("transformers")

from prefixrt.kernels.extend_attention import block_map  # noqa: E402

from prefixrt.cache.kv_pool import KVPool  # noqa: E402
from prefixrt.model.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from prefixrt.model.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from prefixrt.model.cuda_graphs import (  # noqa: E402
    EXTEND_TOKEN_BUCKETS,
    CascadeSpec,
    ExtendGraphs,
    extend_block_m,
    extend_buckets,
    extend_splits,
    pick,
)
from prefixrt.model.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from prefixrt.model.runner import ModelRunner  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_pick_and_buckets():
    assert pick((1, 4, 16), 0) == 1 and pick((1, 4, 16), 5) == 16 and pick((1, 4, 16), 17) is None
    keys = extend_buckets(128, 8)
    assert {t for t, _ in keys} == {t for t in EXTEND_TOKEN_BUCKETS if t <= 128}
    assert all(s <= min(t, 8) for t, s in keys)
    assert (16, 1) in keys and (16, 4) in keys and (128, 8) in keys and (16, 16) not in keys
    assert extend_buckets(100, 256)[-1] == (100, 100)  # the cap itself is a token bucket
    assert extend_block_m(64, 64, 128) == 16 and extend_block_m(128, 1, 128) <= 64
    assert extend_splits(4, 32, 132) == 4 and extend_splits(72, 32, 132) == 1 and extend_splits(1, 1, 132) == 8


def test_block_map_covers_every_query_block_once():
    rng = random.Random(0)
    for _ in range(50):
        lens = [rng.randint(0, 40) for _ in range(rng.randint(1, 9))]
        m = rng.choice([16, 32, 64])
        nb = len(lens) + -(-sum(lens) // m)
        seqs, mbs = block_map(lens, m, nb)
        assert len(seqs) == len(mbs) == nb
        real = [(s, b) for s, b in zip(seqs, mbs) if s >= 0]
        assert real == [(i, j) for i, e in enumerate(lens) for j in range(-(-e // m))]
        assert all(s == -1 for s in seqs[len(real):])
    with pytest.raises(ValueError):
        block_map([40, 40], 16, 3)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from prefixrt.hub.loader import load_model
    from tests.helpers.checkpoints import save_tiny_checkpoint

    path = tmp_path_factory.mktemp("qwen3")
    save_tiny_checkpoint("qwen3", path)
    model = load_model(str(path), dtype=torch.float32, device=DEVICE)
    num_slots, rows, ctx = 2048, 12, 160
    pool = KVPool(num_slots, model.num_layers, model.num_kv_heads, model.head_dim, torch.float32, DEVICE)
    table = torch.zeros(rows, ctx, dtype=torch.int32, device=DEVICE)
    pad_row = rows - 1  # stays all zeros
    backend = TritonAttentionBackend(pool, max_batch_size=8)
    graph_runner = ModelRunner(model, pool, backend)
    graph_runner.capture_graphs(table, pad_row, 8, ctx, max_extend_tokens=96, emulate=DEVICE == "cpu",
                                cascade=CascadeSpec(queries_per_tile=2, min_prefix_len=8, min_group_size=2),
                                max_verify_tokens=48)
    ref_runner = ModelRunner(model, pool, TorchAttentionBackend(pool))
    return model, pool, table, graph_runner, ref_runner


def _batch(table, rows, prefix_lens, tokens, slots, logits_rows=None) -> ForwardBatch:
    ends, acc = [], 0
    for t in tokens:
        acc += len(t)
        ends.append(acc - 1)
    return ForwardBatch.build(
        req_pool_indices=rows, prefix_lens=prefix_lens, extend_tokens=tokens, out_cache_loc=slots,
        req_to_token=table, logits_indices=ends if logits_rows is None else logits_rows, device=DEVICE,
    )


def test_extend_graphs_match_eager_reference(setup):
    """Prefill some rows, then EXTEND batches of ragged sizes (jump-forward-like 1..6 tokens, a prefill of
    40 over a cached prefix, a mixed one) through the graph banks; logits equal the torch reference."""
    model, pool, table, graph_runner, ref_runner = setup
    rng = random.Random(3)
    free = list(range(1, pool.num_slots))
    rng.shuffle(free)
    lens = {}
    vocab = model.vocab_size

    def fill(row, n):
        slots = [free.pop() for _ in range(n)]
        table[row, lens[row] : lens[row] + n] = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
        return slots

    # Cached prefixes, written by the reference (eager) path.
    for row in range(6):
        lens[row] = 0
        n = rng.randint(5, 60)
        slots = fill(row, n)
        ref_runner.forward(_batch(table, [row], [0], [[rng.randrange(vocab) for _ in range(n)]], slots))
        lens[row] = n

    steps = [
        [(0, 1), (1, 3), (2, 6), (3, 1), (4, 2)],  # decode + forced tokens
        [(5, 40)],  # hot-prefix prefill
        [(0, 2), (5, 30), (1, 1)],  # chunked prefill mixed with decode
        [(2, 1), (3, 5)],
    ]
    used = 0
    for step in steps:
        rows = [r for r, _ in step]
        tokens = [[rng.randrange(vocab) for _ in range(n)] for _, n in step]
        prefix = [lens[r] for r in rows]
        slots = [s for r, n in step for s in fill(r, n)]
        fb = _batch(table, rows, prefix, tokens, slots)
        assert fb.mode is ForwardMode.EXTEND
        assert graph_runner.extend_graphs.can_run(fb)
        before = graph_runner.replays["extend"]
        got = graph_runner.forward(fb).clone()
        assert graph_runner.replays["extend"] == before + 1
        # The reference recomputes the same K/V into the same slots (fp32: equal up to rounding).
        want = ref_runner.forward(_batch(table, rows, prefix, tokens, slots))
        assert got.shape == want.shape
        assert ((got - want).norm() / want.norm()).item() < 1e-4
        for r, n in step:
            lens[r] += n
        used += 1
    assert used == len(steps)
    assert pool.k_buffers[0][0].abs().sum() >= 0  # padded tokens wrote slot 0 only (no crash, no other slot)


def test_extend_graphs_fall_back(setup):
    model, pool, table, graph_runner, _ = setup
    fb = _batch(table, [0], [0], [list(range(97))], list(range(1, 98)))  # over max_extend_tokens
    assert not graph_runner.extend_graphs.can_run(fb)
    fb = _batch(table, [0], [0], [list(range(8))], list(range(1, 9)), logits_rows=[3, 5, 7])  # logprob rows
    assert not graph_runner.extend_graphs.can_run(fb)
    fb = _batch(table, [0, 1], [0, 0], [[1], [2]], [1, 2])
    assert fb.mode is ForwardMode.DECODE and graph_runner.graphs.can_run(fb)
    assert isinstance(graph_runner.extend_graphs, ExtendGraphs)


def test_padded_tokens_write_only_the_pad_slot(setup):
    """A batch of 3 tokens padded to the 16-token bucket: no slot except the batch's and slot 0 changes."""
    model, pool, table, graph_runner, _ = setup
    before = [k.clone() for k in pool.k_buffers]
    row = 7
    slots = [pool.num_slots - 3, pool.num_slots - 2, pool.num_slots - 1]
    table[row, :3] = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    graph_runner.forward(_batch(table, [row], [0], [[5, 6, 7]], slots))
    for b, k in zip(before, pool.k_buffers):
        changed = (b != k).flatten(1).any(1).nonzero().flatten().tolist()
        assert set(changed) <= set(slots) | {0}


def test_cascade_decode_graphs_match_eager_reference(setup):
    """Decode batches with prefix groups through the cascade decode graphs (plan padded to the bucket):
    rows 8..10 share a 30-token prefix (the same slots), row 7 does not; logits equal the torch reference.
    A second step with the same groups object reuses the uploaded plan."""
    model, pool, table, graph_runner, ref_runner = setup
    rng = random.Random(9)
    vocab = model.vocab_size
    free = list(range(1, 700))  # slots the earlier tests left alone: they use the top of the pool or
    rng.shuffle(free)  # overwrite before reading
    lens = {}

    def prefill(row, n, share_from=None, shared=0):
        if share_from is not None:
            table[row, :shared] = table[share_from, :shared]
        slots = [free.pop() for _ in range(n - shared)]
        table[row, shared:n] = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
        toks = [[rng.randrange(vocab) for _ in range(n - shared)]]
        ref_runner.forward(_batch(table, [row], [shared], toks, slots))
        lens[row] = n

    prefill(8, 34)
    prefill(9, 36, share_from=8, shared=30)
    prefill(10, 31, share_from=8, shared=30)
    prefill(7, 20)
    rows = [8, 7, 9, 10]
    groups = [(30, [0, 2, 3])]
    for _step in range(2):
        slots = [free.pop() for _ in rows]
        for r, s in zip(rows, slots):
            table[r, lens[r]] = s
        toks = [[rng.randrange(vocab)] for _ in rows]
        fb = _batch(table, rows, [lens[r] for r in rows], toks, slots)
        fb.prefix_groups = groups
        assert fb.mode is ForwardMode.DECODE and graph_runner.graphs.can_run(fb)
        before = graph_runner.replays["cascade"]
        got = graph_runner.forward(fb).clone()
        assert graph_runner.replays["cascade"] == before + 1
        want = ref_runner.forward(_batch(table, rows, [lens[r] for r in rows], toks, slots))
        assert ((got - want).norm() / want.norm()).item() < 1e-4
        for r in rows:
            lens[r] += 1


def test_verify_graphs_match_eager_reference(setup):
    """Speculative verify forwards (a row's last token + its drafts, logits at every position, beside a decode row
    with one logits row) replay the VerifyGraphs bank; logits equal the torch reference. ExtendGraphs refuses them
    (more logits rows than sequences)."""
    import random

    model, pool, table, graph_runner, ref_runner = setup
    rng = random.Random(7)
    vocab = model.vocab_size
    rows, base = [7, 8, 9], 1500  # rows and slots no other test of the module uses
    for i, row in enumerate(rows):  # a cached prefix of 20 tokens each, written by the reference
        slots = list(range(base + 40 * i, base + 40 * i + 20))
        table[row, :20] = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
        ref_runner.forward(_batch(table, [row], [0], [[rng.randrange(vocab) for _ in range(20)]], slots))
    for ks in ([4, 0, 2], [8, 8, 8], [1, 3, 0]):
        tokens = [[rng.randrange(vocab) for _ in range(k + 1)] for k in ks]
        slots, logits_rows, acc = [], [], 0
        for i, (row, t) in enumerate(zip(rows, tokens)):
            slots += list(range(base + 40 * i + 20, base + 40 * i + 20 + len(t)))
            table[row, 20:20 + len(t)] = torch.tensor(slots[-len(t):], dtype=torch.int32, device=DEVICE)
            logits_rows += list(range(acc, acc + len(t))) if len(t) > 1 else [acc]
            acc += len(t)
        fb = _batch(table, rows, [20] * 3, tokens, slots, logits_rows)
        assert not graph_runner.extend_graphs.can_run(fb) and graph_runner.verify_graphs.can_run(fb)
        before = graph_runner.replays["verify"]
        got = graph_runner.forward(fb).clone()
        assert graph_runner.replays["verify"] == before + 1
        want = ref_runner.forward(_batch(table, rows, [20] * 3, tokens, slots, logits_rows))
        assert got.shape == want.shape == (len(logits_rows), vocab)
        assert ((got - want).norm() / want.norm()).item() < 1e-4

