"""The start-up line says where the time went: a registry model's first start (its GGUF converted, as the embedded
models' is) names the conversion's stages and the engine's, and they cover at least 90% of the start-up; the
second start reuses the folder and names no conversion stage. On a tiny GGUF written from a tiny model."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("gguf")

from prefixrt.hub import catalogue, materialize  # noqa: E402
from prefixrt.hub.gguf_import import convert_gguf_to_hf  # noqa: E402
from tests.helpers.checkpoints import build_hf_model  # noqa: E402
from tests.helpers.engines import make_tiny_tokenizer  # noqa: E402
from tests.helpers.tiny_gguf import write_tiny_llama_gguf  # noqa: E402

NAME = "tiny-gguf-llama"
CONVERSION = ["read GGUF", "dequantize", "tokenizer from GGUF", "write shards", "verify"]
ENGINE = ["resolve", "tokenizer", "load weights", "assemble", "KV pool"]
LINE = re.compile(r"start-up: (?P<total>[\d.]+)s: (?P<stages>.*) \((?P<share>\d+)% named\)$")


@pytest.fixture
def tiny_entry(tmp_path, monkeypatch):
    """A registry name whose folder is converted from a tiny GGUF, in a cache dir of the test's own."""
    gguf_file = write_tiny_llama_gguf(tmp_path / "tiny.gguf", build_hf_model("llama"), make_tiny_tokenizer())
    monkeypatch.setenv("PREFIXRT_CACHE_DIR", str(tmp_path / "cache"))
    entry = catalogue.Entry(
        name=NAME, kind="embedded", params="0.1M", description="tiny GGUF", chat_template=None,
        extra_eos_token_ids=(), build=lambda out_dir, clock: convert_gguf_to_hf(gguf_file, out_dir, clock=clock),
        is_available=lambda: None,
    )
    monkeypatch.setitem(catalogue.ENTRIES, NAME, entry)
    return tmp_path / "cache" / NAME


def start(messages: list[str]):
    from prefixrt.engine.engine import Engine

    eng = Engine(NAME, device="cpu", dtype="float32", kv_cache_tokens=2048, progress=messages.append)
    try:
        assert eng.generate([1, 5, 9], {"max_new_tokens": 2, "temperature": 0}).completion_tokens == 2
        return dict(eng._built.startup)
    finally:
        eng.shutdown()


def parse(messages: list[str]) -> tuple[float, dict[str, float], int]:
    (match,) = [m for m in map(LINE.match, messages) if m]
    stages = dict((name, float(s)) for name, s in re.findall(r"([^,]+?) ([\d.]+)s(?:, |$)", match["stages"]))
    return float(match["total"]), stages, int(match["share"])


def test_first_start_names_the_conversion_and_engine_stages(tiny_entry):
    messages: list[str] = []
    startup = start(messages)
    total, stages, share = parse(messages)
    assert [s for s in stages if s in CONVERSION] == CONVERSION and set(ENGINE) <= set(stages), stages
    assert total == pytest.approx(startup["total_s"], abs=0.051)
    assert stages["other"] == pytest.approx(startup["total_s"] - sum(startup["stages"].values()), abs=0.051)
    assert share >= 90, messages
    assert sum(startup["stages"].values()) >= 0.9 * startup["total_s"], startup["stages"]
    assert set(startup["stages"]) == set(stages) - {"other"}
    assert (tiny_entry / materialize.MARKER_FILE).is_file()  # converted into the test's cache dir


def test_second_start_reuses_the_folder_and_converts_nothing(tiny_entry):
    start([])
    messages: list[str] = []
    startup = start(messages)
    _, stages, share = parse(messages)
    assert not set(CONVERSION) & set(stages), stages
    assert set(ENGINE) <= set(stages), messages
    # A second start of a tiny model takes tens of milliseconds, where a few milliseconds of interpreter noise are
    # a tenth: the unnamed rest is held to 10% or 20 ms, whichever is larger.
    unnamed = startup["total_s"] - sum(startup["stages"].values())
    assert share >= 90 or unnamed <= 0.02, (messages, unnamed)
    assert set(startup["stages"]) == set(stages) - {"other"}
