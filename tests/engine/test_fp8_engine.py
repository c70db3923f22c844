"""Engines with FP8 weights (`quantization="fp8"`) and an FP8 K/V cache (`kv_cache_dtype="fp8_e4m3"`) on tiny
checkpoints (CPU, torch attention): radix reuse stays exact relative to the FP8 cache (greedy with the cache on equals
the cache off, page sizes 1 and 16, every hit audited), the pool is e4m3 with calibrated scales, half the bytes of a
token, and the options are checked."""

from __future__ import annotations

import pytest
import torch
from prefixrt.kernels.fp8_reference import ACTIVATION_SCALES

from prefixrt.cache.kv_pool import KVPool
from prefixrt.config.engine_config import FP8_ACTIVATION_SCALES, EngineConfig
from tests.engine.test_oracle import _prompts

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("arch,page_size", [("llama", 1), ("gemma3", 16)])
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_fp8_kv_cache_on_equals_cache_off(arch, page_size, quantization, make_engine):
    prompts = _prompts(2)
    outs = {}
    for radix in (True, False):
        eng = make_engine(arch, kv_cache_dtype="fp8_e4m3", quantization=quantization, page_size=page_size,
                          radix_cache=radix, chunked_prefill_tokens=16, cache_audit_rate=1.0 if radix else 0.0)
        pool = eng.core.kv.pool
        assert pool.dtype == torch.float8_e4m3fn and pool.scales_source == "calibrated"
        seq = [eng.generate(p, GREEDY) for p in prompts]  # later prompts hit what earlier ones cached
        outs[radix] = [c.token_ids for c in seq]
        if radix:
            assert seq[-1].cached_tokens >= (len(prompts[-1]) - 1) // page_size * page_size
            assert sum(c.cached_tokens > 0 for c in seq) >= 3
        assert [c.token_ids for c in eng.generate(prompts, GREEDY)] == outs[radix]  # batched, from the cache
    assert outs[True] == outs[False]  # (teardown: every audited hit matched its recomputation)


def test_fp8_engines_start_with_the_same_scales(make_engine):
    """The calibration is deterministic: a restarted engine quantizes a prefix to the same bytes."""
    a, b = (make_engine("qwen3", kv_cache_dtype="fp8_e4m3") for _ in range(2))
    pa, pb = a.core.kv.pool, b.core.kv.pool
    assert torch.equal(pa.k_scales, pb.k_scales) and torch.equal(pa.v_scales, pb.v_scales)
    assert pa.scales_digest() == pb.scales_digest() != ""
    assert a.generate([1, 9, 8, 7, 6], GREEDY).token_ids == b.generate([1, 9, 8, 7, 6], GREEDY).token_ids


def test_fp8_weights_engine_quantizes_decoder_linears(make_engine):
    eng = make_engine("llama", quantization="fp8")
    model = eng._built.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale.shape == (qkv.out_features,)
    assert model.lm_head.weight.dtype == torch.float32 and model.lm_head.weight_scale is None
    assert len(eng.generate([1, 5, 6], GREEDY).token_ids) == GREEDY["max_new_tokens"]
    assert {m.fp8_activation_scale for m in model.modules() if getattr(m, "weight_scale", None) is not None} == {"token"}


def test_fp8_engine_smooths_before_quantizing(make_engine, tiny_checkpoints, tiny_tokenizer):
    """quantization="fp8" smooths the float model's linear inputs first (fp8_smoothing, model/smoothing.py): the
    engine's weights are those of smoothing on the calibration text's token ids, then quantizing; fp8_smoothing=0
    quantizes the float weights as they are; the disk tier's K/V identity tells the two apart."""
    from types import SimpleNamespace

    from prefixrt.engine.builder import kv_identity
    from prefixrt.hub.loader import load_model
    from prefixrt.model.kv_calibration import calibration_tokens
    from prefixrt.model.quantize import quantize_fp8_weights
    from prefixrt.model.smoothing import smooth_fp8_inputs

    alpha = EngineConfig.fp8_smoothing
    assert alpha, "smoothing is on by default"
    smoothed = make_engine("llama", quantization="fp8")
    plain = make_engine("llama", quantization="fp8", fp8_smoothing=0)
    by_hand = load_model(tiny_checkpoints("llama")[0], dtype="float32", device="cpu")
    smooth_fp8_inputs(by_hand, alpha, calibration_tokens(tiny_tokenizer))
    quantize_fp8_weights(by_hand)
    want = by_hand.state_dict()
    for name, t in smoothed._built.model.state_dict().items():
        assert torch.equal(t.float(), want[name].float()), name
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert not torch.equal(plain._built.model.state_dict()[qkv].float(), want[qkv].float())
    for eng in (smoothed, plain):
        assert len(eng.generate([1, 5, 6], GREEDY).token_ids) == GREEDY["max_new_tokens"]
    resolved = SimpleNamespace(revision="test", path="")
    identities = {kv_identity(EngineConfig(quantization="fp8", fp8_smoothing=a), resolved, smoothed.core.kv.pool)
                  for a in (alpha, 0, None, 0.25)}
    assert len(identities) == 3  # (0 and None are both off)


def test_fp8_activation_scale_reaches_the_linears(make_engine):
    """fp8_activation_scale="token" reaches every FP8 linear of an engine, and a linear computes the scheme it holds
    for inputs taller than WEIGHT_ONLY_MAX_ROWS (per-token, per-group and weight-only references differ on K = 256:
    four groups of 64, an outlier in the first), and weight-only for a decode-sized input whatever the scheme."""
    from prefixrt.kernels import fp8_reference
    from torch import nn

    from prefixrt.model.layers import Linear

    eng = make_engine("llama", quantization="fp8", fp8_activation_scale="token")
    fp8 = [m for m in eng._built.model.modules() if isinstance(m, Linear) and m.weight_scale is not None]
    assert fp8 and {m.fp8_activation_scale for m in fp8} == {"token"}
    assert len(eng.generate([1, 5, 6], GREEDY).token_ids) == GREEDY["max_new_tokens"]

    linear = Linear(256, 16, bias=False)
    w_q, w_scale = fp8_reference.quantize_weight(torch.randn(16, 256))
    linear.weight, linear.weight_scale = nn.Parameter(w_q, requires_grad=False), nn.Parameter(w_scale)
    from prefixrt.model.fp8_linear import WEIGHT_ONLY_MAX_ROWS

    x = torch.randn(WEIGHT_ONLY_MAX_ROWS + 3, 256)
    x[:, 7] *= 1e4  # an outlier in the first group
    schemes = ("none", "group", "token")
    for scheme in schemes:
        linear.fp8_activation_scale = scheme
        assert torch.equal(linear(x), fp8_reference.fp8_linear(x, w_q, w_scale, None, scheme))
        for other in set(schemes) - {scheme}:
            assert not torch.equal(linear(x), fp8_reference.fp8_linear(x, w_q, w_scale, None, other))
        small = x[:WEIGHT_ONLY_MAX_ROWS]
        assert torch.equal(linear(small), fp8_reference.weight_only_linear(small, w_q, w_scale))


def test_fp8_pool_holds_twice_the_tokens_of_bf16(monkeypatch):
    """At the same mem_fraction of a (pretend) 141 GB GPU holding 16 GB of weights, the pool sizing gives an e4m3 pool
    twice the tokens of a bf16 one (Llama-3-8B's K/V shape; Gemma-3-270M's)."""
    from prefixrt.cache.kv_setup import pool_slots

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (125 * gib, 141 * gib))
    config = EngineConfig(kv_cache_dtype="fp8_e4m3", page_size=16)
    for layers, heads, dim in ((32, 8, 128), (18, 1, 256)):
        bf16 = KVPool.bytes_per_token(layers, heads, dim, torch.bfloat16)
        fp8 = KVPool.bytes_per_token(layers, heads, dim, torch.float8_e4m3fn)
        assert bf16 == 2 * fp8
        slots = {b: pool_slots(config, b, torch.device("cuda")) for b in (bf16, fp8)}
        assert abs(slots[fp8] / slots[bf16] - 2) < 1e-3


def test_fp8_options_are_checked():
    EngineConfig(quantization="fp8", kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="fp8_activation_scale"):
        EngineConfig(quantization="fp8", fp8_activation_scale="tensor")
    for alpha in (-0.1, 1.5, "0.5", True):
        with pytest.raises(ValueError, match="fp8_smoothing"):
            EngineConfig(quantization="fp8", fp8_smoothing=alpha)
    assert [EngineConfig(fp8_smoothing=a).fp8_smoothing_alpha for a in (None, 0, 0.0, 1, 0.25)] == [
        None, None, None, 1.0, 0.25]
    # the config's names are the kernels' scheme names (config/ cannot import kernels/)
    assert FP8_ACTIVATION_SCALES == ACTIVATION_SCALES
    with pytest.raises(ValueError, match="tp_size"):
        EngineConfig(kv_cache_dtype="fp8_e4m3", tp_size=2)


def test_fp8_command_line_flags():
    import argparse

    from prefixrt.config.flags import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    kw = engine_kwargs(p.parse_args(["--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3",
                                     "--fp8-activation-scale", "group", "--fp8-smoothing", "0.25"]))
    assert kw["quantization"] == "fp8" and kw["kv_cache_dtype"] == "fp8_e4m3" and kw["fp8_activation_scale"] == "group"
    assert kw["fp8_smoothing"] == 0.25 and EngineConfig(**kw).fp8_smoothing_alpha == 0.25
    assert EngineConfig(**engine_kwargs(p.parse_args(["--fp8-smoothing", "0"]))).fp8_smoothing_alpha is None
    kw = engine_kwargs(p.parse_args([]))
    assert kw["quantization"] is None and kw["kv_cache_dtype"] == "auto"
    # the flags' defaults are the config's
    assert (kw["fp8_activation_scale"], kw["fp8_smoothing"]) == (EngineConfig.fp8_activation_scale,
                                                                 EngineConfig.fp8_smoothing)
    EngineConfig(**{k: v for k, v in kw.items()})  # the defaults are valid options
    with pytest.raises(ValueError, match="fp8_smoothing"):
        EngineConfig(**engine_kwargs(p.parse_args(["--fp8-smoothing", "2"])))


def test_fp8_host_tier_stores_e4m3_as_is(make_engine):
    """A small FP8 pool with a host tier: evicted prefixes go to the host as their e4m3 bytes (one byte a value, no
    conversion) and load back to the same outputs as an engine that keeps everything in its pool and reuses nothing."""
    from tests.engine.test_engine import _tree_workload

    prompts = _tree_workload(40, seed=3)
    params = {"max_new_tokens": 8, **GREEDY}
    ref = make_engine("llama", kv_cache_dtype="fp8_e4m3", radix_cache=False, kv_cache_tokens=8192)
    want = [c.token_ids for c in ref.generate(prompts, params)]
    eng = make_engine("llama", kv_cache_dtype="fp8_e4m3", kv_cache_tokens=192, host_kv_cache_tokens=4096,
                      host_kv_write_policy="write_through", host_kv_write_threshold=1, chunked_prefill_tokens=16)
    pool, host = eng.core.kv.pool, eng.core.kv.cache.host
    assert host.dtype == pool.dtype == torch.float8_e4m3fn
    assert host.bytes_per_token == KVPool.bytes_per_token(pool.num_layers, pool.num_kv_heads, pool.head_dim,
                                                          torch.float8_e4m3fn)
    assert [c.token_ids for c in eng.generate(prompts, params)] == want
    assert [eng.generate(p, params).token_ids for p in prompts[:20]] == want[:20]
    s = eng.stats()
    assert s.host_hit_tokens_total > 0 and s.host_load_bytes_total > 0
    eng.check_integrity()
