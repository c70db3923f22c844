"""The disk tier of the KV cache (kv_disk_dir) end to end on a tiny checkpoint (CPU, fp32).

Oracle: the same greedy requests on an engine that reuses nothing. A restarted engine on the same directory must
report a previously seen prefix cached on its first request and produce the same tokens; a damaged file
(flipped bytes, truncated), a file whose token ids differ from the request's under a forced hash collision, a
different model revision and a different cache_salt must never be used (outputs equal the oracle, the tokens
are recomputed)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from tests.helpers.engines import assert_idle_and_clean

GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 4}


@pytest.fixture
def engines(tiny_checkpoints, tiny_tokenizer):
    """engines(revision="test", **kw) -> Engine on the tiny llama checkpoint; shut down (after the idle and
    accounting checks) by the test or at teardown."""
    from prefixrt.engine.engine import Engine
    from prefixrt.hub.loader import load_model

    made = []

    def make(revision: str = "test", **kw):
        path, _ = tiny_checkpoints("llama")
        model = load_model(path, dtype="float32", device="cpu")
        resolved = SimpleNamespace(name="tiny-llama", revision=revision, extra_eos_token_ids=(), path=str(path))
        kw.setdefault("device", "cpu")
        kw.setdefault("debug", True)
        eng = Engine("tiny-llama", _parts=(model, tiny_tokenizer, resolved), **kw)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        if not eng._stopped:
            assert_idle_and_clean(eng)
            eng.shutdown()


def close(eng) -> None:
    assert_idle_and_clean(eng)
    eng.shutdown()


def _prompts(seed: int, n: int = 4, length: int = 40):
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 320) for _ in range(length)] for _ in range(n)]


def _disk(tmp_path, **kw):
    return {"kv_cache_tokens": 96, "host_kv_cache_tokens": 64, "kv_disk_dir": str(tmp_path / "kv"),
            "chunked_prefill_tokens": 32, **kw}


def _reference(engines, prompts, **kw):
    ref = engines(radix_cache=False, kv_cache_tokens=1024, **kw)
    return [c.token_ids for c in ref.generate(prompts, GREEDY)]


@pytest.mark.parametrize("policy, page_size, kv_dtype", [("write_through", 1, "auto"), ("write_back", 1, "auto"),
                                                         ("write_back", 16, "auto"), ("write_back", 1, "fp8_e4m3")])
def test_restart_comes_up_warm_and_equals_no_disk_run(policy, page_size, kv_dtype, engines, tmp_path):
    """(fp8_e4m3: the e4m3 bytes go to disk and come back as they are, under the same calibrated scales.)"""
    prefixes = _prompts(1)
    suffix = [7, 8, 9]
    want = _reference(engines, [p + suffix for p in prefixes] + prefixes + [p + [10, 11] for p in prefixes],
                      kv_cache_dtype=kv_dtype)
    # Race mode: every copy delayed, freed slots poisoned (debug), so a lifetime mistake changes the output.
    race = {"host_kv_debug_delay_s": 0.0005, "page_size": page_size, "kv_cache_dtype": kv_dtype}
    hit = 41 // page_size * page_size
    eng = engines(host_kv_write_policy=policy, **race, **_disk(tmp_path))
    # One by one: each 41-token prompt pushes the earlier ones out of the 96-token pool and the 64-token host
    # tier, so they reach the disk during the run; the second pass reads them back through host and pool.
    got = [eng.generate(p, GREEDY).token_ids for p in prefixes]
    assert got == want[4:8]
    again = [eng.generate(p + suffix, GREEDY) for p in prefixes]
    assert [c.token_ids for c in again] == want[:4]
    s = eng.stats()
    assert s.disk_write_bytes_total > 0 and s.disk_hit_tokens_total > 0, s
    assert all(c.cached_tokens == hit for c in again[:2]), [c.cached_tokens for c in again]
    close(eng)  # writes what the disk lacks

    eng = engines(host_kv_write_policy=policy, **race, **_disk(tmp_path))
    assert eng.stats().kv_disk_files > 0
    first = [eng.generate(p + [10, 11], GREEDY) for p in prefixes]
    assert [c.cached_tokens for c in first] == [hit] * 4  # every prefix warm on its first request
    assert [c.token_ids for c in first] == want[8:]
    s = eng.stats()
    assert s.disk_hit_tokens_total >= 4 * (hit - page_size) and s.cached_tokens_total == 4 * hit  # (token 1 is shared)
    assert s.disk_load_bytes_total > 0 and s.disk_rejected_files_total == 0


def _segments(tmp_path) -> dict[tuple[int, int], list]:
    """(start, end) -> files holding that segment, from the files' own headers."""
    import json
    import struct

    out: dict[tuple[int, int], list] = {}
    for f in sorted((tmp_path / "kv").glob("*.kv")):
        raw = f.read_bytes()
        (hlen,) = struct.unpack("<I", raw[8:12])
        hdr = json.loads(raw[12:12 + hlen])
        out.setdefault((hdr["start"], hdr["end"]), []).append(f)
    return out


def test_damaged_files_are_detected_and_recomputed(engines, tmp_path):
    prefixes = _prompts(2, n=3)
    want = _reference(engines, [p + [5] for p in prefixes])
    kw = _disk(tmp_path, kv_cache_tokens=256, host_kv_cache_tokens=256, chunked_prefill_tokens=256)
    eng = engines(**kw)
    for p in prefixes:
        eng.generate(p, GREEDY)
    close(eng)
    bodies = _segments(tmp_path)[(1, 41)]  # the tree: [1] shared, then each prompt's 40 tokens, then outputs
    assert len(bodies) == 3
    flipped, truncated, intact = bodies
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the K/V
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:-100])

    eng = engines(**kw)
    assert eng.stats().disk_rejected_files_total == 1  # the truncated file, at the start-up scan
    got = [eng.generate(p + [5], GREEDY) for p in prefixes]
    assert [c.token_ids for c in got] == want
    # Exactly one prompt's 40-token body was intact: it is a disk hit; the other two reuse only token 1.
    assert sorted(c.cached_tokens for c in got) == [1, 1, 41], [c.cached_tokens for c in got]
    s = eng.stats()
    assert s.disk_rejected_files_total == 2, s  # + the flipped file, at its read
    assert not flipped.exists() and not truncated.exists() and intact.exists()


def test_token_mismatch_under_forced_hash_collision_is_never_used(engines, tmp_path, monkeypatch):
    """Every key hashes alike: a lookup then finds segments of other prefixes, and only the stored token ids
    tell them apart. X + Y is on disk as two segments (X, Y); a request X' + Y (X' = X with one token changed)
    whose X' is in the tree must not reuse Y's K/V, which was computed after X."""
    from prefixrt.cache import disk_store

    rng = random.Random(3)
    x = [1] + [rng.randrange(3, 320) for _ in range(23)]
    y, z = [rng.randrange(3, 320) for _ in range(16)], [rng.randrange(3, 320) for _ in range(16)]
    x2 = list(x)
    x2[12] = (x2[12] + 1) % 317 + 3
    w = [rng.randrange(3, 320) for _ in range(8)]
    want = _reference(engines, [x2 + w, x2 + y + [5]])
    eng = engines(**_disk(tmp_path, kv_cache_tokens=256, host_kv_cache_tokens=256))
    eng.generate([x + y, x + z], GREEDY)  # the tree splits after X: segments X, X+Y.., X+Z..
    close(eng)

    monkeypatch.setattr(disk_store, "_digest", lambda h: "0" * 32)
    eng = engines(**_disk(tmp_path, kv_cache_tokens=256, host_kv_cache_tokens=256))
    first = eng.generate(x2 + w, GREEDY)  # X' enters the tree (the disk gives X's first 12 tokens: they match)
    got = eng.generate(x2 + y + [5], GREEDY)
    assert [first.token_ids, got.token_ids] == want
    assert got.cached_tokens <= len(x2) + len(w), got.cached_tokens  # nothing of Y's file
    assert eng.stats().disk_rejected_files_total >= 1


def test_other_model_revision_or_cache_salt_never_hits(engines, tmp_path, monkeypatch):
    """Even with every key hashing alike (so only the files' headers tell them apart)."""
    from prefixrt.cache import disk_store

    prompts = _prompts(4, n=2)
    want = _reference(engines, [p + [5] for p in prompts])
    eng = engines(**_disk(tmp_path))
    for p in prompts:
        eng.generate(p, GREEDY)
    close(eng)
    monkeypatch.setattr(disk_store, "_digest", lambda h: "0" * 32)
    other = engines(revision="test-2", **_disk(tmp_path))
    assert other.stats().kv_disk_files == 0  # another revision's files are not indexed
    got = [other.generate(p + [5], GREEDY) for p in prompts]
    assert [c.token_ids for c in got] == want
    assert [c.cached_tokens for c in got] == [0, 1]  # (the second shares token 1 with the first, in the tree)
    assert other.stats().disk_hit_tokens_total == 0
    close(other)
    salted = engines(**_disk(tmp_path))
    got = [salted.generate(p + [5], {"cache_salt": "tenant-b", **GREEDY}) for p in prompts]
    assert [c.token_ids for c in got] == want and [c.cached_tokens for c in got] == [0, 1]
    assert salted.stats().disk_hit_tokens_total == 0


def test_metrics_per_salt_and_disk_tier_agree_with_stats(engines, tmp_path):
    """/metrics (prometheus-client) and stats(): per-salt hit, prompt and evicted tokens under hashed labels
    (the salt never appears), and the disk tier's counters, against the completions' own cached_tokens."""
    from prometheus_client.parser import text_string_to_metric_families

    from prefixrt.engine.metrics import Metrics

    eng = engines(**_disk(tmp_path))
    prompts = _prompts(5, n=3)
    hits = {"alice@example.com": 0, None: 0}
    for rnd in range(2):  # the second round hits (pool, host or disk: the pool holds about two prompts)
        for p in prompts:
            for salt in hits:
                c = eng.generate(p + [rnd + 3], {"cache_salt": salt, **GREEDY} if salt else GREEDY)
                hits[salt] += c.cached_tokens
    s = eng.stats()
    text = Metrics.for_engine(eng).render().decode()
    assert "alice" not in text
    series = {(m.name, tuple(sorted(x.labels.items()))): x.value
              for fam in text_string_to_metric_families(text) for x in fam.samples for m in [x]}
    labels = {salt: eng.core.kv.salts.label(salt) for salt in hits}
    assert set(s.salts) == set(labels.values())
    for salt, label in labels.items():
        key = (("salt", label),)
        assert series[("prefixrt_salt_hit_tokens_total", key)] == s.salts[label]["cached_tokens_total"] == hits[salt]
        assert series[("prefixrt_salt_prompt_tokens_total", key)] == 3 * (2 * 42)
        assert series[("prefixrt_salt_evicted_tokens_total", key)] == s.salts[label]["evicted_tokens_total"] > 0
        assert series[("prefixrt_salt_cached_tokens", key)] == s.salts[label]["kv_cached_tokens"]
    assert sum(hits.values()) == s.cached_tokens_total > 0
    assert sum(c["evicted_tokens_total"] for c in s.salts.values()) == s.evicted_tokens_total
    for fld in ("disk_hit_tokens_total", "disk_write_bytes_total", "disk_load_bytes_total"):
        assert series[(f"prefixrt_{fld}", ())] == getattr(s, fld) > 0, fld
    assert series[("prefixrt_kv_disk_used_bytes", ())] == s.kv_disk_used_bytes > 0
    assert series[("prefixrt_kv_disk_files", ())] == s.kv_disk_files > 0
    eng.flush_cache()  # every tier, the disk's files included
    assert eng.stats().kv_disk_files == 0 and not list((tmp_path / "kv").glob("*.kv"))


def test_requests_sharing_a_disk_prefix_read_it_once(engines, tmp_path, monkeypatch):
    """After a restart, requests arriving together with the same prefix on disk: one read, every one a hit. (Reads
    are slowed down, so every request is waiting while the first read is in flight.)"""
    import time

    from prefixrt.cache.disk_store import DiskKVStore

    read = DiskKVStore._read_segment
    monkeypatch.setattr(DiskKVStore, "_read_segment", lambda self, *a: (time.sleep(0.1), read(self, *a))[1])
    prefix = _prompts(6, n=1)[0]
    tails = [[3 + i, 4 + i] for i in range(4)]
    want = _reference(engines, [prefix + t for t in tails] + [prefix + [9, 9]])
    kw = _disk(tmp_path, kv_cache_tokens=256, host_kv_cache_tokens=256)
    eng = engines(**kw)
    eng.generate(prefix, GREEDY)
    close(eng)
    eng = engines(**kw)
    got = eng.generate([prefix + t for t in tails], GREEDY)
    assert [c.token_ids for c in got] == want[:4] and [c.cached_tokens for c in got] == [41] * 4
    s = eng.stats()
    prefix_files = [f for (_, end), files in _segments(tmp_path).items() if end <= 41 for f in files]
    assert s.disk_hit_tokens_total == 41
    assert s.disk_load_bytes_total == sum(f.stat().st_size for f in prefix_files)  # each file read once
    close(eng)
    # Aborted while its read is in flight: nothing leaks (the teardown checks), and the next request still hits.
    eng = engines(**kw)
    it = eng.stream(prefix + [9, 9], {"request_id": "gone", **GREEDY})
    time.sleep(0.03)
    eng.abort("gone")
    assert [c.finish_reason for c in it][-1] == "abort"
    c = eng.generate(prefix + [9, 9], GREEDY)
    assert c.cached_tokens == 41 and c.token_ids == want[4]
