"""The engine against transformers itself: greedy tokens equal `generate` on every architecture, with
prompts that share prefixes and hit the cache, in page sizes 1 and 16, with and without the radix cache."""

from __future__ import annotations

import random

import pytest
import torch

from tests.helpers.checkpoints import ARCH_NAMES

NEW_TOKENS = 8


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [1] + [rng.randrange(3, 320) for _ in range(23)]
    prompts = [shared + [rng.randrange(3, 320) for _ in range(rng.randint(1, 12))] for _ in range(5)]
    prompts += [[1] + [rng.randrange(3, 320) for _ in range(rng.randint(2, 40))] for _ in range(3)]
    prompts.append(prompts[0][:17])  # a strict prefix of an earlier prompt
    prompts.append(list(prompts[1]))  # an exact repeat: cache hit of len - 1
    return prompts


def _hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ARCH_NAMES)
@pytest.mark.parametrize("overlap", [True, False])
def test_greedy_matches_transformers(arch, make_engine, tiny_checkpoints, overlap):
    _, hf = tiny_checkpoints(arch)
    prompts = _prompts()
    want = [_hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    eng = make_engine(arch, overlap_schedule=overlap, chunked_prefill_tokens=16)
    # First one by one (later prompts hit what earlier ones cached), then all at once.
    seq = [eng.generate(p, params) for p in prompts]
    assert [c.token_ids for c in seq] == want
    assert seq[-1].cached_tokens == len(prompts[-1]) - 1
    assert sum(c.cached_tokens > 0 for c in seq) >= 4
    batch = eng.generate(prompts, params)
    assert [c.token_ids for c in batch] == want


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_matches_transformers_paged_and_no_cache(page_size, make_engine, tiny_checkpoints):
    _, hf = tiny_checkpoints("gemma3")
    prompts = _prompts(1)
    want = [_hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    for radix in (True, False):
        eng = make_engine("gemma3", page_size=page_size, radix_cache=radix, chunked_prefill_tokens=16)
        assert [eng.generate(p, params).token_ids for p in prompts] == want
        assert [c.token_ids for c in eng.generate(prompts, params)] == want
