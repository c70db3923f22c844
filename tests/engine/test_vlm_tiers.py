"""Images with the host and disk tiers of the KV cache, on the tiny VLMs (CPU, fp32).

An image prefix moves to the host tier (and on to the disk) like text and comes back: its K/V is keyed by the
image's full digest in every tier, so a restored prefix answers as a no-reuse engine does, reports its image
tokens cached and runs the vision tower zero times, and a different image of the same size never matches it,
even when every ImageKey hashes alike and every disk file name collides.
"""

from __future__ import annotations

import pytest

from prefixrt.request import ImageKey
from tests.engine.test_vlm_engine import block_bounds
from tests.helpers.engines import assert_idle_and_clean
from tests.helpers.images import ask, random_image

GREEDY = {"max_new_tokens": 5, "temperature": 0.0}
POLICIES = ["write_through", "write_back"]


def _push_out(eng, seed: int, n: int = 4) -> None:
    """Requests about other images, enough to evict every unlocked prefix from a small pool."""
    for i in range(n):
        eng.generate(ask(f"Describe picture number {i} in detail, please.", random_image(seed + i)), GREEDY)


def _no_encoder_cache(eng) -> None:
    """Only the K/V tiers may spare the vision tower."""
    eng.core.encoder.capacity = 0
    eng.core.encoder.clear()


def _first_image_end(eng, messages) -> int:
    return block_bounds(eng, messages)[1]


@pytest.mark.parametrize("name", ["gemma3_vlm", "llava"])
@pytest.mark.parametrize("policy", POLICIES)
def test_image_prefix_restored_from_host(make_vlm, name, policy):
    eng = make_vlm(name, kv_cache_tokens=96, host_kv_cache_tokens=4096, host_kv_write_policy=policy,
                   host_kv_debug_delay_s=0.0005)
    _no_encoder_cache(eng)
    ref = make_vlm(name, radix_cache=False)
    image = random_image(31)
    eng.generate(ask("What is the capital?", image), GREEDY)
    _push_out(eng, 100)
    s = eng.stats()
    assert s.evicted_tokens_total > 0
    model = eng._built.model
    runs, host_hits = model.vision_runs, s.host_hit_tokens_total
    again = ask("Question: where is the fox?", image)
    got = eng.generate(again, GREEDY)
    assert got.token_ids == ref.generate(again, GREEDY).token_ids
    assert got.cached_tokens >= _first_image_end(eng, again)  # the text before the image and the whole image
    assert eng.stats().host_hit_tokens_total - host_hits >= model.vision.tokens_per_image  # the image's K/V
    assert model.vision_runs == runs  # the vision tower ran zero times: the K/V came back from the host
    eng.check_integrity()


@pytest.mark.parametrize("name", ["gemma3_vlm", "llava"])
def test_other_image_never_matches_a_host_prefix(make_vlm, monkeypatch, name):
    """Image a's prefix lives in the host tier only; image b (same size, every ImageKey hashing alike) reuses the
    text before its image and nothing more, and its answer is b's."""
    monkeypatch.setattr(ImageKey, "__hash__", lambda self: 7)
    eng = make_vlm(name, kv_cache_tokens=96, host_kv_cache_tokens=4096, host_kv_write_policy="write_back")
    _no_encoder_cache(eng)
    ref = make_vlm(name, radix_cache=False)
    a, b = random_image(51), random_image(52)
    assert a.size == b.size
    question = "What is the capital?"
    eng.generate(ask(question, a), GREEDY)
    _push_out(eng, 200)
    runs = eng._built.model.vision_runs
    got = eng.generate(ask(question, b), GREEDY)
    start, _ = block_bounds(eng, ask(question, b))
    assert got.cached_tokens <= start + (eng._built.model.vision.begin_token_id is not None)  # no image token
    assert got.token_ids == ref.generate(ask(question, b), GREEDY).token_ids
    assert eng._built.model.vision_runs == runs + 1


def _disk_engine(make_vlm, tmp_path, name):
    return make_vlm(name, kv_cache_tokens=96, host_kv_cache_tokens=64, kv_disk_dir=str(tmp_path / "kv"),
                    host_kv_write_policy="write_back")


def _close(eng) -> None:
    assert_idle_and_clean(eng)
    eng.shutdown()  # writes what the disk lacks


@pytest.mark.parametrize("name", ["gemma3_vlm", "llava"])
def test_image_prefix_restored_from_disk_after_restart(make_vlm, tmp_path, name):
    """A restarted engine finds the image's K/V on disk: its first question about the image reports the image
    tokens cached and its vision tower never runs."""
    ref = make_vlm(name, radix_cache=False)
    image = random_image(61)
    eng = _disk_engine(make_vlm, tmp_path, name)
    eng.generate(ask("What is the capital?", image), GREEDY)
    _push_out(eng, 300)  # through the 64-token host tier to the disk, during the run
    again = ask("Question: where is the fox?", image)
    _no_encoder_cache(eng)
    runs = eng._built.model.vision_runs
    got = eng.generate(again, GREEDY)
    assert got.token_ids == ref.generate(again, GREEDY).token_ids
    assert got.cached_tokens >= _first_image_end(eng, again)
    assert eng._built.model.vision_runs == runs
    assert eng.stats().disk_hit_tokens_total > 0
    _close(eng)

    eng = _disk_engine(make_vlm, tmp_path, name)
    assert eng.stats().kv_disk_files > 0
    third = ask("Is it a cat?", image)
    got = eng.generate(third, GREEDY)
    assert got.token_ids == ref.generate(third, GREEDY).token_ids
    assert got.cached_tokens >= _first_image_end(eng, third)
    assert eng._built.model.vision_runs == 0  # nothing encoded by this engine
    s = eng.stats()
    assert s.disk_hit_tokens_total > 0 and s.disk_rejected_files_total == 0


def test_other_image_never_matches_a_disk_prefix(make_vlm, tmp_path, monkeypatch):
    """Image a's K/V on disk, every ImageKey hashing alike and every disk key colliding (a truncated hash):
    image b's request may read a's files but uses none of their image tokens."""
    import prefixrt.cache.disk_store as disk_store

    monkeypatch.setattr(ImageKey, "__hash__", lambda self: 7)
    name = "gemma3_vlm"
    ref = make_vlm(name, radix_cache=False)
    a, b = random_image(71), random_image(72)
    eng = _disk_engine(make_vlm, tmp_path, name)
    question = "What is the capital?"
    eng.generate(ask(question, a), GREEDY)
    _close(eng)

    monkeypatch.setattr(disk_store, "_digest", lambda h: "0" * 32)
    eng = _disk_engine(make_vlm, tmp_path, name)
    got = eng.generate(ask(question, b), GREEDY)
    start, _ = block_bounds(eng, ask(question, b))
    assert got.cached_tokens <= start + 1  # the text and the boi token at most
    assert got.token_ids == ref.generate(ask(question, b), GREEDY).token_ids
    assert eng._built.model.vision_runs == 1
