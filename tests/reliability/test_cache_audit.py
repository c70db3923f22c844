"""Cache audit (cache_audit_rate): injected K/V corruption in one cached node is caught and logged with the
node; with no corruption, audits at rate 1.0 over eviction/retraction/chunked-prefill workloads on every
architecture find 0 mismatches and never change an output."""

from __future__ import annotations

import logging
import random
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.checkpoints import ARCH_NAMES

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture
def audit_engine(tiny_checkpoints, tiny_tokenizer):
    """Engines whose teardown does not insist on 0 mismatches (these tests corrupt the cache on purpose)."""
    from prefixrt.engine.engine import Engine
    from prefixrt.hub.loader import load_model

    engines = []

    def make(arch="llama", **kwargs):
        path, _ = tiny_checkpoints(arch)
        model = load_model(path, dtype="float32", device="cpu")
        resolved = SimpleNamespace(name=f"tiny-{arch}", revision="test", extra_eos_token_ids=(), path=str(path))
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("debug", True)
        kwargs.setdefault("kv_cache_tokens", 4096)
        eng = Engine(f"tiny-{arch}", _parts=(model, tiny_tokenizer, resolved), **kwargs)
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.wait_idle()
        s = eng.stats()
        assert s.kv_locked == 0 and s.kv_free + s.kv_evictable == s.kv_total, s  # audits unlocked their paths
        eng.check_integrity()
        eng.shutdown()


def _corrupt(eng, prompt: list[int], position: int, layer: int, which: str = "k", value=None) -> None:
    def go():
        kv = eng.core.kv
        slots = kv.cache.match_prefix(prompt, None).slots
        buf = (kv.pool.k_buffers if which == "k" else kv.pool.v_buffers)[layer]
        if value is None:
            buf[slots[position]] += 0.5 * buf[slots].abs().max()
        else:
            buf[slots[position]] = value
    eng._run_on_loop(go)


@pytest.mark.parametrize("page_size", [1, 16])
def test_injected_corruption_is_caught_and_logged_with_the_node(page_size, audit_engine, caplog):
    eng = audit_engine("qwen3", cache_audit_rate=1.0, page_size=page_size)
    rng = random.Random(1)
    prompt = [1] + [rng.randrange(3, 320) for _ in range(40)]
    eng.generate(prompt, {"max_new_tokens": 4, **GREEDY})
    eng.generate(prompt, {"max_new_tokens": 4, **GREEDY})  # a clean hit
    eng.wait_idle()
    s = eng.stats()
    assert s.cache_audits_total == 1 and s.cache_audit_mismatches_total == 0

    _corrupt(eng, prompt, position=21, layer=1, which="v")
    with caplog.at_level(logging.ERROR, logger="prefixrt"):
        eng.generate(prompt, {"max_new_tokens": 4, **GREEDY})
        eng.wait_idle()
    s = eng.stats()
    assert s.cache_audits_total == 2 and s.cache_audit_mismatches_total == 1
    if page_size == 1:  # what /metrics exports
        pytest.importorskip("prometheus_client")
        from prefixrt.engine.metrics import Metrics

        text = Metrics.for_engine(eng).render().decode()
        assert "prefixrt_cache_audit_mismatch_total 1.0" in text and "prefixrt_cache_audits_total 2.0" in text
    msgs = [r.getMessage() for r in caplog.records if "cache audit mismatch" in r.getMessage()]
    assert len(msgs) == 1 and "radix node #" in msgs[0] and "token 21 " in msgs[0] and "layer 1" in msgs[0]

    # A NaN in K (a read of a freed, poisoned slot would look like this) is caught too.
    _corrupt(eng, prompt, position=3, layer=0, which="k", value=float("nan"))
    eng.generate(prompt, {"max_new_tokens": 4, **GREEDY})
    eng.wait_idle()
    assert eng.stats().cache_audit_mismatches_total == 2


def test_audit_rate_samples_a_fraction_of_hits(audit_engine):
    eng = audit_engine("llama", cache_audit_rate=0.5)
    prompt = [1] + list(range(10, 40))
    eng.generate(prompt, {"max_new_tokens": 1, **GREEDY})
    _corrupt(eng, prompt, position=5, layer=0)
    for _ in range(40):
        eng.generate(prompt, {"max_new_tokens": 1, **GREEDY})
    eng.wait_idle()
    s = eng.stats()
    assert 8 <= s.cache_audits_total <= 32, s  # Binomial(40, 0.5); the engine's seeded RNG makes it fixed
    assert s.cache_audit_mismatches_total == s.cache_audits_total  # every audited hit read the corrupt slot


def test_audit_off_by_default(audit_engine):
    eng = audit_engine("llama")
    assert eng.core.auditor is None
    prompt = [1] + list(range(10, 40))
    for _ in range(2):
        eng.generate(prompt, {"max_new_tokens": 1, **GREEDY})
    assert eng.stats().cache_audits_total == 0


def _tree_workload(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    roots = [[1] + [rng.randrange(3, 320) for _ in range(rng.randint(20, 50))] for _ in range(5)]
    prompts = []
    for _ in range(n):
        p = list(rng.choice(roots))
        for _ in range(rng.randint(0, 3)):
            p = p[: rng.randint(1, len(p))] + [rng.randrange(3, 320) for _ in range(rng.randint(1, 10))]
        prompts.append(p[:70])
    return prompts


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_no_mismatch_at_rate_1_and_outputs_unchanged(arch, make_engine):
    """Every hit audited, through chunked prefill and eviction (small pool), page sizes 1 and 16: 0 mismatches (fp32 recompute within the relative tolerance), outputs equal an engine without
    audits. make_engine's teardown also checks 0 mismatches and a clean pool."""
    prompts = _tree_workload(48, seed=ARCH_NAMES.index(arch))
    params = {"max_new_tokens": 10, **GREEDY}
    ref = make_engine(arch, radix_cache=False)
    want = [c.token_ids for c in ref.generate(prompts, params)]
    for page_size in (1, 16):
        eng = make_engine(arch, page_size=page_size, kv_cache_tokens=320, chunked_prefill_tokens=16,
                          cache_audit_rate=1.0)
        outs = eng.generate(prompts, params)
        outs += [eng.generate(p, params) for p in prompts[:12]]  # one by one: more hits
        assert [c.token_ids for c in outs] == want + want[:12]
        eng.wait_idle()
        s = eng.stats()
        hits = sum(c.cached_tokens > 0 for c in outs)
        assert hits >= 5 and s.cache_audits_total == hits, (hits, s)  # every hit audited
        assert s.cache_audit_mismatches_total == 0, s
        assert s.evicted_tokens_total > 0, "the pool was meant to be small enough to evict"


def test_audit_tolerance_is_tight_for_fp32(make_engine):
    """The fp32 recompute of a hit agrees with the cached K/V far inside the tolerance (so the tolerance
    is not what hides corruption): compare directly with the auditor's own recompute."""
    from prefixrt.cache.allocator import pages_to_slots

    eng = make_engine("gemma3", chunked_prefill_tokens=7, cache_audit_rate=1.0)
    prompt = [1] + [random.Random(3).randrange(3, 320) for _ in range(60)]
    eng.generate(prompt, {"max_new_tokens": 3, **GREEDY})

    def worst():
        kv, auditor = eng.core.kv, eng.core.auditor
        slots = kv.cache.match_prefix(prompt, None).slots
        pages = kv.allocator.alloc(len(slots))
        row = kv.table.alloc_row()
        try:
            scratch = pages_to_slots(pages, 1)[: len(slots)]
            auditor.chunk_tokens = 64  # one chunk: other chunking than the cached copy (7)
            auditor._recompute(prompt[: len(slots)], scratch, row)
            err = 0.0
            for bufs in (kv.pool.k_buffers, kv.pool.v_buffers):
                for b in bufs:
                    a, f = b[torch.tensor(slots)], b[torch.tensor(scratch)]
                    err = max(err, float((a - f).abs().max() / f.abs().max()))
            return err
        finally:
            kv.table.free_row(row)
            kv.free_pages(pages)

    err = eng._run_on_loop(worst)
    assert err < eng.core.auditor.tolerance / 20, err
