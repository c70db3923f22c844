"""Pre-quantized FP8 checkpoints (hub/fp8_checkpoint.py), written here with transformers and safetensors into tmp:
compressed-tensors (per channel, per tensor, with K/V cache scales), transformers' fbgemm_fp8 and `fp8`
(FineGrainedFP8: per tensor and 128x128 blocks). Where a format says the same as quantize-at-load (per-channel scales),
the loaded model has the same bytes and gives the same logits; the others load the checkpoint's bytes and scales as
they are and compute what the reference (dequantize, multiply in fp32) computes; unsupported ones are clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from prefixrt.kernels import fp8_reference as ref

from prefixrt.hub.loader import load_model
from prefixrt.model.quantize import fp8_linears
from tests.helpers.checkpoints import build_hf_model
from tests.helpers.harness import PagedHarness

FP8 = torch.float8_e4m3fn
TOKENS = list(range(5, 29))
SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def logits_of(model) -> torch.Tensor:
    harness = PagedHarness(model)
    return harness.forward([(harness.new_row(), TOKENS)])[0]


# Logits of FP8 weights vs the float model on these tiny random checkpoints: e4m3 steps are 16x bf16's, and bf16
# weights alone move these logits by ~1% (up to ~19% measured for FP8; the real models' accuracy is
# tests/model/test_fp8_accuracy.py). A wrong scale layout or byte order is off by O(1).
FLOAT_TOLERANCE = 0.3


def rel_err(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def float_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def shard_tensors(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Checkpoint module name (q_proj, ..., down_proj) -> (its rows of the e4m3 weight, its per-channel scales)."""
    out = {}
    for name, module in fp8_linears(model).items():
        parent, leaf = name.rsplit(".", 1)
        if leaf in SHARDS:
            for shard in SHARDS[leaf]:
                offset, size = module.shard_slice(shard)
                out[f"{parent}.{shard}"] = (module.weight[offset : offset + size], module.weight_scale[offset : offset + size])
        else:
            out[name] = (module.weight, module.weight_scale)
    return out


def write_checkpoint(path: Path, src: Path, quantized: dict[str, tuple[torch.Tensor, torch.Tensor]],
                     quantization_config: dict, scale_name: str = "weight_scale",
                     extra: dict[str, torch.Tensor] | None = None) -> None:  # fmt: skip
    """A copy of the float checkpoint at src whose linears are replaced by (e4m3 weight, scale) pairs, with the
    quantization_config in config.json (what the quantizing tools write)."""
    from safetensors.torch import save_file

    path.mkdir()
    tensors = float_tensors(src)
    for module, (w_q, scale) in quantized.items():
        tensors[f"{module}.weight"] = w_q.contiguous()
        tensors[f"{module}.{scale_name}"] = scale.contiguous()
        tensors[f"{module}.input_scale"] = torch.ones(1)  # a static activation scale: not used (per token instead)
    tensors.update(extra or {})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))


def compressed_tensors_config(strategy: str, kv: bool = False, block=None) -> dict:
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False}
    if block:
        weights["block_structure"] = block
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": {
                "num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}}},
            "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                "symmetric": True} if kv else None}


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("float")
    build_hf_model("llama").save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def quantized_at_load(float_checkpoint):
    return load_model(float_checkpoint, quantization="fp8")


@pytest.mark.parametrize("fmt", ["compressed-tensors", "fbgemm_fp8"])
def test_per_channel_checkpoints_load_to_quantize_at_load(fmt, float_checkpoint, quantized_at_load, tmp_path):
    """A per-channel checkpoint holding the bytes and scales quantize-at-load computes loads to the same model:
    identical weights, scales and logits (scales stored [N, 1], as the tools write them)."""
    shards = {m: (w, s[:, None]) for m, (w, s) in shard_tensors(quantized_at_load).items()}
    qc = compressed_tensors_config("channel") if fmt == "compressed-tensors" else {"quant_method": "fbgemm_fp8"}
    write_checkpoint(tmp_path / "ckpt", float_checkpoint, shards, qc)
    loaded = load_model(tmp_path / "ckpt")  # quantization None: as the checkpoint stores it
    want, got = fp8_linears(quantized_at_load), fp8_linears(loaded)
    assert set(got) == set(want) and len(got) == 8
    for name, module in got.items():
        assert module.weight.dtype == FP8
        assert torch.equal(module.weight.view(torch.uint8), want[name].weight.view(torch.uint8)), name
        assert torch.equal(module.weight_scale, want[name].weight_scale), name
    assert loaded.lm_head.weight.dtype == torch.float32  # the LM head stays unquantized
    assert torch.equal(logits_of(loaded), logits_of(quantized_at_load))


def test_quantize_at_load_is_close_to_the_float_model(float_checkpoint, quantized_at_load):
    float_model = load_model(float_checkpoint)
    err = rel_err(logits_of(quantized_at_load), logits_of(float_model))
    assert 0 < err < FLOAT_TOLERANCE
    # and the least-squared-error scales beat amax / 448 on these weights
    for module, original in zip(fp8_linears(quantized_at_load).values(), fp8_linears(float_model).values()):
        w = original.weight.data
        chosen = (ref.dequantize_weight(module.weight, module.weight_scale) - w).square().sum()
        plain = (ref.dequantize_weight(*ref.quantize_rows(w)) - w).square().sum()
        assert chosen <= plain


def per_tensor_shards(float_model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Checkpoint module -> (e4m3 weight, one scale) quantized per tensor from the float model's weights."""
    out = {}
    for name, module in fp8_linears(float_model).items():
        parent, leaf = name.rsplit(".", 1)
        parts = {f"{parent}.{s}": module.shard_slice(s) for s in SHARDS.get(leaf, ())} or {name: (0, module.out_features)}
        for ckpt_name, (offset, size) in parts.items():
            w = module.weight.data[offset : offset + size]
            scale = w.abs().amax() / 448.0
            out[ckpt_name] = ((w / scale).to(FP8), scale.reshape(()))
    return out


def model_with(template, shards: dict[str, tuple[torch.Tensor, torch.Tensor]]):
    """The quantize-at-load model with its linears overwritten by the given shards' bytes and (spread) scales."""
    for name, module in fp8_linears(template).items():
        parent, leaf = name.rsplit(".", 1)
        for shard in SHARDS.get(leaf, (None,)):
            w_q, scale = shards[f"{parent}.{shard}" if shard else name]
            offset, size = module.shard_slice(shard) if shard else (0, module.out_features)
            module.weight.data[offset : offset + size] = w_q
            module.weight_scale.data[offset : offset + size] = scale.float().reshape(-1).expand(size)
    return template


@pytest.mark.parametrize("fmt", ["compressed-tensors", "fp8"])
def test_per_tensor_checkpoints(fmt, float_checkpoint, tmp_path):
    """Per-tensor scales (compressed-tensors strategy 'tensor' [1]; transformers' `fp8` with weight_block_size null,
    `weight_scale_inv` []): the checkpoint's bytes as they are, each tensor's scale spread over its rows."""
    float_model = load_model(float_checkpoint)
    shards = per_tensor_shards(float_model)
    if fmt == "compressed-tensors":
        write_checkpoint(tmp_path / "ckpt", float_checkpoint, {m: (w, s.reshape(1)) for m, (w, s) in shards.items()},
                         compressed_tensors_config("tensor"))
    else:
        write_checkpoint(tmp_path / "ckpt", float_checkpoint, shards, {"quant_method": "fp8",
                         "activation_scheme": "dynamic", "weight_block_size": None}, scale_name="weight_scale_inv")
    loaded = load_model(tmp_path / "ckpt")
    expected = model_with(load_model(float_checkpoint, quantization="fp8"), shards)
    for name, module in fp8_linears(loaded).items():
        assert torch.equal(module.weight.view(torch.uint8), fp8_linears(expected)[name].weight.view(torch.uint8))
        assert torch.equal(module.weight_scale, fp8_linears(expected)[name].weight_scale)
    got = logits_of(loaded)
    assert torch.equal(got, logits_of(expected))
    assert rel_err(got, logits_of(float_model)) < FLOAT_TOLERANCE


def test_block_wise_checkpoint(tmp_path):
    """transformers' `fp8` with 128x128 blocks (DeepSeek-style `weight_scale_inv` grids) on a model whose q/k/v and
    gate/up shards are whole blocks: bytes and block scales load as they are, and the model computes what the
    reference computes from them (each linear: the dequantized weights times the per-token quantized input)."""
    src = tmp_path / "float"
    build_hf_model("llama", hidden_size=256, intermediate_size=384, head_dim=64).save_pretrained(str(src))
    float_model = load_model(src)
    shards = {}
    for name, module in fp8_linears(float_model).items():
        parent, leaf = name.rsplit(".", 1)
        parts = {f"{parent}.{s}": module.shard_slice(s) for s in SHARDS.get(leaf, ())} or {name: (0, module.out_features)}
        for ckpt_name, (offset, size) in parts.items():
            shards[ckpt_name] = ref.quantize_blocks(module.weight.data[offset : offset + size])
    write_checkpoint(tmp_path / "ckpt", src, shards, {"quant_method": "fp8", "activation_scheme": "dynamic",
                     "weight_block_size": [128, 128]}, scale_name="weight_scale_inv")
    loaded = load_model(tmp_path / "ckpt")
    qkv = loaded.model.layers[0].self_attn.qkv_proj
    assert qkv.weight_scale.shape == (4, 2)  # rows: q 256 + k 128 + v 128 = 4 blocks; columns: 256 = 2 blocks
    q_w, q_s = shards["model.layers.0.self_attn.q_proj"]
    v_w, v_s = shards["model.layers.0.self_attn.v_proj"]
    assert torch.equal(qkv.weight_scale[:2], q_s) and torch.equal(qkv.weight_scale[3:], v_s)
    assert torch.equal(qkv.weight[384:].view(torch.uint8), v_w.view(torch.uint8))
    x = torch.randn(3, 256)
    assert torch.equal(qkv(x), ref.fp8_linear(x, qkv.weight, qkv.weight_scale))
    assert rel_err(logits_of(loaded), logits_of(float_model)) < FLOAT_TOLERANCE


def test_checkpoint_kv_cache_scales_reach_the_pool(float_checkpoint, quantized_at_load, tmp_path, tiny_tokenizer):
    """compressed-tensors' kv_cache_scheme: per-layer k_scale / v_scale become the FP8 pool's scales (spread over the
    kv heads) instead of calibrated ones."""
    from types import SimpleNamespace

    from prefixrt.engine.engine import Engine

    shards = {m: (w, s[:, None]) for m, (w, s) in shard_tensors(quantized_at_load).items()}
    layers = quantized_at_load.num_layers
    extra = {f"model.layers.{i}.self_attn.{kv}_scale": torch.tensor(0.01 * (i + 1) + (kv == "v") * 0.001)
             for i in range(layers) for kv in "kv"}
    write_checkpoint(tmp_path / "ckpt", float_checkpoint, shards, compressed_tensors_config("channel", kv=True),
                     extra=extra)
    model = load_model(tmp_path / "ckpt")
    k, v = model.kv_cache_scales
    assert k.shape == (layers, 2) and torch.allclose(k[1], torch.tensor(0.02)) and torch.allclose(v[0], torch.tensor(0.011))
    resolved = SimpleNamespace(name="tiny", revision="t", extra_eos_token_ids=(), path=str(tmp_path / "ckpt"))
    eng = Engine("tiny", _parts=(model, tiny_tokenizer, resolved), device="cpu", kv_cache_tokens=256,
                 kv_cache_dtype="fp8_e4m3")
    try:
        pool = eng.core.kv.pool
        assert pool.scales_source == "checkpoint" and torch.equal(pool.k_scales, k) and torch.equal(pool.v_scales, v)
        assert len(eng.generate([1, 5, 6, 7], {"max_new_tokens": 3, "temperature": 0}).token_ids) >= 1
    finally:
        eng.shutdown()


def test_unsupported_quantizations_are_clear_errors(float_checkpoint, quantized_at_load, tmp_path):
    shards = shard_tensors(quantized_at_load)
    write_checkpoint(tmp_path / "awq", float_checkpoint, {}, {"quant_method": "awq", "bits": 4})
    with pytest.raises(NotImplementedError, match="awq"):
        load_model(tmp_path / "awq")
    int8 = compressed_tensors_config("channel")
    int8["config_groups"]["group_0"]["weights"].update(type="int")
    write_checkpoint(tmp_path / "int8", float_checkpoint, {}, int8)
    with pytest.raises(NotImplementedError, match="int8"):
        load_model(tmp_path / "int8")
    e5m2 = {m: (w.float().to(torch.float8_e5m2), s) for m, (w, s) in shards.items()}
    write_checkpoint(tmp_path / "e5m2", float_checkpoint, e5m2, {"quant_method": "fbgemm_fp8"})
    with pytest.raises(NotImplementedError, match="e4m3"):
        load_model(tmp_path / "e5m2")
    with pytest.raises(ValueError, match="quantization"):
        load_model(float_checkpoint, quantization="int4")
