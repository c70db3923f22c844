"""GrammarBackend.set_mask_threads: the parallel backends take a new thread count between fills (the masks they
fill are the same at any count); the row-by-row default has no threads and says so."""

from __future__ import annotations

import pytest
import torch

from prefixrt.constrained.base import GrammarBackend
from prefixrt.constrained.llguidance_backend import LLGuidanceBackend
from prefixrt.constrained.logits import allocate_bitmask

SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "integer"}},
          "required": ["a", "b"], "additionalProperties": False}


def _masks(backend, rows: int = 4) -> torch.Tensor:
    compiled = backend.compile("json_schema", SCHEMA)
    matchers = [backend.matcher(compiled) for _ in range(rows)]
    bitmask = allocate_bitmask(rows, backend.vocab_size)
    backend.fill_bitmasks([(m, i) for i, m in enumerate(matchers)], bitmask)
    return torch.as_tensor(bitmask).clone()


def test_llguidance_mask_threads(tiny_tokenizer):
    backend = LLGuidanceBackend(tiny_tokenizer, 320, [tiny_tokenizer.eos_token_id])
    ref = _masks(backend)
    for threads in (0, 1, 3):
        backend.set_mask_threads(threads)
        assert torch.equal(_masks(backend), ref)
    with pytest.raises(ValueError, match=">= 0"):
        backend.set_mask_threads(-1)


def test_xgrammar_mask_threads(tiny_tokenizer):
    xgrammar_backend = pytest.importorskip("prefixrt.constrained.xgrammar_backend")
    backend = xgrammar_backend.XGrammarBackend(tiny_tokenizer, 320, [tiny_tokenizer.eos_token_id])
    ref = _masks(backend)
    backend.set_mask_threads(1)
    assert torch.equal(_masks(backend), ref)
    with pytest.raises(ValueError, match=">= 1"):
        backend.set_mask_threads(0)


def test_the_row_by_row_default_has_no_threads(tiny_tokenizer):
    class RowByRow(LLGuidanceBackend):  # a backend that keeps the default (no parallel fill)
        set_mask_threads = GrammarBackend.set_mask_threads

    with pytest.raises(ValueError, match="RowByRow grammar backend fills masks on the calling thread only"):
        RowByRow(tiny_tokenizer, 320, [tiny_tokenizer.eos_token_id]).set_mask_threads(2)
