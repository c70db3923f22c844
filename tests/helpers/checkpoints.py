"""Tiny random transformers checkpoints for every supported architecture (the oracle for model tests)."""

from __future__ import annotations

from pathlib import Path

import torch

SLIDING, FULL = "sliding_attention", "full_attention"
_COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.1,  # sharper attention than the default 0.02: masking bugs show up in the logits
    rms_norm_eps=1e-6,
    eos_token_id=2,
    bos_token_id=1,
    pad_token_id=0,
)


def tiny_config(name: str):
    """transformers config of a tiny model; `name` is one of ARCH_NAMES."""
    import transformers as tf

    if name == "llama":
        return tf.LlamaConfig(**_COMMON, num_hidden_layers=2, tie_word_embeddings=False)
    if name == "llama3_rope":
        # original_max_position_embeddings 32 puts the 8 rotary frequencies in all three llama3 bands.
        rope = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position_embeddings=32)
        return tf.LlamaConfig(**_COMMON, num_hidden_layers=2, tie_word_embeddings=True, rope_parameters=rope)
    if name == "mistral":
        return tf.MistralConfig(**_COMMON, num_hidden_layers=2, sliding_window=4, head_dim=16)
    if name == "qwen2":
        return tf.Qwen2Config(**_COMMON, num_hidden_layers=2, tie_word_embeddings=True)
    if name == "qwen3":
        return tf.Qwen3Config(**_COMMON, num_hidden_layers=2, head_dim=32, tie_word_embeddings=False)
    if name == "gemma3":
        rope = {SLIDING: dict(rope_type="default", rope_theta=10000.0),
                FULL: dict(rope_type="linear", factor=4.0, rope_theta=1_000_000.0)}
        return tf.Gemma3TextConfig(
            **_COMMON, num_hidden_layers=3, head_dim=16, sliding_window=4, layer_types=[SLIDING, FULL, SLIDING],
            query_pre_attn_scalar=24, final_logit_softcapping=30.0, rope_parameters=rope,
        )
    raise ValueError(name)


ARCH_NAMES = ("llama", "llama3_rope", "mistral", "qwen2", "qwen3", "gemma3")


def build_hf_model(name: str, seed: int = 0, **config_overrides):
    """A randomly initialised transformers model (fp32, eager attention). Norm weights and biases are
    perturbed too, so a missing bias or a wrong norm variant cannot hide behind identity values.
    config_overrides: attributes set on tiny_config(name) first (e.g. num_key_value_heads=1)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(name)
    for key, value in config_overrides.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "norm" in pname or pname.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.2)
    return model.eval()


def save_tiny_checkpoint(name: str, path: Path, max_shard_size: str | None = None):
    """Build and save a tiny checkpoint; returns the transformers model (the oracle)."""
    model = build_hf_model(name)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), **kwargs)
    return model


# Tiny Gemma-3 VLM: a 32x32 image is 4x4 patches of 8, pooled to 2x2 = 4 soft tokens.
VLM_IMAGE_TOKEN, VLM_BOI, VLM_EOI = 300, 301, 302
VLM_IMAGE_SIZE = 32


VLM_NAMES = ("gemma3_vlm", "llava")


def tiny_vlm_config(name: str = "gemma3_vlm"):
    """gemma3_vlm: 4 soft tokens per 32x32 image between boi/eoi; llava: 16 image tokens (4x4 patches of a
    32x32 image, class token dropped) from the second-to-last of 3 CLIP layers, over the tiny llama."""
    import transformers as tf

    if name == "llava_next_video":  # frames of 4x4 patches average-pooled to 2x2: 4 video tokens per frame
        llava = tiny_vlm_config("llava")
        return tf.LlavaNextVideoConfig(
            text_config=llava.text_config, vision_config=llava.vision_config, image_token_index=VLM_BOI,
            video_token_index=VLM_IMAGE_TOKEN, spatial_pool_mode="average", spatial_pool_stride=2,
            vision_feature_layer=-2, vision_feature_select_strategy="default", eos_token_id=2, pad_token_id=0,
            image_grid_pinpoints=[[VLM_IMAGE_SIZE, VLM_IMAGE_SIZE]],
        )
    if name == "llava":
        vision = tf.CLIPVisionConfig(
            hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=3,
            image_size=VLM_IMAGE_SIZE, patch_size=8, projection_dim=16,
        )
        text = tiny_config("llama")
        text.max_position_embeddings = 1024  # room for DSPy's prompts
        return tf.LlavaConfig(text_config=text, vision_config=vision,
                              image_token_index=VLM_IMAGE_TOKEN, eos_token_id=2, pad_token_id=0)
    if name != "gemma3_vlm":
        raise ValueError(name)
    text = tiny_config("gemma3")
    text.max_position_embeddings = 1024  # room for DSPy's prompts
    vision = tf.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=2,
        image_size=VLM_IMAGE_SIZE, patch_size=8, vision_use_head=False, layer_norm_eps=1e-6,
    )
    return tf.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=VLM_IMAGE_TOKEN,
        boi_token_index=VLM_BOI, eoi_token_index=VLM_EOI, eos_token_id=2, pad_token_id=0,
    )


def save_tiny_vlm_checkpoint(path: Path, name: str = "gemma3_vlm", seed: int = 0):
    """A tiny random vision-language checkpoint plus its image processor (preprocessor_config.json), saved by
    transformers; returns (the transformers model, the transformers image processor)."""
    import transformers as tf

    torch.manual_seed(seed)
    cls = {"llava": tf.LlavaForConditionalGeneration, "llava_next_video": tf.LlavaNextVideoForConditionalGeneration
           }.get(name, tf.Gemma3ForConditionalGeneration)
    model = cls._from_config(tiny_vlm_config(name), attn_implementation="eager")
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "norm" in pname or pname.endswith("bias") or "class_embedding" in pname:
                param.add_(torch.randn_like(param) * 0.2)
            elif "mm_input_projection" in pname:
                param.normal_(0.0, 0.2)  # transformers initialises it to zeros: images would not matter
    model.eval().save_pretrained(str(path))
    if name in ("llava", "llava_next_video"):  # (LLaVA-NeXT-Video: the frames' processor)
        processor = tf.CLIPImageProcessorPil(size={"shortest_edge": VLM_IMAGE_SIZE},
                                             crop_size={"height": VLM_IMAGE_SIZE, "width": VLM_IMAGE_SIZE})
    else:
        processor = tf.Gemma3ImageProcessorPil(size={"height": VLM_IMAGE_SIZE, "width": VLM_IMAGE_SIZE})
    processor.save_pretrained(str(path))
    return model, processor
