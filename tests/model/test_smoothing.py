"""FP8 smoothing (model/smoothing.py) on tiny checkpoints (CPU): the folds are exact (the smoothed float model computes
the logits it computed before, for every architecture; bit for bit in the Llama family, where every fold is a power
of two), the calibration statistics are the inputs transformers' own linears see (hooks on its modules), the
factors follow the formula (GQA groups sharing theirs), and models holding FP8 weights are never rescaled."""

from __future__ import annotations

import pytest
import torch

from prefixrt.hub.loader import load_model
from prefixrt.model.kv_calibration import calibration_tokens
from prefixrt.model.quantize import fp8_linears, quantize_fp8_at_load, quantize_fp8_weights
from prefixrt.model.smoothing import input_channel_amax, smooth_fp8_inputs, smoothing_factors
from tests.helpers.checkpoints import ARCH_NAMES, build_hf_model, save_tiny_vlm_checkpoint
from tests.helpers.harness import PagedHarness

ALPHA = 0.5
LLAMA_FAMILY = ("llama", "llama3_rope", "mistral", "qwen2", "qwen3", "llama_biases", "llava")


def _save(name: str, path) -> torch.nn.Module:
    """Save a tiny checkpoint of `name` (ARCH_NAMES, a VLM, or llama with every bias) into path; returns the
    transformers model."""
    if name in ("gemma3_vlm", "llava"):
        return save_tiny_vlm_checkpoint(path, name)[0]
    hf = build_hf_model("llama", attention_bias=True, mlp_bias=True) if name == "llama_biases" else build_hf_model(name)
    hf.save_pretrained(str(path))
    return hf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cache = {}

    def get(name: str):
        if name not in cache:
            path = tmp_path_factory.mktemp(f"smooth-{name}")
            cache[name] = (path, _save(name, path))
        return cache[name]

    return get


def _logits(model, tokens: list[int]) -> torch.Tensor:
    h = PagedHarness(model)
    with torch.no_grad():
        return h.forward([(h.new_row(), tokens)])[0]


def _prompt(n: int = 40) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.mark.parametrize("name", [*ARCH_NAMES, "llama_biases", "gemma3_vlm", "llava"])
def test_smoothing_keeps_the_logits(name, checkpoint):
    path, _ = checkpoint(name)
    model = load_model(str(path), dtype=torch.float32, device="cpu")
    before = _logits(model, _prompt())
    weights = {n: m.weight.detach().clone() for n, m in fp8_linears(model).items()}
    assert smooth_fp8_inputs(model, ALPHA, calibration_tokens(None)) == model.num_layers
    after = _logits(model, _prompt())
    if name in LLAMA_FAMILY:
        assert torch.equal(after, before)
    else:  # Gemma: (1 + w) / s - 1 in float32
        assert ((after - before).norm() / before.norm()).item() < 1e-5
    # (not an identity transform: every linear's weight moved)
    assert all(not torch.equal(m.weight, weights[n]) for n, m in fp8_linears(model).items())


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_smoothing_is_exact_in_bf16(name, checkpoint):
    """Powers of two: a bf16 model's folds lose nothing either."""
    path, _ = checkpoint(name)
    model = load_model(str(path), dtype=torch.bfloat16, device="cpu")
    before = _logits(model, _prompt())
    smooth_fp8_inputs(model, ALPHA, calibration_tokens(None))
    if name == "gemma3":  # its folded norms are float32 parameters (the module docstring)
        norm = model.model.layers[0].input_layernorm.weight
        assert norm.dtype == torch.float32
        assert ((_logits(model, _prompt()) - before).norm() / before.norm()).item() < 1e-5
    else:
        assert torch.equal(_logits(model, _prompt()), before)


def _hf_input_amax(hf, ids: list[int]) -> dict[str, torch.Tensor]:
    """transformers module name -> max |input| per channel over one forward of ids, from forward pre-hooks."""
    amax, handles = {}, []
    for name, module in hf.named_modules():
        if name.rsplit(".", 1)[-1] in ("q_proj", "o_proj", "gate_proj", "down_proj"):
            def hook(module, args, name=name):
                amax[name] = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(0)
            handles.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        hf(torch.tensor([ids]))
    for h in handles:
        h.remove()
    return amax


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma3"])
def test_calibration_statistics_and_factors_match_transformers(name, checkpoint):
    """input_channel_amax equals the maxima hooks on transformers' q/o/gate/down projections record over the same
    ids; o_proj's and down_proj's new weights are the old ones times the formula's powers of two (o_proj: the
    largest factor of each GQA group)."""
    path, hf = checkpoint(name)
    model = load_model(str(path), dtype=torch.float32, device="cpu")
    ids = calibration_tokens(None)
    used = [t for t in ids if t < model.vocab_size][: model.max_context]
    want = _hf_input_amax(hf, used)
    got = input_channel_amax(model, ids)
    ours = {"self_attn.q_proj": "self_attn.qkv_proj", "mlp.gate_proj": "mlp.gate_up_proj"}
    assert len(want) == 4 * model.num_layers
    for hf_name, amax in want.items():
        layer, kind = hf_name.split("model.layers.")[1].split(".", 1)
        torch.testing.assert_close(got[f"model.layers.{layer}.{ours.get(kind, kind)}"], amax, rtol=1e-5, atol=1e-6)

    o, down = model.model.layers[0].self_attn.o_proj, model.model.layers[0].mlp.down_proj
    o_before, down_before = o.weight.detach().clone(), down.weight.detach().clone()
    smooth_fp8_inputs(model, ALPHA, ids)
    x_down = want["model.layers.0.mlp.down_proj"]
    s_down = x_down.sqrt() / down_before.abs().amax(0).sqrt()
    assert torch.equal(down.weight, down_before * torch.exp2(torch.round(torch.log2(s_down)))[None, :])
    h, kvh, d = model.config.num_heads, model.config.num_kv_heads, model.config.head_dim
    s_o = want["model.layers.0.self_attn.o_proj"].sqrt() / o_before.abs().amax(0).sqrt()
    s_o = torch.exp2(torch.round(torch.log2(s_o))).view(kvh, h // kvh, d)
    assert h > kvh and not torch.equal(s_o.amin(1), s_o.amax(1))  # (the group rule matters here)
    s_o = s_o.amax(1, keepdim=True).expand(kvh, h // kvh, d).reshape(h * d)
    assert torch.equal(o.weight, o_before * s_o[None, :])


def test_smoothing_factors():
    x = torch.tensor([9.0, 0.0, 1.0, 4.0, 1e-3])
    w = torch.ones(3, 5)
    w[:, 2] = 0.0
    w[0, 3] = 4.0
    # sqrt(9 / 1) = 3 -> 4; no activation -> 1; no weight -> 1; sqrt(4 / 4) = 1; sqrt(1e-3) = 0.0316 -> 2^-5
    assert smoothing_factors(x, w, 0.5).tolist() == [4.0, 1.0, 1.0, 1.0, 2.0**-5]
    assert smoothing_factors(x, w, 1.0).tolist()[0] == 8.0  # 9 -> 2^3 (log2 9 = 3.17)
    with pytest.raises(ValueError, match="alpha"):
        smooth_fp8_inputs(torch.nn.Module(), 0.0, [1, 2])


def test_fp8_weights_are_not_smoothed(checkpoint):
    """A model that already holds FP8 weights (a pre-quantized checkpoint) is left as it is by quantize-at-load;
    smoothing it directly is refused."""
    path, _ = checkpoint("llama")
    model = load_model(str(path), dtype=torch.float32, device="cpu")
    quantize_fp8_weights(model)
    state = {n: t.clone() for n, t in model.state_dict().items()}
    assert quantize_fp8_at_load(model, ALPHA, calibration_tokens(None)) == 0
    assert all(torch.equal(t.float(), state[n].float()) for n, t in model.state_dict().items())
    with pytest.raises(ValueError, match="FP8 weights"):
        smooth_fp8_inputs(model, ALPHA, calibration_tokens(None))


def test_loader_smooths_before_quantizing(checkpoint):
    """load_model(quantization="fp8", fp8_smoothing=a) = smoothing then quantization of the float model; a real
    checkpoint needs the calibration ids, dummy weights take the pseudo-random ones."""
    path, _ = checkpoint("llama")
    ids = calibration_tokens(None)
    plain = load_model(str(path), dtype=torch.float32, device="cpu", quantization="fp8")
    loaded = load_model(str(path), dtype=torch.float32, device="cpu", quantization="fp8", fp8_smoothing=ALPHA,
                        calibration_ids=ids)
    by_hand = load_model(str(path), dtype=torch.float32, device="cpu")
    smooth_fp8_inputs(by_hand, ALPHA, ids)
    quantize_fp8_weights(by_hand)
    for (name, a), b in zip(loaded.state_dict().items(), by_hand.state_dict().values()):
        assert torch.equal(a.float(), b.float()), name
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert not torch.equal(loaded.state_dict()[qkv].float(), plain.state_dict()[qkv].float())
    with pytest.raises(ValueError, match="calibration_ids"):
        load_model(str(path), dtype=torch.float32, device="cpu", quantization="fp8", fp8_smoothing=ALPHA)
    dummy = load_model(str(path), load_format="dummy", dtype=torch.float32, device="cpu", quantization="fp8",
                       fp8_smoothing=ALPHA)
    assert dummy.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
