"""Engine.probes (engine/probes.py): what benchmarks observe and switch. Each instrument sees what the loop did
(its calls, its forwards, the batch compositions), leaves the engine's code as it found it on exit, and changes
no output; the switches change the loop and leave greedy outputs alone; bad arguments are refused."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from prefixrt.engine.probes import LOOP_UNITS

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def _prompts(n: int, length: int = 12, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (n, length), generator=g).tolist()


def _unwrapped(eng) -> bool:
    """No instrument left behind: the loop's units, the runner's forward and the masks are the classes' again."""
    core = eng.core
    return not (set(LOOP_UNITS + ("step", "flush_outputs")) & set(core.__dict__)) \
        and "forward" not in core.runner.__dict__ and not ({"fill_rows", "finish"} & set(core.masks.__dict__))


def test_time_units_and_log_forwards_see_every_step_and_change_nothing(make_engine):
    eng = make_engine("llama", overlap_schedule=True)
    prompts = _prompts(4)
    ref = [c.token_ids for c in eng.generate(prompts, GREEDY)]
    eng.flush_cache()
    passes0, counts0 = eng.stats().forward_passes_total, eng.probes.forward_counts()
    with eng.probes.time_units(record_calls=True) as units, eng.probes.log_forwards() as forwards:
        got = [c.token_ids for c in eng.generate(prompts, GREEDY)]
    passes = eng.stats().forward_passes_total - passes0
    assert got == ref
    assert _unwrapped(eng)
    assert len(forwards.rows) == passes == units.calls["launch"] > 0
    assert {r["kind"] for r in forwards.rows} == {"eager"}  # CPU: no graphs
    assert eng.probes.forward_counts()["eager"] - counts0["eager"] == passes
    assert forwards.rows[0]["tokens"] == 4 * 12 and forwards.rows[0]["seqs"] == 4  # the prefill: every prompt
    assert all(r["tokens"] == 4 for r in forwards.rows[1:])  # then one token a row
    assert all(r["device_ms"] is None for r in forwards.rows)
    assert [r["wall_ms"] is None for r in forwards.rows].count(True) == 1
    assert sum(g["count"] for g in forwards.summary()) == passes
    # the records: one per call, in order, with the batch each call ran
    assert len(units.records) == sum(units.calls.values())
    assert all(units.seconds[u] > 0 for u in ("schedule", "build", "launch", "process"))
    builds = [r for r in units.records if r["unit"] == "build"]
    assert (builds[0]["extend_rows"], builds[0]["decode_rows"]) == (4, 0)
    assert all((r["extend_rows"], r["decode_rows"]) == (0, 4) for r in builds[1:])
    assert all(r["start"] <= r["end"] for r in units.records)
    assert units.per_step_ms(passes)["host_ms"] > 0


def test_time_units_on_the_thread_clock_and_the_step(make_engine):
    eng = make_engine("llama")
    with eng.probes.time_units(("step", "process"), clock=time.thread_time, fence_wait=False) as units:
        eng.generate(_prompts(2), GREEDY)
    assert units.calls["step"] >= units.calls["process"] > 0 and "wait" not in units.seconds
    assert units.seconds["step"] >= units.seconds["process"] > 0
    assert _unwrapped(eng)
    with pytest.raises(ValueError, match="unknown units"):
        with eng.probes.time_units(("forward_pass",)):
            pass


def test_hold_loop_admits_requests_submitted_meanwhile_together(make_engine):
    eng = make_engine("llama", max_running_requests=8)
    prompts, out = _prompts(5, seed=1), []
    with eng.probes.time_units(("schedule",), fence_wait=False, record_calls=True) as units:
        with eng.probes.hold_loop() as held:
            callers = [threading.Thread(target=lambda p=p: out.append(eng.generate(p, GREEDY))) for p in prompts]
            for t in callers:
                t.start()
            assert held.wait_queued(len(prompts), timeout=30)
        for t in callers:
            t.join()
    assert len(out) == 5
    admitted = [r["extend_rows"] for r in units.records if r["extend_rows"]]
    assert admitted[0] == 5, admitted  # one step took all of them in


def test_switches_keep_greedy_outputs(make_engine):
    eng = make_engine("llama", overlap_schedule=True)
    prompts = _prompts(3, seed=2)
    ref = [c.token_ids for c in eng.generate(prompts, GREEDY)]
    eng.probes.set_overlap(False)
    eng.flush_cache()
    assert [c.token_ids for c in eng.generate(prompts, GREEDY)] == ref
    eng.probes.set_overlap(True)
    eng.probes.set_cuda_graphs(False)  # none captured on the CPU: nothing to switch, nothing breaks
    eng.probes.set_cuda_graphs(True)
    assert eng.probes.facts()["cuda_graphs"] is False
    with pytest.raises(ValueError, match="no cascade"):
        eng.probes.set_cascade(False)
    with pytest.raises(ValueError, match="no speculative"):
        eng.probes.set_draft_tokens(2)
    with pytest.raises(ValueError, match="no captured decode graph"):
        eng.probes.graph_replay_ms("decode", 1)
    with pytest.raises(ValueError):
        eng.probes.set_mask_parts(0)
    facts = eng.probes.facts()
    assert facts["device"] == "cpu" and facts["dtype"] == "torch.float32" and facts["cascade_built"] is False
    assert eng.probes.model.vocab_size == eng.vocab_size and eng.probes.drafter is None


def test_replace_forward_then_restore(make_engine):
    eng = make_engine("llama")
    prompts = _prompts(2, seed=3)
    ref = [c.token_ids for c in eng.generate(prompts, GREEDY)]
    vocab = eng.vocab_size

    def always_seven(fb):
        logits = torch.full((int(fb.logits_indices.shape[0]), vocab), -1e4)
        logits[:, 7] = 0.0
        return logits

    eng.probes.replace_forward(always_seven)
    assert [c.token_ids for c in eng.generate(prompts, GREEDY)] == [[7] * 6] * 2
    eng.probes.restore_forward()
    eng.flush_cache()
    assert [c.token_ids for c in eng.generate(prompts, GREEDY)] == ref
    assert _unwrapped(eng)


def test_time_forward_ms_on_an_idle_engine(make_engine):
    eng = make_engine("llama", kv_cache_tokens=2048)
    before = eng.probes.forward_counts()["eager"]
    assert eng.probes.time_forward_ms(2, 16, 1, iters=2) > 0
    assert eng.probes.time_forward_ms(2, 16, 5, iters=2) > 0  # verify-shaped rows
    assert eng.probes.forward_counts()["eager"] - before == 2 * (3 + 2)
    with pytest.raises(ValueError, match="do not fit the pool"):
        eng.probes.time_forward_ms(64, 1024, 1)


def test_speculative_draft_tokens_and_drafter(make_engine):
    eng = make_engine("llama", speculative="ngram", speculative_num_tokens=4, overlap_schedule=False)
    assert eng.probes.drafter is not None
    eng.probes.set_draft_tokens(2)
    with pytest.raises(ValueError, match=r"\[1, 4\]"):
        eng.probes.set_draft_tokens(5)
    prompts = _prompts(2, seed=4)
    eng.generate(prompts, GREEDY)


def test_time_masks_and_mask_threads(make_engine):
    eng = make_engine("llama")
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
              "additionalProperties": False}
    params = {"max_new_tokens": 16, "temperature": 0, "json_schema": schema}
    ref = [c.token_ids for c in eng.generate(_prompts(2, seed=5), params)]
    eng.probes.set_mask_threads(0)
    eng.flush_cache()
    with eng.probes.time_masks(clock=time.thread_time) as masks:
        got = [c.token_ids for c in eng.generate(_prompts(2, seed=5), params)]
    eng.probes.set_mask_threads(2)
    assert got == ref
    assert masks.fills > 0 and masks.rows > 0 and masks.fill_s > 0
    assert _unwrapped(eng)


def test_radix_insert_below_setting_keeps_outputs(make_engine):
    prompts = [p + [9, 9, 9] for p in _prompts(3, seed=6)]
    outs = {}
    for below in (True, False):
        eng = make_engine("llama", radix_insert_below=below)
        assert eng.core.kv.cache.supports_insert_below is below
        eng.generate(prompts, GREEDY)
        outs[below] = [(c.token_ids, c.cached_tokens) for c in eng.generate(prompts, GREEDY)]
    assert outs[True] == outs[False]


def test_profile_loop_sees_the_loop_thread(make_engine):
    import pstats

    eng = make_engine("llama")
    with eng.probes.profile_loop() as prof:
        eng.generate(_prompts(2, seed=7), GREEDY)
    functions = {f"{file}:{name}" for file, _, name in pstats.Stats(prof).stats}
    assert any(f.endswith("loop/core.py:schedule") for f in functions), sorted(functions)[:20]
    eng.probes.set_mask_parts(1)  # accepted: one fill once every row is post-processed
