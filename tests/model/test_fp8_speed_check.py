"""The start-up FP8 speed check (model/fp8_speed_check.py): its decision on the CPU with the timings given, the
dequantized fallback computing what the FP8 weights computed, the config's names, and on a GPU the real timing
choosing bf16 when the FP8 layouts are bad."""

from __future__ import annotations

import json

import pytest
import torch

from prefixrt.config.engine_config import FP8_SPEED_CHECKS, EngineConfig
from prefixrt.hub.loader import load_model
from prefixrt.model import fp8_speed_check as check
from tests.helpers.checkpoints import save_tiny_checkpoint


def fp8_model(tmp_path):
    save_tiny_checkpoint("llama", tmp_path)
    return load_model(str(tmp_path), dtype=torch.float32, device="cpu", quantization="fp8")


def test_speed_check_names_match_the_config():
    assert FP8_SPEED_CHECKS == check.SPEED_CHECKS
    with pytest.raises(ValueError, match="fp8_speed_check"):
        EngineConfig(quantization="fp8", fp8_speed_check="always")


def test_no_check_off_the_gpu_or_when_off(tmp_path):
    model = fp8_model(tmp_path)
    n = len(check.fp8_modules(model))
    assert n == 4 * model.num_layers
    assert check.check_fp8_speed(model, torch.float32, "fallback") is None  # (CPU: nothing timed)
    assert check.check_fp8_speed(model, torch.float32, "off") is None
    assert len(check.fp8_modules(model)) == n
    with pytest.raises(ValueError, match="fp8 speed check"):
        check.check_fp8_speed(model, torch.float32, "sometimes")


@pytest.mark.parametrize("fp8_us,bf16_us,slower", [(100.0, 99.0, False), (103.0, 100.0, True), (50.0, 100.0, False)])
def test_decision_and_fallback(tmp_path, monkeypatch, fp8_us, bf16_us, slower):
    """With the timings given: FP8 within 2% of bf16 is kept; slower falls back to the dequantized weights, which
    compute exactly the FP8 weight-only product (the same values in the model's dtype); "error" refuses."""
    model = fp8_model(tmp_path)
    monkeypatch.setattr(check, "_on_gpu", lambda modules: True)
    monkeypatch.setattr(check, "time_fp8_linears", lambda model, dtype: check.SpeedCheck(fp8_us, bf16_us))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU")
    x = torch.randn(3, model.config.hidden_size)
    linear = check.fp8_modules(model)[0]
    before = linear(x)
    if slower:
        with pytest.raises(RuntimeError, match="slower than bf16"):
            check.check_fp8_speed(model, torch.float32, "error")
        assert check.fp8_modules(model)  # (refusing changes nothing)
    said = []
    result = check.check_fp8_speed(model, torch.float32, "fallback", said.append)
    assert result.fp8_slower == slower and len(said) == 1
    if slower:
        assert not check.fp8_modules(model) and linear.weight.dtype == torch.float32
        assert "serving them as torch.float32" in said[0]
        assert torch.allclose(linear(x), before, rtol=1e-5, atol=1e-6)
    else:
        assert len(check.fp8_modules(model)) == 4 * model.num_layers


@pytest.mark.gpu
def test_bad_fp8_table_falls_back_to_bf16_on_the_gpu(tmp_path, monkeypatch, tiny_tokenizer):
    """On a GPU: a model whose FP8 layouts are bad (one warp, 16 x 16 tiles, no pipelining, for every row count) is
    timed slower than bf16 and served as bf16 by an engine started with FP8 weights; "error" refuses to start."""
    from types import SimpleNamespace

    from prefixrt.kernels.gemv import GemvConfig

    from prefixrt.engine.engine import Engine
    from prefixrt.model import fp8_linear

    save_tiny_checkpoint("llama", tmp_path)  # (its config, widened below; the weights are dummies of that shape)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(hidden_size=2048, intermediate_size=8192, num_attention_heads=16, num_key_value_heads=8,
               head_dim=128, num_hidden_layers=2)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    bad = GemvConfig(16, 16, 1, 1, 1)
    monkeypatch.setattr(fp8_linear, "default_config", lambda rows, block_scales: bad)
    monkeypatch.setattr(fp8_linear, "_table_choice", lambda *a: None)
    resolved = SimpleNamespace(name="tiny-wide-llama", revision="test", extra_eos_token_ids=(), path=str(tmp_path))

    def engine(**kwargs):
        model = load_model(str(tmp_path), load_format="dummy", dtype=torch.bfloat16, device="cuda",
                           quantization="fp8")
        return Engine("tiny-wide-llama", _parts=(model, tiny_tokenizer, resolved), device="cuda",
                      quantization="fp8", kv_cache_tokens=4096, **kwargs)

    eng = engine()
    try:
        report = eng._built.startup["fp8_speed_check"]
        assert report["fp8_us"] > report["bf16_us"] and not report["served_as_fp8"]
        assert not check.fp8_modules(eng._built.model)
        assert len(eng.generate([1, 5, 6], {"max_new_tokens": 4, "temperature": 0}).token_ids) == 4
    finally:
        eng.shutdown()
    with pytest.raises(RuntimeError, match="slower than bf16"):
        engine(fp8_speed_check="error")
