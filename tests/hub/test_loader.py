"""Loader: sharded checkpoints, dummy weights, config spellings, name mapping, clear errors."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from prefixrt.hub.loader import (
    checkpoint_files,
    checkpoint_name,
    load_model,
    load_model_from_config,
    supported_architectures,
)
from prefixrt.model.gemma3 import Gemma3Config
from prefixrt.model.layers import RopeConfig
from prefixrt.model.llama import LlamaConfig
from tests.helpers.checkpoints import save_tiny_checkpoint, tiny_config
from tests.helpers.harness import PagedHarness


def prefill_logits(model, tokens: list[int]) -> torch.Tensor:
    harness = PagedHarness(model)
    return harness.forward([(harness.new_row(), tokens)])[0]


def test_sharded_checkpoint(tmp_path):
    hf = save_tiny_checkpoint("qwen2", tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(checkpoint_files(tmp_path)) > 1
    model = load_model(str(tmp_path))
    tokens = list(range(5, 17))
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    got = prefill_logits(model, tokens)
    assert float((got - ref).norm() / ref.norm()) < 1e-4


def test_dummy_weights_deterministic_and_finite(tmp_path):
    tiny_config("gemma3").save_pretrained(str(tmp_path))  # config.json only: dummy needs no weights
    torch.manual_seed(0)
    a = load_model(str(tmp_path), load_format="dummy")
    torch.manual_seed(0)
    b = load_model(str(tmp_path), load_format="dummy")
    torch.manual_seed(1)
    c = load_model(str(tmp_path), load_format="dummy")
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.mlp.down_proj.weight"], sc["model.layers.0.mlp.down_proj.weight"])
    # Gemma norms scale by (1 + w): identity is w = 0
    assert sa["model.norm.weight"].abs().max() < 0.2
    logits = prefill_logits(a, list(range(3, 40)))
    assert logits.shape == (37, 320) and torch.isfinite(logits).all()
    assert a.lm_head.weight is a.model.embed_tokens.weight  # tied survives materialisation


def test_load_model_from_config_dummy():
    torch.manual_seed(0)
    model = load_model_from_config(tiny_config("llama"), dtype=torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.model.norm.weight.float().mean().item() == pytest.approx(1.0, abs=0.05)  # Llama identity = 1
    logits = prefill_logits(model, list(range(3, 20)))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert (model.num_layers, model.num_kv_heads, model.head_dim, model.vocab_size, model.max_context) == (
        2, 2, 16, 320, 128,
    )
    assert model.eos_token_ids == [2]


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="unsupported model architecture.*supported:.*LlamaForCausalLM"):
        load_model(str(tmp_path), load_format="dummy")
    assert "Gemma3ForCausalLM" in supported_architectures()


def test_missing_folder_and_bad_load_format(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="load_format"):
        load_model(str(tmp_path), load_format="pt")


def test_generation_config_eos_ids_are_added(tmp_path):
    tiny_config("qwen3").save_pretrained(str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    model = load_model(str(tmp_path), load_format="dummy")
    assert model.eos_token_ids == [2, 7]


def test_checkpoint_names_of_multimodal_gemma3():
    assert checkpoint_name("model.language_model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert checkpoint_name("language_model.model.norm.weight") == "model.norm.weight"
    assert checkpoint_name("language_model.lm_head.weight") == "lm_head.weight"
    assert checkpoint_name("model.vision_tower.vision_model.embeddings.patch_embedding.weight") is None
    assert checkpoint_name("model.multi_modal_projector.mm_soft_emb_norm.weight") is None
    assert checkpoint_name("model.embed_tokens.weight") == "model.embed_tokens.weight"
    vision_name = "model.vision_tower.vision_model.embeddings.patch_embedding.weight"
    assert checkpoint_name(vision_name, vision=True) == "vision_tower.embeddings.patch_embedding.weight"
    assert checkpoint_name("vision_tower.encoder.layers.0.mlp.fc1.bias", vision=True) == (
        "vision_tower.encoder.layers.0.mlp.fc1.bias")
    assert checkpoint_name("multi_modal_projector.mm_soft_emb_norm.weight", vision=True) == (
        "multi_modal_projector.mm_soft_emb_norm.weight")


def _legacy(**fields):
    """A transformers-4.x-style config object (rope_theta / rope_scaling, no rope_parameters)."""
    base = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, eos_token_id=[1, 2])
    return SimpleNamespace(**{**base, **fields})


def test_llama_rope_legacy_and_new_spellings_agree():
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32)
    legacy = LlamaConfig.from_hf(_legacy(rope_theta=500000.0, rope_scaling=scaling), "LlamaForCausalLM")
    new = LlamaConfig.from_hf(
        _legacy(rope_parameters={**scaling, "rope_theta": 500000.0}), "LlamaForCausalLM"
    )
    assert legacy.rope == new.rope == RopeConfig(
        head_dim=16, theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32,
    )
    assert legacy.eos_token_ids == (1, 2)
    # old-style {"type": "linear"} also parses
    old = LlamaConfig.from_hf(_legacy(rope_theta=1e4, rope_scaling={"type": "linear", "factor": 2.0}), "LlamaForCausalLM")
    assert (old.rope.rope_type, old.rope.factor) == ("linear", 2.0)
    with pytest.raises(NotImplementedError, match="yarn"):
        LlamaConfig.from_hf(_legacy(rope_theta=1e4, rope_scaling={"rope_type": "yarn", "factor": 2.0}),
                            "LlamaForCausalLM")


def test_gemma3_rope_legacy_spelling_matches_transformers_5():
    legacy = Gemma3Config.from_hf(_legacy(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=4, sliding_window_pattern=2,
        rope_theta=1_000_000.0, rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 4.0},
        num_hidden_layers=3,
    ))
    new = Gemma3Config.from_hf(tiny_config("gemma3"))
    assert legacy.local_rope == new.local_rope
    assert legacy.global_rope == new.global_rope
    assert legacy.layer_types == new.layer_types == ("sliding_attention", "full_attention", "sliding_attention")


@pytest.mark.parametrize("name", ["llama-3-8b", "llama-3.2-1b", "qwen3-0.6b"])
def test_plain_json_configs_give_autoconfigs_model_spec(tmp_path, monkeypatch, name):
    """read_model_spec reads a llama-family config.json that spells out its fields as plain JSON (no transformers
    import), and the ModelSpec equals the one from transformers' AutoConfig; configs that leave a field to a
    transformers default, name custom code or another architecture go through AutoConfig."""
    from transformers import AutoConfig

    from prefixrt.hub.loader import model_spec, plain_config, read_model_spec
    from prefixrt.hub.registry import resolve_model

    monkeypatch.setenv("PREFIXRT_CACHE_DIR", str(tmp_path / "cache"))
    folder = resolve_model(name).path
    assert plain_config(folder) is not None
    assert read_model_spec(folder) == model_spec(AutoConfig.from_pretrained(str(folder), local_files_only=True))
    config = json.loads((folder / "config.json").read_text())
    for change in ({"eos_token_id": None}, {"rms_norm_eps": None}, {"architectures": ["MistralForCausalLM"]},
                   {"auto_map": {"AutoConfig": "x.Y"}}, {"rope_theta": None, "rope_parameters": None}):
        other = tmp_path / f"changed-{len(list(tmp_path.iterdir()))}"
        other.mkdir()
        changed = {**config, **change}
        (other / "config.json").write_text(json.dumps({k: v for k, v in changed.items() if v is not None}))
        assert plain_config(other) is None, change


def test_building_a_model_leaves_torch_init_and_dynamo_alone(tmp_path):
    """Models are built on the meta device with torch.nn.init's initialisers switched off: torch would run them
    through its Python references there, importing torch._dynamo (seconds); after the build they are torch's own
    again, even when the build fails."""
    import subprocess
    import sys

    from prefixrt.hub import loader

    save_tiny_checkpoint("llama", tmp_path / "ckpt")
    probe = ("import sys, torch; from prefixrt.hub.loader import load_model; "
             f"m = load_model({str(tmp_path / 'ckpt')!r}, dtype=torch.float32); "
             "print('torch._dynamo' in sys.modules, torch.isfinite(m.lm_head.weight).all().item())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["False", "True"]
    kept = torch.nn.init.normal_
    with pytest.raises(RuntimeError), loader._no_parameter_init():
        assert torch.nn.init.normal_ is not kept
        raise RuntimeError("a failed build")
    assert torch.nn.init.normal_ is kept
