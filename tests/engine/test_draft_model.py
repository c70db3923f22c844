"""The draft-model drafter (speculative="draft:MODEL", engine/loop/draft_model.py): greedy outputs token-identical
to no speculation (stop strings, constrained requests, n > 1, logprobs with penalties, aborts, eviction and
retraction under a small pool, prefix cache hits), the target as its own draft is accepted everywhere (its K/V
in the draft pool is right, cached prefixes included), a cache hit spares the draft the prefix, and a draft of
another vocabulary is refused."""

from __future__ import annotations

import copy
import random

import pytest

from tests.engine.test_engine import _tree_workload
from tests.engine.test_overlap import _logprobs, _summary
from tests.engine.test_speculative import GREEDY, _params, _repetitive, _run


@pytest.fixture(scope="module")
def draft_folders(tmp_path_factory):
    """name -> checkpoint folder of a draft for the tiny llama: "skip" keeps the target's embeddings, head and
    first layer (a layer-skip draft of the same vocabulary, often right), "vocab" is a tiny llama of 384 ids."""
    from tests.helpers.checkpoints import build_hf_model

    target = build_hf_model("llama")
    skip = copy.deepcopy(target)
    skip.model.layers = skip.model.layers[:1]
    skip.config.num_hidden_layers = 1
    if getattr(skip.config, "layer_types", None):
        skip.config.layer_types = skip.config.layer_types[:1]
    folders = {"skip": tmp_path_factory.mktemp("draft-skip"), "vocab": tmp_path_factory.mktemp("draft-vocab")}
    skip.save_pretrained(str(folders["skip"]))
    build_hf_model("llama", seed=3, vocab_size=384).save_pretrained(str(folders["vocab"]))
    return folders


def _acceptance(eng) -> float:
    s = eng.stats()
    return s.spec_accepted_tokens_total / max(1, s.spec_draft_tokens_total)


@pytest.mark.parametrize("draft", ["self", "skip"])
def test_greedy_outputs_identical_to_no_speculation(draft, make_engine, tiny_checkpoints, draft_folders,
                                                    underestimated_decode):
    folder = tiny_checkpoints("llama")[0] if draft == "self" else draft_folders["skip"]
    prompts = _repetitive([p[:40] for p in _tree_workload(70, seed=5)])
    aborts = set(range(6, 70, 13))
    small = dict(kv_cache_tokens=240, chunked_prefill_tokens=16)
    want = _run(make_engine("llama", **small), prompts, aborts)
    eng = make_engine("llama", speculative=f"draft:{folder}", **small)
    got = _run(eng, prompts, aborts)
    s = eng.stats()
    assert s.evicted_tokens_total > 0 and s.cached_tokens_total > 0  # the small pool evicted, its cache hit
    assert s.spec_accepted_tokens_total > 30 and s.spec_tokens_per_forward > (1.5 if draft == "self" else 1.05)
    for i in range(len(prompts)):
        if i in aborts:
            continue
        assert _summary(got[i]) == _summary(want[i]), (i, _params(i))
        assert _logprobs(got[i]) == pytest.approx(_logprobs(want[i]), abs=1e-4)
    assert any(c.finish_reason == "stop" and c.matched_stop in ("e", "th") for c in want if not isinstance(c, list))


@pytest.mark.parametrize("page_size", [1, 4])
def test_target_as_its_own_draft_is_accepted_everywhere(page_size, make_engine, tiny_checkpoints):
    """The target drafting for itself: every greedy draft is the target's own argmax, so acceptance is 1.0 unless
    the draft pool's K/V is wrong somewhere (at a chunk border, a cached prefix, an accepted or a bonus slot;
    whole pages or single slots)."""
    folder = tiny_checkpoints("llama")[0]
    rng = random.Random(7)
    prompts = [[1] + [rng.randrange(3, 320) for _ in range(40)] for _ in range(12)]
    params = {"max_new_tokens": 24, **GREEDY}
    again = [p + [7, 8] for p in prompts]  # cache hits on the first round's prompts
    ref = make_engine("llama")
    want = [[c.token_ids for c in ref.generate(ps, params)] for ps in (prompts, again)]
    eng = make_engine("llama", speculative=f"draft:{folder}", chunked_prefill_tokens=16, speculative_adaptive=False,
                      page_size=page_size)
    assert [[c.token_ids for c in eng.generate(ps, params)] for ps in (prompts, again)] == want
    s = eng.stats()
    assert s.cached_tokens_total > 400 and s.spec_draft_tokens_total > 200
    assert _acceptance(eng) >= 0.99, (s.spec_accepted_tokens_total, s.spec_draft_tokens_total)


def test_cache_hit_spares_the_draft_the_prefix(make_engine, tiny_checkpoints):
    """A second prompt sharing a cached prefix: the draft model runs only the tokens the target runs (not the
    prefix), and its drafts over that prefix are still all accepted (the cached slots hold its K/V)."""
    folder = tiny_checkpoints("llama")[0]
    prefix = [1] + list(range(30, 90))
    eng = make_engine("llama", speculative=f"draft:{folder}", speculative_adaptive=False)
    drafter = eng.core.spec.drafter
    eng.generate(prefix + [5, 6, 7], {"max_new_tokens": 1, **GREEDY})
    assert drafter.mirrored_tokens == len(prefix) + 3
    before = drafter.mirrored_tokens
    second = prefix + [9, 10, 11, 12]
    out = eng.generate(second, {"max_new_tokens": 1, **GREEDY})
    assert out.cached_tokens >= len(prefix)
    assert drafter.mirrored_tokens - before == len(second) - out.cached_tokens < 10
    params = {"max_new_tokens": 16, **GREEDY}
    third = prefix + [13, 14]
    assert eng.generate(third, params).token_ids == make_engine("llama").generate(third, params).token_ids
    assert eng.stats().spec_draft_tokens_total > 10 and _acceptance(eng) >= 0.99


def test_draft_of_another_vocabulary_is_refused(make_engine, draft_folders):
    with pytest.raises(ValueError, match="vocabulary"):
        make_engine("llama", speculative=f"draft:{draft_folders['vocab']}")
    with pytest.raises(ValueError, match="host_kv_cache_tokens"):
        make_engine("llama", speculative=f"draft:{draft_folders['skip']}", host_kv_cache_tokens=2048)
    from prefixrt.disagg.decode import DecodeEngine

    with pytest.raises(ValueError, match="decode engine"):
        DecodeEngine("tiny-llama", speculative=f"draft:{draft_folders['skip']}")
