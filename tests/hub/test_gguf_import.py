"""GGUF -> Hugging Face folder on a tiny Llama GGUF written from a tiny transformers model (tests/helpers/tiny_gguf.py):
the folder holds exactly the model's weights (float32 GGUF) or their Q8_0 round trip, transformers runs it to the
same logits, the file is parsed once per conversion, and the conversion's stages are timed on the clock."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

import gguf  # noqa: E402

from prefixrt.hub.gguf_import import convert_gguf_to_hf  # noqa: E402
from prefixrt.stage_clock import StageClock  # noqa: E402
from tests.helpers.checkpoints import build_hf_model  # noqa: E402
from tests.helpers.engines import make_tiny_tokenizer  # noqa: E402
from tests.helpers.tiny_gguf import write_tiny_llama_gguf  # noqa: E402

PROMPT = [1, 45, 200, 17, 99, 3, 250]


@pytest.fixture(scope="module")
def hf_model():
    return build_hf_model("llama")


def _converted(tmp_path: Path, hf_model, quantize: bool, clock=None) -> Path:
    gguf_file = write_tiny_llama_gguf(tmp_path / "tiny.gguf", hf_model, make_tiny_tokenizer(), quantize_q8_0=quantize)
    convert_gguf_to_hf(gguf_file, tmp_path / "out", chat_template="{{ messages[0]['content'] }}", clock=clock)
    return tmp_path / "out"


def _reload(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()


def test_float32_gguf_converts_to_the_same_weights_and_logits(tmp_path, hf_model):
    folder = _converted(tmp_path, hf_model, quantize=False)
    converted = _reload(folder)
    want = hf_model.state_dict()
    got = converted.state_dict()
    assert set(got) == set(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []  # q/k un-permuted, every name mapped
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        assert torch.equal(converted(ids).logits, hf_model(ids).logits)
    assert converted.config.rms_norm_eps == 1e-6  # float32 metadata written as the short decimal


def test_q8_0_gguf_converts_to_the_dequantized_blocks(tmp_path, hf_model):
    folder = _converted(tmp_path, hf_model, quantize=True)
    got = _reload(folder).state_dict()
    for name, tensor in hf_model.state_dict().items():
        if tensor.dim() == 2:
            weights = tensor.numpy()
            round_trip = gguf.quants.dequantize(gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q8_0),
                                                gguf.GGMLQuantizationType.Q8_0)
            assert np.array_equal(got[name].numpy(), round_trip), name
            assert not torch.equal(got[name], tensor), name  # the blocks really were dequantized
        else:
            assert torch.equal(got[name], tensor), name


def test_the_file_is_parsed_once_and_the_name_map_built_once(tmp_path, hf_model, monkeypatch):
    parses, maps = [], []

    class CountingReader(gguf.GGUFReader):
        def __init__(self, path, *args, **kwargs):
            parses.append(str(path))
            super().__init__(path, *args, **kwargs)

    original_map = gguf.get_tensor_name_map

    def counting_map(arch, n_blocks):
        maps.append((arch, n_blocks))
        return original_map(arch, n_blocks)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    monkeypatch.setattr(gguf, "get_tensor_name_map", counting_map)
    clock = StageClock()
    _converted(tmp_path, hf_model, quantize=True, clock=clock)
    assert parses == [str(tmp_path / "tiny.gguf")]  # config, tokenizer's config and tensors share one parse
    assert len(maps) == 1  # transformers asks once per submodule
    assert gguf.GGUFReader is CountingReader and gguf.get_tensor_name_map is counting_map  # put back
    assert list(clock.seconds) == ["import transformers", "read GGUF", "dequantize", "tokenizer from GGUF",
                                   "write shards", "verify"]
    assert clock.named() <= clock.total()
