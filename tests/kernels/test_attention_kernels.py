"""Triton attention kernels vs the torch reference (kernels/reference.py), and the Triton backend vs a
dense torch attention over the pool. Under TRITON_INTERPRET=1 (see conftest.py) this runs on CPU."""

from __future__ import annotations

import math
import random

import pytest
import torch

triton = pytest.importorskip("triton")

from prefixrt.kernels import reference as ref  # noqa: E402
from prefixrt.kernels.cascade_decode import cascade_decode_attention  # noqa: E402
from prefixrt.kernels.cascade_plan import plan_cascade  # noqa: E402
from prefixrt.kernels.decode_attention import decode_attention, decode_workspace  # noqa: E402
from prefixrt.kernels.extend_attention import extend_attention  # noqa: E402

from prefixrt.cache.kv_pool import KVPool  # noqa: E402
from prefixrt.model.attention.base import AttentionLayer  # noqa: E402
from prefixrt.model.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from prefixrt.model.forward_batch import ForwardBatch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


class PagedKV:
    """Random K/V in a pool whose slots are handed out in random order, so sequences are scattered.
    page_size > 1: whole pages are handed out in random order and a sequence's position p lives in slot
    pages[p // page_size] * page_size + p % page_size (the KVManager's layout)."""

    def __init__(self, num_kv_heads, head_dim, dtype, num_slots=512, num_rows=16, max_context=96, seed=0,
                 page_size=1):
        gen = torch.Generator().manual_seed(seed)
        if page_size > 1:
            num_slots = max(num_slots, 96 * page_size)  # whole pages for every sequence of a case
        self.page_size = page_size
        self.k = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
        self.v = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
        self.req_to_token = torch.zeros(num_rows, max_context, dtype=torch.int32, device=DEVICE)
        self.free_slots = (torch.randperm(num_slots - 1, generator=gen) + 1).tolist()  # slot 0 is padding
        self.free_rows = (torch.randperm(num_rows - 1, generator=gen) + 1).tolist()
        if page_size > 1:  # page 0 holds the padding slot
            self.free_pages = (torch.randperm(num_slots // page_size - 1, generator=gen) + 1).tolist()

    def alloc(self, length: int) -> list[int]:
        """Slots for positions [0, length) of a sequence (fresh pages when paged)."""
        if self.page_size == 1:
            return [self.free_slots.pop() for _ in range(length)]
        ps, slots = self.page_size, []
        while len(slots) < length:
            page = self.free_pages.pop()
            slots += range(page * ps, (page + 1) * ps)
        return slots[:length]

    def new_sequence(self, length: int, shared_prefix: list[int] | None = None) -> int:
        """Allocate a request row holding `length` positions, the first ones mapped to shared_prefix. Paged, a
        prefix ending mid-page shares its whole pages only: its last, partial page is copied into the row's own
        page (copy-on-write), so the row keeps the page layout and reads the same K/V."""
        row = self.free_rows.pop()
        shared = list(shared_prefix or [])
        if self.page_size == 1:
            slots = shared + self.alloc(length - len(shared))
        else:
            whole = len(shared) // self.page_size * self.page_size
            slots = shared[:whole] + self.alloc(length - whole)
            if whole < len(shared):
                src = torch.tensor(shared[whole:], device=DEVICE)
                dst = torch.tensor(slots[whole : len(shared)], device=DEVICE)
                self.k[dst], self.v[dst] = self.k[src], self.v[src]
        self.req_to_token[row, :length] = torch.tensor(slots, dtype=torch.int32)
        return row


def make_extend_case(rng, heads_per_kv, head_dim, dtype, num_seqs=3, num_kv_heads=2, seed=0, page_size=1,
                     prefix_lens=None):
    kv = PagedKV(num_kv_heads, head_dim, dtype, seed=seed, page_size=page_size)
    given = prefix_lens
    prefix_lens = [rng.randint(0, 40) for _ in range(num_seqs)]
    extend_lens = [rng.randint(1, 24) for _ in range(num_seqs)]
    prefix_lens[0] = 0  # always one plain prefill
    if given is not None:
        prefix_lens = list(given)
    rows = [kv.new_sequence(p + e) for p, e in zip(prefix_lens, extend_lens)]
    starts = [sum(extend_lens[:i]) for i in range(num_seqs)]
    num_tokens = sum(extend_lens)
    q = torch.randn(num_tokens, num_kv_heads * heads_per_kv, head_dim).to(DEVICE, dtype)
    i32 = {"dtype": torch.int32, "device": DEVICE}
    args = (
        kv.k, kv.v, kv.req_to_token, torch.tensor(rows, device=DEVICE), torch.tensor(prefix_lens, **i32),
        torch.tensor(extend_lens, **i32), torch.tensor(starts, **i32), max(extend_lens), 1 / math.sqrt(head_dim),
    )  # fmt: skip
    # The new tokens' K/V, contiguous, as the forward computed them (for the k_extend option).
    new_slots = torch.cat([kv.req_to_token[r, p : p + e].long() for r, p, e in zip(rows, prefix_lens, extend_lens)])
    return q, args, kv.k[new_slots], kv.v[new_slots]


EXTEND_CASES = [  # (heads_per_kv, head_dim, window, softcap, contiguous, dtype)
    (1, 64, None, None, False, torch.float32),
    (2, 64, 8, None, False, torch.float32),
    (4, 64, None, None, True, torch.float32),
    (4, 128, 16, None, False, torch.float32),
    (2, 128, None, 30.0, False, torch.float32),
    (1, 128, 5, None, True, torch.float32),
    (2, 80, None, None, False, torch.float32),
    (4, 64, 8, None, False, torch.bfloat16),
    (2, 128, None, None, True, torch.float16),
    (3, 64, 8, None, False, torch.float32),  # packed: a group padded from 3 to 4 rows per token
    (8, 64, None, None, True, torch.bfloat16),
]


@pytest.mark.parametrize("pack", [False, True], ids=["per-head", "packed-heads"])
@pytest.mark.parametrize("heads_per_kv,head_dim,window,softcap,contiguous,dtype", EXTEND_CASES)
def test_extend_attention(heads_per_kv, head_dim, window, softcap, contiguous, dtype, pack):
    rng = random.Random(f"{heads_per_kv}-{head_dim}-{window}-{dtype}")
    q, args, k_new, v_new = make_extend_case(rng, heads_per_kv, head_dim, dtype)
    extra = {"k_extend": k_new, "v_extend": v_new} if contiguous else {}
    out, expected = torch.empty_like(q), torch.empty_like(q)
    extend_attention(q, out, *args, sliding_window=window, logit_softcap=softcap, pack_heads=pack, **extra)
    ref.extend_attention(q, expected, *args, sliding_window=window, logit_softcap=softcap)
    assert rel_err(out, expected) < TOL[dtype]


def test_extend_reference_matches_dense_sdpa():
    """The oracle itself, checked against torch's SDPA with an explicit mask on one prefilled sequence."""
    rng = random.Random(1)
    q, args, k_new, v_new = make_extend_case(rng, 2, 64, torch.float32, num_seqs=1)
    for window in (None, 6):
        expected = torch.empty_like(q)
        ref.extend_attention(q, expected, *args, sliding_window=window)
        n = q.shape[0]
        pos = torch.arange(n, device=DEVICE)
        mask = pos[None, :] <= pos[:, None]
        if window is not None:
            mask &= pos[None, :] > pos[:, None] - window
        k = k_new.repeat_interleave(2, dim=1).transpose(0, 1)  # k: [H, n, D]
        v = v_new.repeat_interleave(2, dim=1).transpose(0, 1)
        dense = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask)
        assert rel_err(expected, dense.transpose(0, 1)) < 1e-5


def random_spans(rng, prefix_lens, extend_lens):
    """Bidirectional blocks per sequence (absolute positions), each ending within the sequence's new tokens;
    some start in the cached prefix (a partly cached image), some are one token long."""
    spans = []
    for prefix, ext in zip(prefix_lens, extend_lens):
        mine, pos = [], max(prefix - rng.randint(0, 3), 0)
        while pos < prefix + ext:
            start = pos + rng.randint(0, 4)
            end = min(start + rng.randint(1, 9), prefix + ext)
            if end > max(start, prefix):
                mine.append((start, end))
            pos = end + 1
        spans.append(mine)
    return spans


@pytest.mark.parametrize("pack", [False, True], ids=["per-head", "packed-heads"])
@pytest.mark.parametrize("heads_per_kv,head_dim,window,softcap,contiguous,dtype,page_size", [
    (2, 64, None, None, False, torch.float32, 1), (2, 64, 8, None, True, torch.float32, 1),
    (1, 128, 5, 30.0, False, torch.float32, 4), (4, 64, None, None, True, torch.bfloat16, 1),
    (3, 64, 8, None, False, torch.float32, 16)])
def test_extend_attention_bidirectional_spans(heads_per_kv, head_dim, window, softcap, contiguous, dtype, page_size,
                                              pack):
    """span_end (Gemma-3's image blocks): the kernel equals the reference, whose mask is causal OR
    same-block, then the window; without span_end the result differs (the blocks matter)."""
    from prefixrt.kernels.extend_attention import span_ends

    rng = random.Random(f"spans-{heads_per_kv}-{head_dim}-{window}-{page_size}")
    q, args, k_new, v_new = make_extend_case(rng, heads_per_kv, head_dim, dtype, num_seqs=4, page_size=page_size)
    prefix_lens, extend_lens = args[4].tolist(), args[5].tolist()
    spans = random_spans(rng, prefix_lens, extend_lens)
    span_end = torch.tensor(span_ends(prefix_lens, extend_lens, spans), dtype=torch.int32, device=DEVICE)
    extra = {"k_extend": k_new, "v_extend": v_new} if contiguous else {}
    kw = {"sliding_window": window, "logit_softcap": softcap}
    out, expected, causal = torch.empty_like(q), torch.empty_like(q), torch.empty_like(q)
    extend_attention(q, out, *args, **kw, pack_heads=pack, page_size=page_size, span_end=span_end, **extra)
    ref.extend_attention(q, expected, *args, **kw, span_end=span_end)
    ref.extend_attention(q, causal, *args, **kw)
    assert rel_err(out, expected) < TOL[dtype]
    assert rel_err(causal, expected) > 3 * TOL[dtype]


@pytest.mark.parametrize("block_m,splits", [(16, 1), (16, 3)])
def test_extend_attention_spans_with_block_map(block_m, splits):
    from prefixrt.kernels.extend_attention import block_map, span_ends

    rng = random.Random(f"spans-map-{block_m}-{splits}")
    q, args, _, _ = make_extend_case(rng, 2, 64, torch.float32, num_seqs=4)
    prefix_lens, extend_lens = args[4].tolist(), args[5].tolist()
    span_end = torch.tensor(span_ends(prefix_lens, extend_lens, random_spans(rng, prefix_lens, extend_lens)),
                            dtype=torch.int32, device=DEVICE)
    seqs, mbs = block_map(extend_lens, block_m, len(extend_lens) + -(-sum(extend_lens) // block_m) + 2)
    i32 = {"dtype": torch.int32, "device": DEVICE}
    out, expected = torch.empty_like(q), torch.empty_like(q)
    extend_attention(q, out, *args, block_seq=torch.tensor(seqs, **i32), block_mb=torch.tensor(mbs, **i32),
                     block_m=block_m, num_splits=splits, span_end=span_end)
    ref.extend_attention(q, expected, *args, span_end=span_end)
    assert rel_err(out, expected) < 1e-4


def test_span_reference_matches_dense_sdpa():
    """The oracle with blocks, against SDPA with the mask spelled out as the torch backend builds it."""
    from prefixrt.kernels.extend_attention import span_ends

    rng = random.Random(3)
    q, args, k_new, v_new = make_extend_case(rng, 2, 64, torch.float32, num_seqs=1)
    n = q.shape[0]
    spans = [[(0, 3), (5, min(9, n))]]
    span_end = torch.tensor(span_ends([0], [n], spans), dtype=torch.int32, device=DEVICE)
    expected = torch.empty_like(q)
    ref.extend_attention(q, expected, *args, span_end=span_end)
    pos = torch.arange(n, device=DEVICE)
    mask = pos[None, :] <= pos[:, None]
    for a, b in spans[0]:
        inside = (pos >= a) & (pos < b)
        mask |= inside[:, None] & inside[None, :]
    k = k_new.repeat_interleave(2, dim=1).transpose(0, 1)
    v = v_new.repeat_interleave(2, dim=1).transpose(0, 1)
    dense = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask)
    assert rel_err(expected, dense.transpose(0, 1)) < 1e-5
    with pytest.raises(ValueError, match="ends past"):
        span_ends([0], [n], [[(n - 2, n + 1)]])


def make_decode_case(rng, heads_per_kv, head_dim, dtype, num_seqs=4, num_kv_heads=2, seed=0, page_size=1):
    kv = PagedKV(num_kv_heads, head_dim, dtype, seed=seed, page_size=page_size)
    seq_lens = [rng.randint(1, 60) for _ in range(num_seqs)]
    rows = [kv.new_sequence(n) for n in seq_lens]
    q = torch.randn(num_seqs, num_kv_heads * heads_per_kv, head_dim).to(DEVICE, dtype)
    args = (
        kv.k, kv.v, kv.req_to_token, torch.tensor(rows, device=DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), 1 / math.sqrt(head_dim),
    )  # fmt: skip
    return q, args


DECODE_CASES = [  # (heads_per_kv, head_dim, window, softcap, num_splits, dtype)
    (1, 64, None, None, 1, torch.float32),
    (2, 64, 10, None, 4, torch.float32),
    (4, 128, None, None, 3, torch.float32),
    (4, 64, 5, 20.0, 8, torch.float32),
    (2, 80, None, None, 2, torch.float32),
    (4, 128, None, None, 4, torch.bfloat16),
    (2, 64, 10, None, 2, torch.float16),
]


@pytest.mark.parametrize("heads_per_kv,head_dim,window,softcap,num_splits,dtype", DECODE_CASES)
def test_decode_attention(heads_per_kv, head_dim, window, softcap, num_splits, dtype):
    rng = random.Random(f"{heads_per_kv}-{head_dim}-{num_splits}-{dtype}")
    q, args = make_decode_case(rng, heads_per_kv, head_dim, dtype)
    out, expected = torch.empty_like(q), torch.empty_like(q)
    decode_attention(q, out, *args, sliding_window=window, logit_softcap=softcap, num_kv_splits=num_splits)
    ref.decode_attention(q, expected, *args, sliding_window=window, logit_softcap=softcap)
    assert rel_err(out, expected) < TOL[dtype]


def test_decode_padded_entry_gives_zeros_and_ignores_stale_workspace():
    """A CUDA-graph padded entry (seq_len 0) must come out as zeros, and splits past a sequence's end must
    not read whatever an earlier launch left in the workspace."""
    rng = random.Random(7)
    q, (k, v, r2t, rows, seq_lens, scale) = make_decode_case(rng, 2, 64, torch.float32)
    seq_lens[1] = 0
    mid_o = torch.full((4, q.shape[1], 8, 64), float("nan"), device=DEVICE)
    mid_lse = torch.full((4, q.shape[1], 8), 1e4, device=DEVICE)
    out, expected = torch.empty_like(q), torch.empty_like(q)
    decode_attention(q, out, k, v, r2t, rows, seq_lens, scale, num_kv_splits=8, mid_o=mid_o, mid_lse=mid_lse)
    ref.decode_attention(q, expected, k, v, r2t, rows, seq_lens, scale)
    assert torch.all(out[1] == 0)
    assert rel_err(out, expected) < 1e-4


def make_cascade_case(heads_per_kv, head_dim, dtype, num_kv_heads=2, seed=0, page_size=1):
    """Two groups sharing 30 and 17 slots (one member with an empty own suffix) and one ungrouped sequence.
    Paged, both prefixes end mid-page (for page sizes 4 and 16)."""
    kv = PagedKV(num_kv_heads, head_dim, dtype, seed=seed, page_size=page_size)
    shared_a = kv.alloc(30)
    shared_b = kv.alloc(17)
    seq_lens = [35, 20, 31, 40, 17, 9, 30]
    group_of = {0: shared_a, 2: shared_a, 3: shared_a, 6: shared_a, 1: shared_b, 4: shared_b}
    rows = [kv.new_sequence(n, group_of.get(i)) for i, n in enumerate(seq_lens)]
    groups = [(30, [0, 2, 3, 6]), (17, [1, 4])]
    q = torch.randn(len(seq_lens), num_kv_heads * heads_per_kv, head_dim).to(DEVICE, dtype)
    args = (
        kv.k, kv.v, kv.req_to_token, torch.tensor(rows, device=DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), 1 / math.sqrt(head_dim),
    )  # fmt: skip
    return q, args, groups, seq_lens


CASCADE_CASES = [  # (heads_per_kv, head_dim, softcap, queries_per_tile, prefix_splits, suffix_splits, dtype)
    (1, 64, None, 16, 1, 1, torch.float32),
    (2, 64, None, 2, 3, 2, torch.float32),
    (4, 128, 25.0, 3, 2, 4, torch.float32),
    (4, 64, None, 16, 2, 2, torch.bfloat16),
    (2, 128, None, 4, 4, 1, torch.float16),
]


@pytest.mark.parametrize("heads_per_kv,head_dim,softcap,per_tile,prefix_splits,suffix_splits,dtype", CASCADE_CASES)
def test_cascade_decode_equals_plain_decode(
    heads_per_kv, head_dim, softcap, per_tile, prefix_splits, suffix_splits, dtype
):
    q, args, groups, seq_lens = make_cascade_case(heads_per_kv, head_dim, dtype)
    plan = plan_cascade(groups, seq_lens, DEVICE, queries_per_tile=per_tile)
    out, by_cascade_ref, expected = torch.empty_like(q), torch.empty_like(q), torch.empty_like(q)
    cascade_decode_attention(
        q, out, *args, plan=plan, logit_softcap=softcap, num_prefix_splits=prefix_splits,
        num_suffix_splits=suffix_splits,
    )  # fmt: skip
    ref.cascade_decode_attention(q, by_cascade_ref, *args, plan=plan, logit_softcap=softcap)
    ref.decode_attention(q, expected, *args, logit_softcap=softcap)
    assert rel_err(by_cascade_ref, expected) < 1e-5 if dtype == torch.float32 else True
    assert rel_err(out, expected) < TOL[dtype]


@pytest.mark.gpu  # the concurrent stages need a CUDA side stream
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_concurrent_stages_equal_sequential_and_graph_replay(dtype):
    """The prefix stage on a side stream writes the same partials as when it runs first, eagerly and captured
    in a CUDA graph (fork and join inside the capture)."""
    q, args, groups, seq_lens = make_cascade_case(4, 128, dtype)
    plan = plan_cascade(groups, seq_lens, DEVICE, queries_per_tile=2)
    sequential, concurrent, replayed = torch.empty_like(q), torch.empty_like(q), torch.zeros_like(q)
    kw = dict(plan=plan, num_prefix_splits=3, num_suffix_splits=2)
    cascade_decode_attention(q, sequential, *args, **kw, concurrent_stages=False)
    cascade_decode_attention(q, concurrent, *args, **kw, concurrent_stages=True)
    torch.testing.assert_close(concurrent, sequential, rtol=0, atol=0)
    mid_o, mid_lse = decode_workspace(q.shape[0], q.shape[1], q.shape[2], 5, q.device)
    cascade_decode_attention(q, replayed, *args, **kw, mid_o=mid_o, mid_lse=mid_lse)  # warm-up before capture
    replayed.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cascade_decode_attention(q, replayed, *args, **kw, mid_o=mid_o, mid_lse=mid_lse)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(replayed, sequential, rtol=0, atol=0)


# ---- paged pools: page_size > 1 reads the request table once per page run ---------------------------------
# Under the interpreter BLOCK_N is 16: page size 4 gives four runs per block, 16 one, 32 half a page per block
# (gcd 16), 12 runs of 4 (a page size that is no power of two). Prefix and suffix boundaries fall mid-page.

PAGE_SIZES = [1, 4, 16]
ODD_PAGE_SIZES = [12, 32]


def paged_cases(cases: list[tuple]) -> list[tuple]:
    """Every case with page sizes 1, 4 and 16; the float32 ones with the odd page sizes too."""
    return [(p, *c) for c in cases for p in PAGE_SIZES + (ODD_PAGE_SIZES if torch.float32 in c else [])]


@pytest.mark.parametrize("page_size,heads_per_kv,head_dim,window,softcap,num_splits,dtype", paged_cases([
    (2, 64, None, None, 3, torch.float32),
    (4, 64, 5, 20.0, 4, torch.float32),  # a window: every split starts mid-run
    (4, 128, None, None, 2, torch.bfloat16),
]))
def test_decode_attention_paged(page_size, heads_per_kv, head_dim, window, softcap, num_splits, dtype):
    rng = random.Random(f"paged-{heads_per_kv}-{head_dim}-{num_splits}-{page_size}")
    q, args = make_decode_case(rng, heads_per_kv, head_dim, dtype, num_seqs=5, page_size=page_size)
    out, expected = torch.empty_like(q), torch.empty_like(q)
    decode_attention(q, out, *args, sliding_window=window, logit_softcap=softcap, num_kv_splits=num_splits,
                     page_size=page_size)
    ref.decode_attention(q, expected, *args, sliding_window=window, logit_softcap=softcap)
    assert rel_err(out, expected) < TOL[dtype]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_decode_paged_padded_entry_gives_zeros(page_size):
    rng = random.Random(7)
    q, (k, v, r2t, rows, seq_lens, scale) = make_decode_case(rng, 2, 64, torch.float32, page_size=page_size)
    seq_lens[1] = 0
    mid_o = torch.full((4, q.shape[1], 8, 64), float("nan"), device=DEVICE)
    mid_lse = torch.full((4, q.shape[1], 8), 1e4, device=DEVICE)
    out, expected = torch.empty_like(q), torch.empty_like(q)
    decode_attention(q, out, k, v, r2t, rows, seq_lens, scale, num_kv_splits=8, mid_o=mid_o, mid_lse=mid_lse,
                     page_size=page_size)
    ref.decode_attention(q, expected, k, v, r2t, rows, seq_lens, scale)
    assert torch.all(out[1] == 0)
    assert rel_err(out, expected) < 1e-4


@pytest.mark.parametrize("page_size,heads_per_kv,head_dim,window,softcap,contiguous,dtype", paged_cases([
    (2, 64, None, None, False, torch.float32),
    (2, 64, 8, 30.0, False, torch.float32),
    (4, 64, None, None, False, torch.bfloat16),
]) + [(16, 1, 128, 5, None, True, torch.float32)])  # pool prefix + contiguous new tokens
def test_extend_attention_paged(page_size, heads_per_kv, head_dim, window, softcap, contiguous, dtype):
    rng = random.Random(f"paged-{heads_per_kv}-{head_dim}-{window}-{page_size}")
    prefix_lens = [0, 19, 33, 16]  # cached prefixes ending mid-page and on a page boundary
    q, args, k_new, v_new = make_extend_case(rng, heads_per_kv, head_dim, dtype, num_seqs=4, page_size=page_size,
                                             prefix_lens=prefix_lens)
    extra = {"k_extend": k_new, "v_extend": v_new} if contiguous else {}
    out, expected = torch.empty_like(q), torch.empty_like(q)
    extend_attention(q, out, *args, sliding_window=window, logit_softcap=softcap, page_size=page_size,
                     pack_heads=heads_per_kv > 1, **extra)
    ref.extend_attention(q, expected, *args, sliding_window=window, logit_softcap=softcap)
    assert rel_err(out, expected) < TOL[dtype]


@pytest.mark.parametrize("page_size,window,splits", [(4, None, 3), (16, 8, 2)])
def test_extend_attention_paged_block_map(page_size, window, splits):
    """The fixed-grid, split-KV launch of the EXTEND graphs over a paged pool (page size 1: the block-map test
    above)."""
    from prefixrt.kernels.extend_attention import block_map

    rng = random.Random(f"paged-map-{window}-{page_size}")
    q, args, _, _ = make_extend_case(rng, 2, 64, torch.float32, num_seqs=4, page_size=page_size,
                                     prefix_lens=[0, 37, 5, 48])
    extend_lens = args[5].tolist()
    seqs, mbs = block_map(extend_lens, 16, len(extend_lens) + -(-sum(extend_lens) // 16) + 2)
    i32 = {"dtype": torch.int32, "device": DEVICE}
    out, expected = torch.full_like(q, 7.0), torch.empty_like(q)
    extend_attention(q, out, *args, sliding_window=window, block_seq=torch.tensor(seqs, **i32),
                     block_mb=torch.tensor(mbs, **i32), block_m=16, num_splits=splits, page_size=page_size)
    ref.extend_attention(q, expected, *args, sliding_window=window)
    assert rel_err(out, expected) < 1e-4


@pytest.mark.parametrize("page_size,heads_per_kv,head_dim,softcap,per_tile,prefix_splits,suffix_splits,dtype",
                         paged_cases([
    (2, 64, None, 2, 3, 2, torch.float32),
    (4, 64, 25.0, 16, 2, 3, torch.float32),
    (4, 64, None, 16, 2, 2, torch.bfloat16),
]))  # fmt: skip
def test_cascade_decode_paged(page_size, heads_per_kv, head_dim, softcap, per_tile, prefix_splits, suffix_splits,
                              dtype):
    """Shared prefixes of 30 and 17 tokens (mid-page for every page size here): the prefix stage reads them
    through the lead row, each member's suffix starts mid-page in its own copy-on-write page."""
    q, args, groups, seq_lens = make_cascade_case(heads_per_kv, head_dim, dtype, page_size=page_size)
    plan = plan_cascade(groups, seq_lens, DEVICE, queries_per_tile=per_tile)
    out, expected = torch.empty_like(q), torch.empty_like(q)
    cascade_decode_attention(
        q, out, *args, plan=plan, logit_softcap=softcap, num_prefix_splits=prefix_splits,
        num_suffix_splits=suffix_splits, page_size=page_size,
    )  # fmt: skip
    ref.decode_attention(q, expected, *args, logit_softcap=softcap)
    assert rel_err(out, expected) < TOL[dtype]


def test_paged_case_layout():
    """The fixture itself: every row keeps slot(p) = slot(p - p % P) + p % P, and copy-on-write pages hold
    the shared prefix's K/V (so plain decode through a member's own row reads the prefix)."""
    q, (k, v, r2t, rows, seq_lens, _), groups, _ = make_cascade_case(2, 64, torch.float32, page_size=16)
    for row, n in zip(rows.tolist(), seq_lens.tolist()):
        slots = r2t[row, :n].long()
        pos = torch.arange(n, device=DEVICE)
        assert torch.equal(slots, slots[pos - pos % 16] + pos % 16)
        assert torch.all(slots[pos % 16 == 0] % 16 == 0)
    for prefix_len, members in groups:
        lead = r2t[rows[members[0]], :prefix_len].long()
        for m in members[1:]:
            own = r2t[rows[m], :prefix_len].long()
            assert torch.equal(own[:16], lead[:16])  # the whole page is shared
            assert not torch.equal(own[16:], lead[16:])  # the partial one is a copy
            assert torch.equal(k[own], k[lead]) and torch.equal(v[own], v[lead])


def test_plan_cascade_filters_and_validates():
    seq_lens = [40, 40, 40, 10]
    assert plan_cascade(None, seq_lens, "cpu") is None
    assert plan_cascade([(30, [0])], seq_lens, "cpu") is None  # a group of one shares nothing
    assert plan_cascade([(30, [0, 1])], seq_lens, "cpu", min_prefix_len=64) is None
    plan = plan_cascade([(30, [0, 1, 2])], seq_lens, "cpu", queries_per_tile=2)
    assert plan.num_tiles == 2 and plan.tile_num_seqs.tolist() == [2, 1]
    assert plan.suffix_start.tolist() == [30, 30, 30, 0] and plan.max_suffix_len == 10
    with pytest.raises(ValueError, match="exceeds"):
        plan_cascade([(30, [0, 3])], seq_lens, "cpu")
    with pytest.raises(ValueError, match="two prefix groups"):
        plan_cascade([(5, [0, 1]), (5, [1, 2])], seq_lens, "cpu")
    with pytest.raises(ValueError, match="batch has"):
        plan_cascade([(5, [0, 9])], seq_lens, "cpu")


# ---- backend ---------------------------------------------------------------------------------------------


def dense_attention_over_pool(q, pool, layer, batch):
    """Straightforward attention: per sequence, gather its K/V by position and apply the causal/window mask."""
    num_heads, head_dim = layer.num_heads, layer.head_dim
    q = q.view(-1, num_heads, head_dim).float()
    out = torch.zeros_like(q)
    k_all, v_all = pool.k_buffers[layer.layer_id], pool.v_buffers[layer.layer_id]
    for i in range(batch.batch_size):
        prefix, ext, start = batch.prefix_lens_cpu[i], batch.extend_lens_cpu[i], int(batch.extend_start_loc[i])
        slots = batch.req_to_token[batch.req_pool_indices[i], : prefix + ext].long()
        group = num_heads // layer.num_kv_heads
        k = k_all[slots].float().repeat_interleave(group, dim=1)  # k: [S, H, D]
        v = v_all[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start : start + ext], k) * layer.scaling
        if layer.logit_softcap is not None:
            scores = layer.logit_softcap * torch.tanh(scores / layer.logit_softcap)
        q_pos = torch.arange(prefix, prefix + ext, device=q.device)[:, None]
        k_pos = torch.arange(prefix + ext, device=q.device)[None, :]
        visible = k_pos <= q_pos
        if layer.sliding_window is not None:
            visible &= k_pos > q_pos - layer.sliding_window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start : start + ext] = torch.einsum("hqk,khd->qhd", probs, v)
    return out.view(-1, num_heads * head_dim)


@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_backend_extend_then_cascade_decode(page_size):
    """Prefill a shared prompt, extend two more requests on the cached prefix, then decode all of them with
    prefix_groups: every forward of both layers (full and sliding-window) must match dense attention.
    page_size 16: rows take whole pages and the 20-token shared prefix ends mid-page (its partial page is
    copied into each sharer's own page, as copy-on-write would)."""
    num_kv_heads, head_dim, num_heads = 2, 64, 4
    layers = [
        AttentionLayer(0, num_heads, num_kv_heads, head_dim, scaling=head_dim**-0.5),
        AttentionLayer(1, num_heads, num_kv_heads, head_dim, scaling=head_dim**-0.5, sliding_window=8),
    ]
    pool = KVPool(256, len(layers), num_kv_heads, head_dim, torch.float32, DEVICE)
    backend = TritonAttentionBackend(pool, max_batch_size=8, cascade_min_prefix_len=1, page_size=page_size)
    req_to_token = torch.zeros(8, 64, dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(3)
    free = (torch.randperm(255, generator=gen) + 1).tolist()
    free_pages = (torch.randperm(256 // page_size - 1, generator=gen) + 1).tolist() if page_size > 1 else []
    lengths = {1: 0, 2: 0, 3: 0, 4: 0}  # request row -> tokens with K/V

    def slot_of(row, pos):  # paged: the row's page for pos (a fresh one at a page start)
        if pos % page_size == 0:
            page = free_pages.pop()
            req_to_token[row, pos : pos + page_size] = torch.arange(page * page_size, (page + 1) * page_size)
        return int(req_to_token[row, pos])

    def step(rows, num_new, prefix_groups=None, share_from=None, shared_len=0):
        out_loc = []
        for row, n in zip(rows, num_new):
            if share_from is not None and lengths[row] == 0 and row != share_from:
                whole = shared_len // page_size * page_size
                req_to_token[row, :whole] = req_to_token[share_from, :whole]
                src = req_to_token[share_from, whole:shared_len].long()
                dst = torch.tensor([slot_of(row, p) for p in range(whole, shared_len)], dtype=torch.long,
                                   device=DEVICE)
                for kb, vb in zip(pool.k_buffers, pool.v_buffers):
                    kb[dst], vb[dst] = kb[src], vb[src]
                lengths[row] = shared_len
            if page_size == 1:
                new = [free.pop() for _ in range(n)]
            else:
                new = [slot_of(row, p) for p in range(lengths[row], lengths[row] + n)]
            req_to_token[row, lengths[row] : lengths[row] + n] = torch.tensor(new, dtype=torch.int32)
            out_loc += new
        batch = ForwardBatch.build(
            req_pool_indices=rows, prefix_lens=[lengths[r] for r in rows],
            extend_tokens=[[7] * n for n in num_new], out_cache_loc=out_loc, req_to_token=req_to_token,
            logits_indices=[], device=DEVICE, prefix_groups=prefix_groups,
        )  # fmt: skip
        for row, n in zip(rows, num_new):
            lengths[row] += n
        backend.prepare(batch)
        for layer in layers:
            t = batch.num_tokens
            q = torch.randn(t, num_heads * head_dim, generator=gen).to(DEVICE)
            k = torch.randn(t, num_kv_heads * head_dim, generator=gen).to(DEVICE)
            v = torch.randn(t, num_kv_heads * head_dim, generator=gen).to(DEVICE)
            out = backend.forward(q, k, v, layer, batch)
            assert rel_err(out, dense_attention_over_pool(q, pool, layer, batch)) < 1e-4
        return batch

    step([1, 4], [21, 12])  # prefill: row 1 holds the shared 20-token prompt + 1 own token; row 4 unrelated
    step([2, 3], [3, 7], share_from=1, shared_len=20)  # extend on the cached prefix
    batch = step([1, 2, 3, 4], [1, 1, 1, 1], prefix_groups=[(20, [0, 1, 2])])  # decode, cascade
    assert batch.mode.value == "decode" and backend.cascade_plan is not None


@pytest.mark.parametrize("pack", [False, True], ids=["per-head", "packed-heads"])
@pytest.mark.parametrize("block_m,window,dtype,splits,heads_per_kv", [
    (16, None, torch.float32, 1, 2), (32, 8, torch.float32, 1, 2), (16, None, torch.bfloat16, 1, 4),
    (16, None, torch.float32, 3, 2), (32, 8, torch.float32, 4, 4), (16, None, torch.bfloat16, 2, 3)])
def test_extend_attention_block_map_equals_reference(block_m, window, dtype, splits, heads_per_kv, pack):
    """The fixed-grid launch (CUDA graphs): a padded block map gives the reference result, and padding
    entries (-1) write nothing; with split-KV the merged partials equal it too. Packed, a block's programs
    hold its tokens x the kv head's query heads."""
    from prefixrt.kernels.extend_attention import block_map
    rng = random.Random(f"map-{block_m}-{window}")
    q, args, _, _ = make_extend_case(rng, heads_per_kv, 64, dtype, num_seqs=4)
    extend_lens = args[5].tolist()
    nb = len(extend_lens) + -(-sum(extend_lens) // block_m) + 3  # room to spare: padding entries
    seqs, mbs = block_map(extend_lens, block_m, nb)
    i32 = {"dtype": torch.int32, "device": DEVICE}
    out = torch.full_like(q, 7.0)
    expected = torch.empty_like(q)
    extend_attention(q, out, *args, sliding_window=window, block_seq=torch.tensor(seqs, **i32),
                     block_mb=torch.tensor(mbs, **i32), block_m=block_m, num_splits=splits, pack_heads=pack)
    ref.extend_attention(q, expected, *args, sliding_window=window)
    assert rel_err(out, expected) < TOL[dtype]


@pytest.mark.parametrize("per_tile,max_groups,dtype,page_size", [
    (2, 3, torch.float32, 1), (16, 4, torch.float32, 1), (4, 2, torch.bfloat16, 1), (2, 3, torch.float32, 16),
])
def test_padded_cascade_plan_equals_plain_decode(per_tile, max_groups, dtype, page_size):
    """A plan padded to a fixed tile count (CUDA graphs), over a batch padded with extra rows: padding tiles
    do nothing, padded rows are ungrouped; the real rows equal plain decode."""
    from prefixrt.kernels.cascade_plan import PLAN_FIELDS, CascadePlan, pad_lists, padded_sizes, plan_lists

    q, args, groups, seq_lens = make_cascade_case(4, 64, dtype, page_size=page_size)
    n = len(seq_lens)
    bs = n + 3  # the graph's bucket
    lists = plan_lists(groups, seq_lens, per_tile, max_groups=max_groups)
    sizes = padded_sizes(bs, max_groups, per_tile)
    flat = torch.tensor(pad_lists(lists, sizes), dtype=torch.int32, device=DEVICE)
    views, off = [], 0
    for name in PLAN_FIELDS:
        views.append(flat[off : off + sizes[name]])
        off += sizes[name]
    plan = CascadePlan(*views, queries_per_tile=per_tile, num_tiles=sizes["tile_group"], max_prefix_len=96,
                       max_suffix_len=96)
    assert sizes["tile_group"] > len(lists["tile_group"])  # there are padding tiles
    out, expected = torch.empty_like(q), torch.empty_like(q)
    cascade_decode_attention(q, out, *args, plan=plan, num_prefix_splits=2, num_suffix_splits=2,
                             page_size=page_size)
    ref.decode_attention(q, expected, *args)
    assert rel_err(out, expected) < TOL[dtype]


def test_prefix_grouper_groups_shared_tree_pages():
    from types import SimpleNamespace

    from prefixrt.engine.loop.prefix_groups import PrefixGrouper, common_prefix

    assert common_prefix([1, 2, 3, 4], [1, 2, 9, 4], 4) == 2 and common_prefix([1, 2], [1, 2], 5) == 2
    shared = list(range(100, 400))

    def req(row, pages, cached):
        return SimpleNamespace(row=row, pages=pages, cached_len=cached)

    reqs = [req(0, shared + [1, 2], 302), req(1, shared + [3], 300), req(2, shared[:280] + [7] * 30, 310),
            req(3, [9] * 300, 300), req(4, shared + [5], 100)]
    g = PrefixGrouper(page_size=1, min_prefix_len=256)
    groups = g.groups(reqs)
    assert groups == [(280, [0, 1, 2])]  # row 4 caches too little; row 3 shares nothing
    assert g.groups(reqs) is groups  # unchanged batch: the same object (graphs keep their plan)
    reqs[1].cached_len = 250  # changed: recomputed; row 1 now caches less than the minimum share
    assert g.groups(reqs) == [(280, [0, 2])]
    paged = PrefixGrouper(page_size=16, min_prefix_len=32)
    two = [req(0, [4, 5, 6, 7], 64), req(1, [4, 5, 6, 8], 60)]
    assert paged.groups(two) == [(48, [0, 1])]


@pytest.mark.parametrize("heads_per_program", [1, 2, 4])
def test_merge_splits_equals_lse_weighted_mean(heads_per_program):
    """launch_merge vs the LSE-weighted mean in torch, at several heads per program (6 heads: a partial last
    program). Dead splits hold NaN partials, the guarded (cascade prefix) splits count only where kv_start > 0,
    and a sequence with no live split gets zeros."""
    from prefixrt.kernels.decode_attention import launch_merge

    gen = torch.Generator().manual_seed(3)
    batch, heads, splits, dim, guarded = 4, 6, 5, 32, 2
    mid_o = torch.randn(batch, heads, splits, dim, generator=gen)
    mid_lse = torch.randn(batch, heads, splits, generator=gen) * 3
    mid_lse[0, :, 3] = float("-inf")  # a split past the sequence's end ...
    mid_o[0, :, 3] = float("nan")  # ... whose partial is stale
    mid_lse[3] = float("-inf")  # a padded entry: nothing live
    kv_start = torch.tensor([5, 0, 7, 0], dtype=torch.int32)  # sequences 1 and 3 are in no prefix group
    mid_o[1, :, :guarded] = float("nan")  # their prefix splits are stale workspace
    live = mid_lse > float("-inf")
    live[:, :, :guarded] &= (kv_start > 0)[:, None, None]
    lse = torch.where(live, mid_lse, float("-inf"))
    w = torch.where(live, torch.softmax(lse.clamp_min(-1e30), dim=-1), 0.0)
    expected = (torch.where(live[..., None], mid_o, 0.0) * w[..., None]).sum(2)
    expected[3] = 0
    out = torch.empty(batch, heads, dim, device=DEVICE)
    launch_merge(out, mid_o.to(DEVICE), mid_lse.to(DEVICE), splits, kv_start=kv_start.to(DEVICE), num_guarded=guarded,
                 heads_per_program=heads_per_program)  # fmt: skip
    assert torch.isfinite(out).all()
    assert rel_err(out.cpu(), expected) < 1e-5
