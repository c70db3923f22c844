"""Every architecture against transformers' own forward and generate (fp32, CPU): prefill, paged
prefix reuse + extend + batched decode, and greedy generation with shared prefixes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prefixrt.hub.loader import load_model
from tests.helpers.checkpoints import ARCH_NAMES, save_tiny_checkpoint
from tests.helpers.harness import PagedHarness

VOCAB = 320
RTOL = 1e-4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=ARCH_NAMES)
def models(request, tmp_path_factory):
    """(transformers model, our model loaded from its saved checkpoint)."""
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_checkpoint(request.param, path)
    ours = load_model(str(path), dtype=torch.float32, device="cpu")
    return request.param, hf, ours


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:  # [len(tokens), vocab]
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def test_prefill_matches_transformers(models):
    _, hf, ours = models
    prompts = [random_tokens(n, seed) for seed, n in enumerate([7, 12, 19])]
    harness = PagedHarness(ours)
    logits = harness.forward([(harness.new_row(), p) for p in prompts])  # one ragged batch
    for prompt, got in zip(prompts, logits):
        assert got.shape == (len(prompt), VOCAB)
        assert rel_err(got, hf_logits(hf, prompt)) < RTOL


def test_paged_prefix_extend_decode(models):
    """Prefix prefill, then extend reading the cached prefix (one row borrows another row's prefix
    slots), then batched ragged decode steps; every position's logits equal the full-sequence forward."""
    _, hf, ours = models
    num_decode = 4
    seq_a, seq_b = random_tokens(14, 10), random_tokens(10, 11)
    seq_c = seq_a[:6] + random_tokens(12, 12)  # shares seq_a's first 6 tokens
    harness = PagedHarness(ours)
    row_a, row_b = harness.new_row(), harness.new_row()
    got = {0: [], 1: [], 2: []}

    first = harness.forward([(row_a, seq_a[:6]), (row_b, seq_b[:3])])
    got[0].append(first[0])
    got[1].append(first[1])
    row_c = harness.new_row(share_prefix_of=row_a, prefix_len=6)

    stops = [len(s) - num_decode for s in (seq_a, seq_b, seq_c)]
    second = harness.forward([(row_a, seq_a[6 : stops[0]]), (row_b, seq_b[3 : stops[1]]), (row_c, seq_c[6 : stops[2]])])
    for i in range(3):
        got[i].append(second[i])
    for step in range(num_decode):
        work = [(row, [seq[stop + step]]) for row, seq, stop in zip((row_a, row_b, row_c), (seq_a, seq_b, seq_c), stops)]
        for i, lg in enumerate(harness.forward(work)):
            got[i].append(lg)

    ref_c = hf_logits(hf, seq_c)[6:]  # seq_c's first 6 positions were computed as seq_a's
    for i, ref in enumerate([hf_logits(hf, seq_a), hf_logits(hf, seq_b), ref_c]):
        ours_all = torch.cat(got[i])
        assert ours_all.shape == ref.shape
        assert rel_err(ours_all, ref) < RTOL, f"sequence {i}"


def test_greedy_matches_generate(models):
    _, hf, ours = models
    max_new = 8
    shared_1, shared_2 = random_tokens(6, 20), random_tokens(9, 21)
    prompts = (
        [shared_1 + random_tokens(n, 30 + n) for n in (1, 3, 5)]
        + [shared_2 + random_tokens(n, 40 + n) for n in (2, 4)]
        + [shared_2]
        + [random_tokens(n, 50 + n) for n in (4, 11)]
    )
    harness = PagedHarness(ours)
    got = harness.generate_greedy(prompts, max_new)
    for prompt, tokens in zip(prompts, got):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, pad_token_id=0)
        assert tokens == out[0, len(prompt) :].tolist(), f"prompt {prompt}"


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_window_is_exercised(name, tmp_path):
    """Guards the tests above: dropping the sliding window must break the match at these lengths."""
    hf = save_tiny_checkpoint(name, tmp_path)
    ours = load_model(str(tmp_path))
    for layer in ours.model.layers:
        layer.self_attn.layer = dataclasses.replace(layer.self_attn.layer, sliding_window=None)
    prompt = random_tokens(12, 3)
    harness = PagedHarness(ours)
    got = harness.forward([(harness.new_row(), prompt)])[0]
    assert rel_err(got, hf_logits(hf, prompt)) > 1e-2
