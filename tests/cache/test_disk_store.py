"""DiskKVStore on hand-built K/V: a written segment reads back exactly after a restart (the index rebuilt from
the files), a chain of segments extends a match, only the part whose tokens equal the request's is used (image
tokens by their full digest), and the size cap deletes least recently used files first. Bounded per-salt labels (SaltCounters)."""

from __future__ import annotations

import torch

from prefixrt.cache.disk_format import token_bytes
from prefixrt.cache.disk_store import DiskKVStore
from prefixrt.cache.salt_stats import OTHER, SaltCounters
from prefixrt.request import ImageKey

LAYERS, HEADS, DIM = 2, 1, 4


def store(path, max_bytes=1 << 30, page_size=1, identity="model@1"):
    return DiskKVStore(path, identity, max_bytes, LAYERS, HEADS, DIM, torch.float32, page_size)


def kv_of(tokens, start):
    """K/V as a function of (token, position, layer): [layers, n, heads, dim]."""
    k = torch.tensor([[[[t, p, layer, 1.0]] for p, t in enumerate(tokens) if p >= start] for layer in range(LAYERS)])
    return k, -k


def read(s, ids, salt=None, start=0, cap=None):
    cap = len(ids) if cap is None else cap
    f = s.fetch(salt, ids, start, cap, s.lookup(salt, ids, start, cap))
    f.done.wait(10)
    s.finish_fetch(f)
    return f


def test_segments_survive_a_restart_and_chain_exactly(tmp_path):
    a = list(range(10, 22))
    b = a + list(range(40, 48))
    s = store(tmp_path)
    s.write(None, a, 0, *kv_of(a, 0))
    s.write(None, b, len(a), *kv_of(b, len(a)))  # a second segment continuing the first
    s.write("tenant", a, 0, *kv_of(a, 0))
    s.close()
    assert not list(tmp_path.glob(".tmp-*"))  # written atomically: no temporary file left

    s = store(tmp_path)
    assert s.num_files == 3 and s.cached_tokens == 12 + 8 + 12
    f = read(s, b + [99, 98])
    assert [(g.start, g.end) for g in f.segments] == [(0, 12), (12, 20)]
    for g in f.segments:
        want_k, want_v = kv_of(b[:g.end], g.start)
        assert torch.equal(g.k, want_k) and torch.equal(g.v, want_v)
    # A request sharing only part of the second segment uses exactly that part.
    c = a + [40, 41, 42, 7, 7]
    f = read(s, c)
    assert [(g.start, g.end) for g in f.segments] == [(0, 12), (12, 15)]
    assert torch.equal(f.segments[1].k, kv_of(c[:15], 12)[0])
    # Another salt or identity sees nothing of it.
    assert read(s, b, salt="other").segments == []
    s.close()
    other = store(tmp_path, identity="model@2")
    assert other.num_files == 0 and read(other, b).segments == []
    other.close()


def test_pages_align_the_part_used(tmp_path):
    s = store(tmp_path, page_size=4)
    a = list(range(10, 26))  # 16 tokens, 4 pages
    s.write(None, a, 0, *kv_of(a, 0))
    s.flush()
    f = read(s, a[:10] + [1, 2, 3, 4, 5, 6])  # 10 tokens match: 2 whole pages
    assert [(g.start, g.end) for g in f.segments] == [(0, 8)]
    s.close()


def test_image_tokens_are_stored_and_compared_in_full(tmp_path):
    """A prefix with image tokens ((ImageKey, offset), as a keyed prompt holds them) reads back after a restart
    with its keys; a request whose image differs (same offsets, another digest) uses only the text before it."""
    img, other = ImageKey(bytes(range(32))), ImageKey(bytes(range(1, 33)))
    a = [10, 11] + [(img, j) for j in range(4)] + [12, 13, (img, 0), (img, 1)]
    assert token_bytes(a) == token_bytes(a[:5]) + token_bytes(a[5:])  # a hash extends segment by segment
    assert token_bytes(a) != token_bytes([(other, t[1]) if isinstance(t, tuple) else t for t in a])
    s = store(tmp_path)
    s.write(None, a[:6], 0, *kv_of([0] * 6, 0))
    s.write(None, a, 6, *kv_of([0] * 10, 6))
    s.close()
    s = store(tmp_path)
    f = read(s, a + [5])
    assert [(g.start, g.end) for g in f.segments] == [(0, 6), (6, 10)]
    b = [10, 11] + [(other, j) for j in range(4)] + a[6:]
    assert [(g.start, g.end) for g in read(s, b).segments] == [(0, 2)]
    s.close()


def test_size_cap_deletes_least_recently_used_first(tmp_path):
    prompts = [[i] + list(range(100 + 10 * i, 110 + 10 * i)) for i in range(4)]
    s = store(tmp_path)
    for p in prompts[:2]:
        s.write(None, p, 0, *kv_of(p, 0))
    s.flush()
    one_file = s.used_bytes // 2
    s.close()
    s = store(tmp_path, max_bytes=2 * one_file)
    s.write(None, prompts[2], 0, *kv_of(prompts[2], 0))
    s.flush()  # over the cap: the oldest, prompts[0]... unless it is used first
    assert s.evicted_bytes_total == one_file and not read(s, prompts[0]).segments
    assert read(s, prompts[1]).segments  # prompts[1] is now the most recent
    s.write(None, prompts[3], 0, *kv_of(prompts[3], 0))
    s.flush()
    assert s.used_bytes <= 2 * one_file and s.evicted_bytes_total == 2 * one_file
    assert [bool(read(s, p).segments) for p in prompts] == [False, True, False, True]
    assert len(list(tmp_path.glob("*.kv"))) == 2  # the evicted files are deleted
    s.close()


def test_salt_labels_are_hashed_and_bounded():
    c = SaltCounters(max_labels=3)
    for i in range(10):
        c.add(f"user-{i}@example.com", "cached_tokens_total", 1)
    c.add(None, "prompt_tokens_total", 5)
    snap = c.snapshot({"user-0@example.com": 7})
    assert len(snap) == 4 and snap[OTHER]["cached_tokens_total"] == 7
    assert all("example" not in label for label in snap)  # the salt itself is never exported
    assert snap[c.label("user-0@example.com")]["kv_cached_tokens"] == 7
    assert snap[c.label(None)]["prompt_tokens_total"] == 5 and c.label(None) == OTHER  # (the cap was reached)
