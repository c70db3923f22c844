"""Pre-quantized FP8 checkpoints (hub/fp8_checkpoint.py) as the quantizing tools publish them, each written here by
the tool's own code from a tiny transformers model:
- compressed-tensors (llm-compressor's format, which llm-compressor writes through this library): its presets
  FP8_DYNAMIC (per-channel weights, dynamic per-token activations), FP8 (per-tensor weights, static per-tensor
  activations) and FP8_BLOCK (128 x 128 weight blocks, dynamic activation groups of 128), and a K/V cache scheme.
  Its calculate_qparams turns observed min / max values into scales (the weights' own; the static activations' from
  a calibration forward, which is what llm-compressor's observers do), its ModelCompressor compresses the model and
  writes quantization_config (compress_model, save_pretrained, update_config);
- transformers' `fp8` (FineGrainedFP8Config; DeepSeek-style 128 x 128 blocks and per tensor): the tensors from its
  own quantize op (FineGrainedFP8HfQuantizer.get_quantize_ops, what from_pretrained runs when it quantizes, which it
  does on a GPU only, so the op is called directly here) saved with the config's to_dict(); with
  `activation_scheme: "static"` the `activation_scale` of each linear is calibrated here (the op does not make one);
- fbgemm_fp8 in its documented layout (its quantizer needs fbgemm-gpu), per-row scales computed here.
Oracles, from exact to stated tolerances:
1. transformers' own dequantized weights (compressed-tensors' decompression; transformers' FP8 dequantize op on the
   CPU) equal our e4m3 bytes times our scales, bit for bit, shard by shard, and our bytes are the checkpoint's;
2. each linear, given the same input: ours equals transformers' linear of that shard to float32 rounding
   (EXACT_TOLERANCE). A decode batch (at most 64 rows) runs weight-only under every scheme, static scales included:
   transformers' dequantized linear, activations left float. A taller input: transformers' linear quantizing it
   as the checkpoint declares (compressed-tensors' forward) where we run that scheme (static per tensor; per
   token), else transformers' dequantized linear with a forward pre-hook quantizing its input by our scheme
   (kernels/fp8_reference.py: "group", "token", or the checkpoint's static scales where transformers' CPU path
   leaves activations float; "none" leaves it float);
3. the whole model over a prompt taller than a decode batch, against transformers as in 2: within
   ROUNDING_TOLERANCE (summation order differs, which flips the e4m3 rounding of an activation now and then, and
   attention carries the flip to later positions);
4. our quantize-at-load of the same float weights (least-squares scales per channel, where the tools take amax):
   within AT_LOAD_TOLERANCE, and both within FLOAT_TOLERANCE of the float model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from prefixrt.kernels import fp8_reference as ref

from prefixrt.config.engine_config import EngineConfig
from prefixrt.hub.loader import load_model
from prefixrt.model.quantize import fp8_linears, set_fp8_activation_scale
from tests.helpers.checkpoints import build_hf_model
from tests.helpers.harness import PagedHarness

FP8 = torch.float8_e4m3fn
TOKENS = list(range(5, 101))  # 96 tokens: a prefill taller than a decode batch runs the activation scheme
SCHEMES = ("none", "group", "token")  # our run-time activation schemes (EngineConfig.fp8_activation_scale)
DECODE_ROWS, TALL_ROWS = 7, 80  # inputs of at most 64 rows run weight-only (model/fp8_linear.WEIGHT_ONLY_MAX_ROWS)
SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
BLOCK_SHAPE = {"hidden_size": 256, "intermediate_size": 384, "head_dim": 64}  # q/k/v, gate/up: whole 128-row blocks
ENGINE_SCHEME = EngineConfig().fp8_activation_scale  # the activation scheme an engine runs by default

# One linear's output computed two ways from the same input and weights, float32 both: summation order only. A wrong
# byte, scale or activation step moves it by >1e-3.
EXACT_TOLERANCE = 1e-5
# Logits of the same checkpoint computed two ways (ours over the paged pool, transformers' model): float32 rounding
# differs, so now and then an activation lands on the other side of an e4m3 rounding step, and attention carries it
# to the later positions (0.021 measured on the block model, 1e-7 where none flipped). Wrong scales or bytes are off
# by more: per-token activation scales instead of a checkpoint's static ones by 0.10, a wrong block layout by O(1).
ROUNDING_TOLERANCE = 0.05
# Logits of FP8 weights vs the float model on these tiny random checkpoints: e4m3 steps are 16x bf16's, and bf16
# weights alone move these logits by ~1% (up to ~19% measured for FP8; the real models' accuracy is
# tests/model/test_fp8_accuracy.py). A wrong scale layout or byte order is off by O(1).
FLOAT_TOLERANCE = 0.3
# A tool's checkpoint vs our quantize-at-load of the same float weights, the same activation scheme: the weights
# differ by the scale choice alone (amax / 448, or per tensor, against least-squares per channel), and each moves
# these logits about as far from the float model's (0.09 at load, 0.11-0.12 the tools'); measured 0.13-0.15 apart.
AT_LOAD_TOLERANCE = 0.2


def rel_err(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def logits_of(model) -> torch.Tensor:
    harness = PagedHarness(model)
    return harness.forward([(harness.new_row(), TOKENS)])[0]


def hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0].float()


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def shards_of(model) -> dict[str, tuple[torch.nn.Module, int, int]]:
    """Checkpoint module name (q_proj, ..., down_proj) -> (our FP8 linear holding it, its first row, its rows)."""
    out = {}
    for name, module in fp8_linears(model).items():
        parent, leaf = name.rsplit(".", 1)
        for shard in SHARDS.get(leaf, ()):
            out[f"{parent}.{shard}"] = (module, *module.shard_slice(shard))
        if leaf not in SHARDS:
            out[name] = (module, 0, module.out_features)
    return out


def dequantized_rows(module, offset: int, size: int) -> torch.Tensor:
    """Rows [offset, offset + size) of an FP8 linear's weight as our reference computes with it (float32)."""
    return ref.dequantize_weight(module.weight, module.weight_scale)[offset : offset + size]


def decoder_linears(hf_model) -> dict[str, torch.nn.Linear]:
    return {name: m for name, m in hf_model.named_modules()
            if isinstance(m, torch.nn.Linear) and ".layers." in f".{name}"}


def quantize_inputs(hf_model, scheme: str, static_scales: dict[str, torch.Tensor] | None = None) -> None:
    """Make each decoder linear of a transformers model (float weights) quantize its input as our FP8 linears do for
    inputs taller than a decode batch: per group or per token (kernels/fp8_reference.py), with the given static
    scale per checkpoint module, or not at all ("none")."""
    if scheme == "none":
        return

    def hook(name):
        def quantize(module, args):
            x = args[0]
            x2 = x.reshape(-1, x.shape[-1])
            if scheme == "static":
                x_q, x_scale = ref.quantize_static(x2, static_scales[name])
            else:
                x_q, x_scale = ref.quantize_activations(x2, scheme)
            return (ref.dequantize_activations(x_q, x_scale).to(x.dtype).view_as(x),)

        return quantize

    for name, module in decoder_linears(hf_model).items():
        module.register_forward_pre_hook(hook(name))


# ------------------------------------------------------------------------------------------- writing checkpoints


def calibration_amax(hf_model, names) -> dict[str, float]:
    """The largest |input| each named linear sees over a calibration forward of the float model."""
    amax: dict[str, float] = {}
    modules = dict(hf_model.named_modules())

    def hook(name):
        return lambda module, args: amax.__setitem__(name, max(amax.get(name, 0.0), args[0].abs().amax().item()))

    handles = [modules[name].register_forward_pre_hook(hook(name)) for name in names]
    with torch.no_grad():
        hf_model(torch.tensor([list(range(3, 40)), list(range(60, 97))]))
    for handle in handles:
        handle.remove()
    return amax


def _min_max(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Observed (min, max) of a weight in the layout of its strategy's scales (what an observer records)."""
    from compressed_tensors.quantization import QuantizationStrategy

    w = weight.float()
    if args.strategy == QuantizationStrategy.TENSOR:
        return w.amin().reshape(1), w.amax().reshape(1)
    if args.strategy == QuantizationStrategy.CHANNEL:
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if args.strategy == QuantizationStrategy.BLOCK:
        rows, cols = args.block_structure
        tiles = w.unflatten(0, (-1, rows)).unflatten(-1, (-1, cols))  # [N / rows, rows, K / cols, cols]
        return tiles.amin(dim=(1, 3)), tiles.amax(dim=(1, 3))
    raise ValueError(f"no observer here for strategy {args.strategy}")


def write_compressed_tensors(path: Path, preset: str, kv_cache_scales: dict[str, float] | None = None,
                             **model_config) -> None:  # fmt: skip
    """A tiny llama quantized with compressed-tensors' preset scheme (decoder linears; lm_head ignored) and saved
    compressed, as llm-compressor saves it. kv_cache_scales: {"k": value, "v": value}, layer i's scales value * (i + 1)
    under an FP8 kv_cache_scheme: the library attaches K/V scales to attention modules whose forward takes
    `past_key_values`, which this transformers' attention (`cache`) does not, so they are put where it would put them
    (`self_attn.k_scale` / `v_scale`, [1]) and the scheme into its config."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = build_hf_model("llama", **model_config)
    kv_scheme = None if kv_cache_scales is None else QuantizationArgs(num_bits=8, type="float", strategy="tensor",
                                                                      dynamic=False, symmetric=True)
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
                                ignore=["lm_head"])
    amax = calibration_amax(model, decoder_linears(model))  # (before the quantized forward is attached)
    apply_quantization_config(model, config)
    with torch.no_grad():
        for name, module in model.named_modules():
            scheme = getattr(module, "quantization_scheme", None)
            if scheme is None:
                continue
            scale, _ = calculate_qparams(*_min_max(module.weight, scheme.weights), scheme.weights)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if scheme.input_activations is not None and not scheme.input_activations.dynamic:
                a = torch.tensor([amax[name]])
                scale, _ = calculate_qparams(-a, a, scheme.input_activations)
                module.input_scale.copy_(scale.reshape(module.input_scale.shape))
            module.quantization_status = QuantizationStatus.FROZEN
        for i, layer in enumerate(model.model.layers if kv_cache_scales else ()):
            for kv in "kv":
                scale = torch.tensor([kv_cache_scales[kv] * (i + 1)])
                layer.self_attn.register_parameter(f"{kv}_scale", torch.nn.Parameter(scale, requires_grad=False))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.quantization_config.kv_cache_scheme = kv_scheme
    compressor.compress_model(model)
    model.save_pretrained(str(path))
    compressor.update_config(str(path))


def write_transformers_fp8(path: Path, weight_block_size, activation_scheme: str = "dynamic",
                           **model_config) -> None:  # fmt: skip
    """A tiny llama's decoder linears quantized by transformers' FineGrainedFP8 quantize op, saved with the rest of
    its float tensors and the FineGrainedFP8Config as quantization_config. A static activation scheme gets each
    linear's `activation_scale` (amax / 448 of its input over a calibration forward)."""
    from safetensors.torch import save_file
    from transformers import FineGrainedFP8Config
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    model = build_hf_model("llama", **model_config)
    config = FineGrainedFP8Config(activation_scheme=activation_scheme, weight_block_size=weight_block_size,
                                  modules_to_not_convert=["lm_head"])
    quantize = FineGrainedFP8HfQuantizer(config).get_quantize_ops()
    linears = decoder_linears(model)
    amax = calibration_amax(model, linears) if activation_scheme == "static" else {}
    tensors = {name: t.detach().clone().contiguous() for name, t in model.state_dict().items()}
    for name in linears:
        tensors.update(quantize.convert({f"{name}.weight": tensors[f"{name}.weight"]}))
        if name in amax:
            tensors[f"{name}.activation_scale"] = torch.tensor(amax[name] / 448.0)
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    model.config.quantization_config = config.to_dict()
    model.config.save_pretrained(str(path))


def transformers_model(path: Path, scheme_of_checkpoint: bool = True):
    """The checkpoint loaded by transformers on the CPU (float32). compressed-tensors decompresses the weights and,
    with scheme_of_checkpoint, quantizes the activations as the checkpoint declares; transformers' FP8 dequantizes
    the weights (activations stay float)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    if json.loads((path / "config.json").read_text())["quantization_config"]["quant_method"] == "compressed-tensors":
        if not scheme_of_checkpoint:
            from compressed_tensors.quantization.lifecycle import disable_quantization

            model.apply(disable_quantization)
        hf_logits(model)  # (the first forward decompresses the weights)
    return model


# ------------------------------------------------------------------------------------------------------ the tests


def check_linears(loaded, hf_model, rows: int) -> None:
    """Oracle 2: one input [1, rows, K] through each of our FP8 linears and through transformers' linear of each of
    its shards (its rows of our output): equal to float32 rounding."""
    gen = torch.Generator().manual_seed(rows)
    hf_linears = decoder_linears(hf_model)
    with torch.no_grad():
        for name, (module, offset, size) in shards_of(loaded).items():
            x = torch.randn(1, rows, module.in_features, generator=gen) * 3
            ours = module(x)[..., offset : offset + size]
            assert rel_err(ours, hf_linears[name](x)) < EXACT_TOLERANCE, name


def check_weights_as_written(loaded, path: Path, hf_model) -> None:
    """Oracle 1: every shard's e4m3 bytes are the checkpoint's, and dequantized they equal transformers' dequantized
    weights exactly."""
    tensors = checkpoint_tensors(path)
    hf_linears = decoder_linears(hf_model)
    shards = shards_of(loaded)
    assert set(shards) == set(hf_linears) and len(shards) == 7 * loaded.num_layers
    for name, (module, offset, size) in shards.items():
        assert module.weight.dtype == FP8
        stored = tensors[f"{name}.weight"]
        assert torch.equal(module.weight[offset : offset + size].view(torch.uint8), stored.view(torch.uint8)), name
        assert torch.equal(dequantized_rows(module, offset, size), hf_linears[name].weight.float()), name
    assert loaded.lm_head.weight.dtype == torch.float32  # the LM head stays unquantized


@pytest.mark.parametrize("preset", ["FP8_DYNAMIC", "FP8", "FP8_BLOCK"])
def test_compressed_tensors_checkpoints(preset, tmp_path):
    """compressed-tensors' FP8 presets load as written (oracle 1) and compute what transformers computes with the
    checkpoint (oracles 2 and 3) under each of our activation schemes: decode batches weight-only; taller inputs with
    static per-tensor activations as the checkpoint has them, whatever the scheme, per-token ones as compressed-tensors
    quantizes them, the others as transformers' dequantized model with our activation quantization (the block
    preset's groups of 128 are no scheme of ours: our groups of 64 are finer)."""
    shape = BLOCK_SHAPE if preset == "FP8_BLOCK" else {}
    path = tmp_path / "ckpt"
    write_compressed_tensors(path, preset, **shape)
    loaded = load_model(path)  # quantization None: as the checkpoint stores it
    check_weights_as_written(loaded, path, transformers_model(path, False))
    static = preset == "FP8"
    tensors = checkpoint_tensors(path)
    for name, (module, _, _) in shards_of(loaded).items():
        if static:  # q/k/v (gate/up) were calibrated on the same input: one scale, the merged linear's
            assert torch.equal(module.input_scale, tensors[f"{name}.input_scale"].float()), name
        else:
            assert module.input_scale is None
    as_declared = transformers_model(path)
    for scheme in SCHEMES:
        set_fp8_activation_scale(loaded, scheme)
        check_linears(loaded, transformers_model(path, False), DECODE_ROWS)
        if static or (scheme == "token" and preset == "FP8_DYNAMIC"):  # the checkpoint's own scheme
            reference = as_declared
        else:
            reference = transformers_model(path, False)
            quantize_inputs(reference, scheme)
        check_linears(loaded, reference, TALL_ROWS)
        assert rel_err(logits_of(loaded), hf_logits(reference)) < ROUNDING_TOLERANCE, scheme
        assert rel_err(logits_of(loaded), hf_logits(build_hf_model("llama", **shape))) < FLOAT_TOLERANCE


@pytest.mark.parametrize("block,activation_scheme", [([128, 128], "dynamic"), (None, "dynamic"), (None, "static")])
def test_transformers_fp8_checkpoints(block, activation_scheme, tmp_path):
    """transformers' `fp8` (128 x 128 blocks, DeepSeek-style; per tensor; per tensor with static activation scales)
    loads as written (oracle 1, against transformers' own dequantization on the CPU) and computes what transformers'
    dequantized model computes with our activation quantization (oracles 2 and 3: each of our schemes, or the
    checkpoint's static scales)."""
    shape = BLOCK_SHAPE if block else {}
    write_transformers_fp8(tmp_path / "ckpt", block, activation_scheme, **shape)
    loaded = load_model(tmp_path / "ckpt")
    reference = transformers_model(tmp_path / "ckpt")
    check_weights_as_written(loaded, tmp_path / "ckpt", reference)
    if block:
        qkv = loaded.model.layers[0].self_attn.qkv_proj
        assert qkv.weight_scale.shape == (4, 2)  # rows: q 256 + k 128 + v 128 = 4 blocks; columns: 256 = 2 blocks
    scales = {}
    if activation_scheme == "static":
        tensors = checkpoint_tensors(tmp_path / "ckpt")
        scales = {name: tensors[f"{name}.activation_scale"] for name in decoder_linears(reference)}
        for name, (module, _, _) in shards_of(loaded).items():
            assert torch.equal(module.input_scale, scales[name].float().reshape(1)), name
    for scheme in SCHEMES:
        set_fp8_activation_scale(loaded, scheme)
        check_linears(loaded, reference, DECODE_ROWS)  # (no hooks yet: transformers' CPU path is weight-only)
        tall = transformers_model(tmp_path / "ckpt")
        quantize_inputs(tall, "static" if scales else scheme, scales)
        check_linears(loaded, tall, TALL_ROWS)
        ours = logits_of(loaded)
        assert rel_err(ours, hf_logits(tall)) < ROUNDING_TOLERANCE, scheme
        assert rel_err(ours, hf_logits(build_hf_model("llama", **shape))) < FLOAT_TOLERANCE


@pytest.mark.parametrize("writer", ["compressed-tensors FP8_DYNAMIC", "compressed-tensors FP8",
                                    "transformers fp8 per tensor"])
def test_checkpoints_match_quantize_at_load(writer, tmp_path):
    """Oracle 4: a tool's checkpoint and our quantize-at-load of the same float weights, both under the engine's
    default scheme (the static checkpoint under its own scales), give logits within AT_LOAD_TOLERANCE of each other,
    both within FLOAT_TOLERANCE of the float model. The weights differ by the scale choice alone: compressed-tensors'
    per-channel bytes are exactly our reference's amax / 448 rows (kernels/fp8_reference.quantize_rows), which
    quantize-at-load improves on with least-squares scales (test_quantize_at_load_is_close_to_the_float_model)."""
    if writer.startswith("compressed-tensors"):
        write_compressed_tensors(tmp_path / "ckpt", writer.split()[-1])
    else:
        write_transformers_fp8(tmp_path / "ckpt", None)
    build_hf_model("llama").save_pretrained(str(tmp_path / "float"))  # (the same seed: the same float weights)
    published, at_load = load_model(tmp_path / "ckpt"), load_model(tmp_path / "float", quantization="fp8")
    float_model = load_model(tmp_path / "float")
    if writer.endswith("FP8_DYNAMIC"):
        floats = dict(zip(fp8_linears(published), fp8_linears(float_model).values()))
        for name, module in fp8_linears(published).items():
            w_q, scale = ref.quantize_rows(floats[name].weight.data)
            assert torch.equal(module.weight.view(torch.uint8), w_q.view(torch.uint8)), name
            assert torch.equal(module.weight_scale, scale), name
    for model in (published, at_load):
        set_fp8_activation_scale(model, ENGINE_SCHEME)
    ours, theirs = logits_of(at_load), logits_of(published)
    assert 0 < rel_err(theirs, ours) < AT_LOAD_TOLERANCE
    assert rel_err(theirs, logits_of(float_model)) < FLOAT_TOLERANCE
    assert rel_err(ours, logits_of(float_model)) < FLOAT_TOLERANCE


def test_fbgemm_checkpoint(tmp_path):
    """fbgemm_fp8 (transformers' FbgemmFp8Config; its quantizer runs on a GPU only): the documented layout, `weight`
    e4m3 and `weight_scale` [N, 1] per row (amax / 448, computed here), `input_scale_ub` (an activation bound we do
    not use). Loads as written and computes what the dequantized float model computes (weight-only decode batches;
    taller inputs under the "group" scheme)."""
    from safetensors.torch import save_file

    model = build_hf_model("llama")
    tensors = {name: t.detach().clone().contiguous() for name, t in model.state_dict().items()}
    for name, linear in decoder_linears(model).items():
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1, keepdim=True) / 448.0  # [N, 1]
        tensors[f"{name}.weight"] = (w / scale).clamp(-448, 448).to(FP8)
        tensors[f"{name}.weight_scale"] = scale
        tensors[f"{name}.input_scale_ub"] = torch.tensor([1200.0])
        with torch.no_grad():
            linear.weight.copy_(tensors[f"{name}.weight"].float() * scale)  # the reference: the dequantized weights
    (tmp_path / "ckpt").mkdir()
    save_file(tensors, str(tmp_path / "ckpt" / "model.safetensors"), metadata={"format": "pt"})
    model.config.quantization_config = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                                        "modules_to_not_convert": ["lm_head"]}
    model.config.save_pretrained(str(tmp_path / "ckpt"))
    loaded = load_model(tmp_path / "ckpt")
    check_weights_as_written(loaded, tmp_path / "ckpt", model)
    check_linears(loaded, model, DECODE_ROWS)
    quantize_inputs(model, "group")
    set_fp8_activation_scale(loaded, "group")
    check_linears(loaded, model, TALL_ROWS)
    assert rel_err(logits_of(loaded), hf_logits(model)) < ROUNDING_TOLERANCE


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("float")
    build_hf_model("llama").save_pretrained(str(path))
    return path


def test_quantize_at_load_is_close_to_the_float_model(float_checkpoint):
    float_model = load_model(float_checkpoint)
    quantized_at_load = load_model(float_checkpoint, quantization="fp8")
    err = rel_err(logits_of(quantized_at_load), logits_of(float_model))
    assert 0 < err < FLOAT_TOLERANCE
    # and the least-squared-error scales beat amax / 448 on these weights
    for module, original in zip(fp8_linears(quantized_at_load).values(), fp8_linears(float_model).values()):
        w = original.weight.data
        chosen = (ref.dequantize_weight(module.weight, module.weight_scale) - w).square().sum()
        plain = (ref.dequantize_weight(*ref.quantize_rows(w)) - w).square().sum()
        assert chosen <= plain


def test_checkpoint_kv_cache_scales_and_static_activations_reach_the_engine(tmp_path, tiny_tokenizer):
    """compressed-tensors' kv_cache_scheme: per-layer k_scale / v_scale become the FP8 pool's scales (spread over the
    kv heads) instead of calibrated ones; with static activation scales (preset FP8) the engine, whatever its
    fp8_activation_scale, generates what the loaded model generates greedily on its own."""
    from types import SimpleNamespace

    from prefixrt.engine.engine import Engine

    write_compressed_tensors(tmp_path / "ckpt", "FP8", kv_cache_scales={"k": 0.01, "v": 0.011})
    model = load_model(tmp_path / "ckpt")
    k, v = model.kv_cache_scales
    layers = model.num_layers
    assert k.shape == (layers, 2) and torch.allclose(k[1], torch.tensor(0.02)) and torch.allclose(v[0], torch.tensor(0.011))
    prompt = TOKENS[:80]  # a prefill taller than a decode batch: the static scales at work
    harness = PagedHarness(model, kv_dtype=FP8, kv_scales=(k, v))
    expected = harness.generate_greedy([prompt], 6, stop_at_eos=False)[0]
    resolved = SimpleNamespace(name="tiny", revision="t", extra_eos_token_ids=(), path=str(tmp_path / "ckpt"))
    eng = Engine("tiny", _parts=(model, tiny_tokenizer, resolved), device="cpu", kv_cache_tokens=256,
                 kv_cache_dtype="fp8_e4m3", fp8_activation_scale="token")
    try:
        pool = eng.core.kv.pool
        assert pool.scales_source == "checkpoint" and torch.equal(pool.k_scales, k) and torch.equal(pool.v_scales, v)
        out = eng.generate(prompt, {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}).token_ids
        assert list(out) == expected
    finally:
        eng.shutdown()


def write_config(path: Path, quantization_config: dict) -> None:
    path.mkdir()
    config = build_hf_model("llama").config
    config.quantization_config = quantization_config
    config.save_pretrained(str(path))


def compressed_tensors_config(weights: dict, input_activations: dict | None) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": input_activations}}}


def test_unsupported_quantizations_are_clear_errors(float_checkpoint, tmp_path):
    fp8 = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
    write_config(tmp_path / "awq", {"quant_method": "awq", "bits": 4})
    with pytest.raises(NotImplementedError, match="awq"):
        load_model(tmp_path / "awq")
    write_config(tmp_path / "int8", compressed_tensors_config({**fp8, "type": "int"}, None))
    with pytest.raises(NotImplementedError, match="int8"):
        load_model(tmp_path / "int8")
    static_per_token = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": False, "symmetric": True}
    write_config(tmp_path / "static-token", compressed_tensors_config(fp8, static_per_token))
    with pytest.raises(NotImplementedError, match="static input activations with strategy 'token'"):
        load_model(tmp_path / "static-token")
    with pytest.raises(ValueError, match="quantization"):
        load_model(float_checkpoint, quantization="int4")


def test_static_scheme_without_its_scales_is_a_clear_error(tmp_path):
    """A checkpoint that declares static activations but lacks a linear's scale names the field and the module."""
    from safetensors.torch import load_file, save_file

    write_transformers_fp8(tmp_path / "ckpt", None, "static")
    file = tmp_path / "ckpt" / "model.safetensors"
    tensors = load_file(str(file))
    del tensors["model.layers.1.mlp.down_proj.activation_scale"]
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"input_scale.*model\.layers\.1\.mlp\.down_proj"):
        load_model(tmp_path / "ckpt")
    e5m2 = {name: (t.float().to(torch.float8_e5m2) if t.dtype == FP8 else t) for name, t in tensors.items()}
    save_file(e5m2, str(file), metadata={"format": "pt"})
    with pytest.raises(NotImplementedError, match="e4m3"):
        load_model(tmp_path / "ckpt")
