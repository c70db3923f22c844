"""xgrammar backend: pushdown automaton with precomputed token-mask caches (fast masks, GPU apply kernels).

Accepts: "regex" (xgrammar's regex dialect, ECMAScript-like), "json_schema" (xgrammar's subset; in strict
mode properties not listed are not generated), "grammar" (GBNF/EBNF as in llama.cpp with root rule `root`
when the text contains `::=`, otherwise Lark with a `start` rule), "choices", "json_object".

Two things are done here rather than trusted to xgrammar:
  * forced tokens: xgrammar's `find_jump_forward_tokens` matches the longest vocabulary entries greedily,
    which can differ from the tokenizer's own (canonical) tokenization. We take xgrammar's forced *text*
    and tokenize it with the real tokenizer, holding back every token that a continuation could change.
  * special tokens: xgrammar lets added special tokens (e.g. `<|im_start|>`) match their literal text, so
    one could land inside a JSON string; we mask every special id except EOS.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import xgrammar as xgr

from prefixrt.constrained import spec as specs
from prefixrt.constrained.base import CompiledGrammar, GrammarBackend, Matcher
from prefixrt.constrained.logits import allocate_bitmask, allowed_token_ids, fill_only, pack_bitmask
from prefixrt.errors import InvalidRequest

_CPP_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+\.(cc|h):\d+:\s*")
_MAX_PROBES = 64  # continuations tried when checking which forced tokens are stable
# Used when too many tokens may follow the forced text to try them all: one of each character class.
_GENERIC_PROBES = ("a", "A", "0", " ", "\n", '"', ",", ".", "_", "-", ":", "}", "]", "{", "é")


def _clean(e: Exception) -> str:
    return _CPP_PREFIX.sub("", str(e)).strip()


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class XGrammarMatcher(Matcher):
    """Wraps `xgrammar.GrammarMatcher`; EOS is tracked here so it rolls back like any token."""

    def __init__(self, matcher: xgr.GrammarMatcher, backend: XGrammarBackend, kind: str):
        self._m = matcher
        self._backend = backend
        self._json = kind in ("json_schema", "json_object")
        self._sampleable_mask = backend.json_sampleable_mask if self._json else backend.sampleable_mask
        self._eos = backend.eos_token_ids
        self.vocab_size = backend.vocab_size
        self._num_accepted = 0
        self._eos_accepted = False
        self._version = 0  # bumped on every state change; keys the cached mask
        self._cached_mask: torch.Tensor | None = None
        self._cached_version = -1

    def _mask(self) -> torch.Tensor:
        """The current allowed mask as one CPU row (cached until the state changes)."""
        if self._cached_version != self._version:
            if self._cached_mask is None:
                self._cached_mask = allocate_bitmask(1, self.vocab_size)
            self._m.fill_next_token_bitmask(self._cached_mask, 0)
            self._cached_mask[0] &= self._sampleable_mask
            self._cached_version = self._version
        return self._cached_mask

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._eos_accepted:
            fill_only(bitmask, row, self._eos)
            return
        bitmask[row].copy_(self._mask()[0])

    def accept_token(self, token_id: int) -> bool:
        if self._eos_accepted or not self._backend.is_sampleable(token_id, self._json):
            return False
        if token_id in self._eos:
            if not self._m.is_completed():
                return False
            self._eos_accepted = True
        elif not self._m.accept_token(token_id):
            return False
        self._num_accepted += 1
        self._version += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        remaining = self._rollback_count(num_tokens, self._num_accepted)
        if remaining:
            self._m.rollback(remaining)
        self._num_accepted -= num_tokens
        self._version += 1

    def is_finished(self) -> bool:
        if self._eos_accepted or self._m.is_terminated():
            return True
        if not self._m.is_completed():
            return False
        allowed = allowed_token_ids(self._mask(), 0, self.vocab_size).tolist()
        return all(t in self._eos for t in allowed)

    def can_stop(self) -> bool:
        return self._eos_accepted or self._m.is_completed()

    def forced_tokens(self) -> list[int]:
        if self.is_finished():
            return []
        text = self._m.find_jump_forward_string()
        if not text:
            return []
        tokens = self._backend.stable_tokens(text, self._continuations(text))
        # Accept-then-undo: a token the grammar rejects (it cannot, but cheap to be sure) ends the run.
        n = 0
        for t in tokens:
            if not self._m.accept_token(t):
                break
            n += 1
        if n:
            self._m.rollback(n)
        return tokens[:n]

    def _continuations(self, forced_text: str) -> list[str] | None:
        """Texts that may follow `forced_text` (one per allowed next token), or None if there are too many.
        "" stands for the end of the output."""
        if not self._m.accept_string(forced_text):
            return None
        try:
            probe = allocate_bitmask(1, self.vocab_size)
            self._m.fill_next_token_bitmask(probe, 0)
            probe[0] &= self._sampleable_mask
            allowed = allowed_token_ids(probe, 0, self.vocab_size).tolist()
        finally:
            self._m.rollback(1)  # accept_string counts as one step
        if len(allowed) > _MAX_PROBES:
            return None
        return ["" if t in self._eos else self._backend.token_text(t) for t in allowed]


class XGrammarBackend(GrammarBackend):
    """xgrammar for one tokenizer. Arguments as for `LLGuidanceBackend`, plus:

    strict_json: do not generate properties/items the schema does not list (xgrammar's strict_mode).
    compile_threads: threads xgrammar uses inside one compilation.
    """

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int | None = None,
                 eos_token_ids: list[int] | tuple[int, ...] | None = None, *, json_whitespace_flexible: bool = False,
                 strict_json: bool = True, compile_threads: int = 1, mask_threads: int = 2):
        """mask_threads: threads for `fill_bitmasks` (xgrammar's BatchGrammarMatcher)."""
        self._set_vocab(tokenizer, vocab_size, eos_token_ids)
        self._mask_threads = mask_threads
        self._batch_matcher = None
        num_tokenizer_ids = len(tokenizer)
        self._json_whitespace_flexible = json_whitespace_flexible
        self._strict_json = strict_json
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(self.eos_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=compile_threads, cache_enabled=False)
        self._decoded_vocab: list[bytes] | None = None
        special = {
            i for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(tok, "special", False)
        }
        special.update(getattr(tokenizer, "all_special_ids", []) or [])
        self._special_ids = frozenset(special) - set(self.eos_token_ids)
        # Ids a matcher may ever allow: real tokens that are not special, plus EOS. Padding ids stay 0.
        sampleable = torch.zeros(1, self.vocab_size, dtype=torch.bool)
        sampleable[0, :num_tokenizer_ids] = True
        sampleable[0, sorted(self._special_ids)] = False
        self.sampleable_mask = pack_bitmask(sampleable)[0]  # int32 [W]
        # xgrammar's JSON strings admit raw control characters (U+0000..U+001F), which JSON forbids. In
        # compact layout no control character is valid anywhere in the output; with flexible whitespace
        # only \t \n \r (between tokens) are.
        allowed_controls = b"\t\n\r" if json_whitespace_flexible else b""
        bad = [i for i, raw in enumerate(self.tokenizer_info.decoded_vocab[:num_tokenizer_ids])
               if any(b < 0x20 and b not in allowed_controls for b in raw)]
        json_sampleable = sampleable.clone()
        json_sampleable[0, bad] = False
        json_sampleable[0, list(self.eos_token_ids)] = True
        self.json_sampleable_mask = pack_bitmask(json_sampleable)[0]
        self._json_unsampleable_ids = frozenset(bad) - set(self.eos_token_ids)

    def set_mask_threads(self, threads: int) -> None:
        """Threads of xgrammar's batch fill for the next `fill_bitmasks` calls (at least 1). Call between fills
        (the engine's loop thread between steps): the batch matcher is rebuilt on the next fill."""
        if threads < 1:
            raise ValueError(f"xgrammar mask threads must be >= 1, got {threads}")
        self._mask_threads, self._batch_matcher = threads, None

    def fill_bitmasks_native(self, rows: list[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
        """Several rows at once: xgrammar's batch fill (its own threads, outside the GIL), then each row
        narrowed to what it may sample, as fill_bitmask does row by row."""
        native = [(m, row) for m, row in rows if isinstance(m, XGrammarMatcher) and not m._eos_accepted]
        if len(native) < 2:
            return super().fill_bitmasks_native(rows, bitmask)
        if self._batch_matcher is None:
            self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=self._mask_threads)
        self._batch_matcher.batch_fill_next_token_bitmask([m._m for m, _ in native], bitmask,
                                                          [row for _, row in native])
        for json_kind, mask in ((True, self.json_sampleable_mask), (False, self.sampleable_mask)):
            idx = [row for m, row in native if m._json == json_kind]
            if idx:
                bitmask[idx] &= mask
        for m, row in rows:
            if not (isinstance(m, XGrammarMatcher) and not m._eos_accepted):
                m.fill_bitmask(bitmask, row)

    @property
    def cache_namespace(self) -> tuple:
        return (
            self.name,
            id(self.tokenizer),
            self.vocab_size,
            self.eos_token_ids,
            self._json_whitespace_flexible,
            self._strict_json,
        )

    def is_sampleable(self, token_id: int, json: bool = False) -> bool:
        """Whether a matcher may ever allow `token_id` (beyond what the grammar says)."""
        if json and token_id in self._json_unsampleable_ids:
            return False
        return 0 <= token_id < len(self.tokenizer) and token_id not in self._special_ids

    def token_text(self, token_id: int) -> str:
        if self._decoded_vocab is None:
            self._decoded_vocab = self.tokenizer_info.decoded_vocab
        return self._decoded_vocab[token_id].decode("utf-8", errors="ignore")

    def stable_tokens(self, text: str, continuations: list[str] | None) -> list[int]:
        """The longest prefix of the tokenizer's encoding of `text` that no continuation can change.

        `continuations`: the texts of the tokens that may follow ("" = end of output), or None if there are
        too many to try; then generic probes stand in and the last token is always held back. With the exact
        list, a token is kept iff no allowed next token merges with it (one token of lookahead: enough for
        pre-tokenized BPE vocabularies, where merges do not cross pre-token boundaries).
        """
        encode = self.tokenizer.backend_tokenizer.encode_batch
        probes = list(_GENERIC_PROBES) if continuations is None else sorted(set(continuations))
        encodings = encode([text] + [text + p for p in probes], add_special_tokens=False)
        tokens = encodings[0].ids
        keep = len(tokens)
        for enc in encodings[1:]:
            keep = min(keep, _common_prefix_len(tokens, enc.ids))
        # Without the exact list of next tokens, the last token could still merge with text no probe tried.
        if continuations is None:
            keep = min(keep, len(tokens) - 1)
        return tokens[: max(keep, 0)]

    # ------------------------------------------------------------------ compile
    def _compile(self, kind: str, spec: Any) -> xgr.CompiledGrammar:
        if kind == "regex":
            return self._compiler.compile_regex(specs.check_text(kind, spec))
        if kind in ("json_schema", "json_object"):
            schema = specs.JSON_OBJECT_SCHEMA if kind == "json_object" else specs.load_json_schema(spec)
            specs.check_json_schema_refs(schema)
            return self._compiler.compile_json_schema(
                specs.canonical_spec("json_schema", schema),
                any_whitespace=self._json_whitespace_flexible,
                separators=None
                if self._json_whitespace_flexible
                else (specs.JSON_ITEM_SEPARATOR, specs.JSON_KEY_SEPARATOR),
                strict_mode=self._strict_json,
            )
        if kind == "grammar":
            text = specs.check_text(kind, spec)
            if "::=" in text:
                return self._compiler.compile_grammar(text, root_rule_name="root")
            return self._compiler.compile_lark(text)
        choices = specs.check_choices(spec)
        return self._compiler.compile_grammar(
            "root ::= " + " | ".join(specs.lark_string_literal(c) for c in choices), root_rule_name="root"
        )

    def compile(self, kind: str, spec: Any) -> CompiledGrammar:
        spec_text = specs.canonical_spec(kind, spec)
        param = specs._param_for(kind)
        try:
            compiled = self._compile(kind, spec)
        except InvalidRequest:
            raise
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidRequest(f"invalid {kind}: {_clean(e)}", param=param) from e
        result = CompiledGrammar(kind=kind, spec_text=spec_text, backend_name=self.name, handle=compiled)
        probe = self.matcher(result)
        if not probe.can_stop() and all(t in self.eos_token_ids for t in allowed_token_ids(probe._mask(), 0).tolist()):
            raise InvalidRequest(f"{kind} matches no output", param=param)
        return result

    def matcher(self, compiled: CompiledGrammar) -> XGrammarMatcher:
        if compiled.backend_name != self.name:
            raise ValueError(f"grammar compiled by {compiled.backend_name}, not {self.name}")
        m = xgr.GrammarMatcher(compiled.handle, override_stop_tokens=list(self.eos_token_ids))
        return XGrammarMatcher(m, self, compiled.kind)
