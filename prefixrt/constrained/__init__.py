"""Constrained decoding: grammars (regex, JSON schema, Lark/GBNF, choices) -> per-token masks and forced tokens.

base.py     the interface (Matcher, GrammarBackend, CompiledGrammar) and the engine contract
spec.py     backend-independent spec validation, canonical cache keys, JSON-schema $ref checks
llguidance_backend.py / xgrammar_backend.py   the two backends (llguidance is the default)
compiler.py GrammarCompiler: thread pool + cache + timeout, used at submit time
logits.py   bitmask allocation and application to logits (CPU and CUDA)
"""

from __future__ import annotations

from typing import Any

from prefixrt.constrained.base import CONSTRAINT_KINDS, CompiledGrammar, GrammarBackend, Matcher
from prefixrt.constrained.compiler import GrammarCompiler
from prefixrt.constrained.logits import allocate_bitmask, apply_token_bitmask

BACKENDS = ("llguidance", "xgrammar")


def make_backend(
    name: str, tokenizer: Any, vocab_size: int | None = None, eos_token_ids: list[int] | None = None, **options
) -> GrammarBackend:
    """A backend by name ("llguidance" or "xgrammar"); the library is imported only when chosen."""
    if name == "llguidance":
        from prefixrt.constrained.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(tokenizer, vocab_size, eos_token_ids, **options)
    if name == "xgrammar":
        from prefixrt.constrained.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, vocab_size, eos_token_ids, **options)
    raise ValueError(f"unknown grammar backend {name!r}; expected one of {', '.join(BACKENDS)}")


__all__ = [
    "BACKENDS",
    "CONSTRAINT_KINDS",
    "CompiledGrammar",
    "GrammarBackend",
    "GrammarCompiler",
    "Matcher",
    "allocate_bitmask",
    "apply_token_bitmask",
    "make_backend",
]
