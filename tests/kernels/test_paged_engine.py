"""Whole engines on the Triton attention backend over a paged KV pool (on the CPU the kernels run under
TRITON_INTERPRET=1, see conftest.py): greedy outputs at page sizes 4 and 16 equal those at page size 1, and
those of the torch attention backend. The workload reuses cached prefixes that end mid-page (the hit is cut
to whole pages, the rest recomputed) and prefills in chunks that start mid-page; mistral's sliding window
(4) makes every decode step's key range start mid-page."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("triton")

from prefixrt.kernels._common import interpreting  # noqa: E402

GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 6}


def _prompts() -> list[list[int]]:
    rng = random.Random(13)
    root = [1] + [rng.randrange(3, 320) for _ in range(36)]  # 37 tokens: not a page multiple
    prompts = [root + [rng.randrange(3, 320) for _ in range(n)] for n in (3, 11, 20)]
    prompts.append(root[:21] + [rng.randrange(3, 320) for _ in range(9)])  # branches mid-way through page 2
    prompts.append([1] + [rng.randrange(3, 320) for _ in range(12)])  # unrelated
    return prompts


def _run(eng, prompts):
    first = eng.generate(prompts[0], GREEDY)  # cached first: the others hit it
    rest = eng.generate(prompts[1:], GREEDY)
    return [first.token_ids] + [c.token_ids for c in rest], [first.cached_tokens] + [c.cached_tokens for c in rest]


@pytest.mark.skipif(not interpreting(), reason="make_engine builds CPU engines: Triton runs there only interpreted")
@pytest.mark.parametrize("arch", ["mistral"])
def test_paged_triton_engine_equals_page_size_1(arch, make_engine):
    prompts = _prompts()
    common = {"chunked_prefill_tokens": 24, "kv_cache_tokens": 1024}
    want, _ = _run(make_engine(arch, attention_backend="torch", page_size=1, **common), prompts)
    got = {}
    for page_size in (1, 4, 16):
        eng = make_engine(arch, attention_backend="triton", page_size=page_size, **common)
        backend = eng.core.runner.attn_backend
        assert type(backend).__name__ == "TritonAttentionBackend" and backend.page_size == page_size
        got[page_size], cached = _run(eng, prompts)
        assert cached[1:4] == [37 // page_size * page_size] * 2 + [21 // page_size * page_size], cached
    assert got[1] == want  # the Triton backend equals the torch one
    assert got[4] == got[1] and got[16] == got[1]
