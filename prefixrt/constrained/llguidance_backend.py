"""llguidance backend (the default): Earley parser + lexer, token masks computed on the fly, canonical forced tokens.

Accepts: "regex" (Rust `regex` crate syntax: no look-around, no back-references), "json_schema"
(llguidance's JSON-schema subset; unknown keywords are an error, not silently ignored), "grammar" (Lark as
llguidance extends it, https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md, or llama.cpp
GBNF, converted to Lark), "choices", "json_object".
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch

from prefixrt.constrained import spec as specs
from prefixrt.constrained.base import CompiledGrammar, GrammarBackend, Matcher
from prefixrt.constrained.budget import BudgetMatcher
from prefixrt.constrained.logits import fill_only
from prefixrt.constrained.string_lengths import LengthRule, LengthTracker, TokenTable, split_lengths
from prefixrt.errors import InvalidRequest


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else message


def fill_row(matcher: llguidance.LLMatcher, bitmask: torch.Tensor, row: int) -> None:
    """Write matcher's next-token mask into bitmask[row] (a CPU int32 [B, words] tensor), natively. (llguidance.torch
    has the same wrapper, but importing that module imports torch._dynamo for a decorator: seconds of start-up.)"""
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
        raise ValueError("bitmask must be a contiguous CPU int32 tensor")
    words = bitmask[row]
    matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())


def fill_rows(executor: llguidance.LLExecutor, matchers: list, bitmask: torch.Tensor) -> None:
    """fill_row for (matcher, row) pairs, on the executor's threads."""
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
        raise ValueError("bitmask must be a contiguous CPU int32 tensor")
    executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])


class _Template:
    """A grammar's matcher at its start; every request's matcher is a `deep_copy` of it.

    llguidance builds its lexer's DFA lazily, state by state, as masks need them (most of a first mask's cost
    in a new lexer state), and each `LLMatcher` owns its lexer: a matcher made from the grammar text starts
    with none. A copy of the template starts with every state the template holds, and a request whose matcher
    completes the grammar hands its lexer back (`donate`: a copy of it, reset to the start, becomes the
    template), so later requests of the grammar start warm. The DFA is a cache of a pure function of the
    grammar: masks, forced tokens and acceptance are the same as a fresh matcher's (tests compare them).
    Donations stop after `max_generations`, so the lexer a request starts with is bounded by that many requests'
    states (llguidance's `max_lexer_states` limit applies per matcher). Thread-safe: the lock guards `matcher`.
    """

    max_generations = 8

    def __init__(self, matcher: llguidance.LLMatcher):
        self._lock = threading.Lock()
        self._m = matcher
        self.generation = 0

    def copy(self) -> llguidance.LLMatcher:
        with self._lock:
            return self._m.deep_copy()

    def donate(self, finished: llguidance.LLMatcher) -> None:
        """(The scheduler thread, which owns `finished`.) Adopt finished's lexer for the next requests."""
        if self.generation >= self.max_generations or finished.is_error():
            return
        fresh = finished.deep_copy()
        if not fresh.reset() or fresh.is_error():
            return
        with self._lock:
            if self.generation < self.max_generations:
                self._m = fresh
                self.generation += 1


class LLGuidanceMatcher(Matcher):
    """Wraps `llguidance.LLMatcher`. EOS is tracked here, not by llguidance, so that accepting and rolling
    back EOS behave like any other token (llguidance does not count an EOS toward rollback).

    It also keeps the tokens llguidance accepted (`_ids`) and a hash of every prefix of them (`_hashes`):
    two matchers of the same grammar that accepted the same tokens are in the same state and have the same
    mask, which `LLGuidanceBackend.fill_bitmasks` computes once for both."""

    def __init__(self, matcher: llguidance.LLMatcher, backend: LLGuidanceBackend, template: _Template | None = None,
                 grammar: _Grammar | None = None):
        self._m = matcher
        self._eos = backend.eos_token_ids
        self.vocab_size = backend.vocab_size
        self._num_accepted = 0
        self._eos_accepted = False
        self._template = template  # handed this matcher's lexer once it completes the grammar
        self._grammar = grammar  # None: never shares a mask
        self._ids: list[int] = []
        self._hashes: list[int] = [0]
        # The schema's string lengths, checked beside llguidance (string_lengths.py); None: none to check.
        self._lengths: LengthTracker | None = None
        if grammar is not None and grammar.lengths is not None:
            self._lengths = grammar.lengths.tracker()
            self._token_bytes = grammar.lengths.table.token_bytes
            self._tokenize = backend.ll_tokenizer.tokenize_bytes
            self._closing_cache: tuple | None = None  # (state, _closing_run's answer)

    def _record(self, token_ids: list[int]) -> None:
        h = self._hashes
        for t in token_ids:
            h.append(hash((h[-1], t)))
        self._ids.extend(token_ids)

    def _state_key(self) -> tuple | None:
        """Equal keys and equal `_ids` mean the same state (the caller compares `_ids` on a key match)."""
        if self._grammar is None:
            return None
        return (id(self._grammar), len(self._ids), self._hashes[-1])

    def _donate(self) -> None:
        if self._template is not None and self.is_finished():
            template, self._template = self._template, None
            template.donate(self._m)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._eos_accepted:
            fill_only(bitmask, row, self._eos)
            return
        fill_row(self._m, bitmask, row)
        self.narrow(bitmask, row)

    def narrow(self, bitmask: torch.Tensor, row: int) -> None:
        """Take from `bitmask[row]` (llguidance's mask) the tokens that would break a string length."""
        if self._lengths is not None and not self._eos_accepted:
            self.narrow_words(bitmask[row].numpy())

    def narrow_words(self, words: np.ndarray) -> None:
        """`narrow` on one row's int32 words (a numpy view of the bitmask row)."""
        if self._lengths is not None and not self._eos_accepted:
            self._lengths.narrow(words)
            closing = self._closing_run()
            if closing:  # as the grammar with the bound would: only the forced run's first token
                keep = closing[0]
                bit = (int(words[keep >> 5]) >> (keep & 31)) & 1
                words[:] = 0
                if bit:
                    words[keep >> 5] = np.int32(-(1 << 31)) if keep & 31 == 31 else np.int32(1 << (keep & 31))

    def _closing_run(self, alone_too: bool = False) -> list[int]:
        """At a bounded string's maximum the grammar with the bound forces the closing quote and what the grammar
        forces after it, as one run in the tokenizer's canonical tokens (e.g. `",` then ` "next_key":`). Here the
        quote is a choice, so that run is found on a copy: the quote accepted, llguidance's forced tokens after it,
        then the quote and those bytes tokenized together. Empty when not at a maximum or nothing is forced after
        the quote, except with alone_too (forced_tokens): then the quote itself where it is the only token left."""
        lengths = self._lengths
        if lengths is None or not lengths.at_maximum():
            return []
        state = (self._num_accepted, self._hashes[-1], alone_too)
        if self._closing_cache is None or self._closing_cache[0] != state:
            self._closing_cache = (state, self._closing_run_uncached(alone_too))
        return self._closing_cache[1]

    def _closing_run_uncached(self, alone_too: bool) -> list[int]:
        quote = self._lengths.table.quote_id
        twin = self._m.deep_copy()
        if quote is None or twin.validate_tokens([quote]) != 1 or not twin.consume_token(quote):
            return []
        after = [t for t in twin.compute_ff_tokens() if t not in self._eos]
        if after:
            return self._tokenize(b'"' + b"".join(self._token_bytes(t) for t in after))
        if alone_too:
            bitmask = torch.full((1, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
            self.fill_bitmask(bitmask, 0)
            if int((bitmask != 0).sum()) == 1 and int(bitmask[0, quote >> 5]) == 1 << (quote & 31):
                return [quote]
        return []

    def _lengths_take(self, token_ids: list[int]) -> tuple[int, LengthTracker | None]:
        """How many of token_ids (from the first) keep every string length, and the tracker after those (a new
        one: the matcher's is unchanged; None without lengths)."""
        if self._lengths is None:
            return len(token_ids), None
        state = self._lengths
        for n, t in enumerate(token_ids):
            probe = state.copy()
            if not probe.feed_token(t):
                return n, state
            state = probe
        return len(token_ids), state

    def _lengths_feed(self, token_ids: list[int]) -> None:
        if self._lengths is not None:
            for t in token_ids:
                self._lengths.feed_token(t)

    def accept_token(self, token_id: int) -> bool:
        if self._eos_accepted:
            return False
        if token_id in self._eos:
            if not self.can_stop():
                return False
            self._eos_accepted = True
        else:
            # consume_token on a rejected token would put llguidance in a permanent error state: check first.
            lengths = None
            if self._lengths is not None:  # fed on a copy: kept only if llguidance accepts the token too
                lengths = self._lengths.copy()
                if not lengths.feed_token(token_id):
                    return False
            if self._m.validate_tokens([token_id]) != 1 or not self._m.consume_token(token_id):
                return False
            if lengths is not None:
                self._lengths = lengths
            self._record([token_id])
        self._num_accepted += 1
        if self._template is not None and self.is_finished():
            self._donate()
        return True

    def accept_tokens(self, token_ids: list[int]) -> int:
        if self._eos_accepted or any(t in self._eos for t in token_ids):
            return super().accept_tokens(token_ids)
        n = self._m.validate_tokens(token_ids)
        n, lengths = self._lengths_take(token_ids[:n])
        if n and not self._m.consume_tokens(token_ids[:n]):
            raise RuntimeError(f"llguidance rejected tokens it had validated: {self._m.get_error()}")
        if lengths is not None:
            self._lengths = lengths
        self._record(token_ids[:n])
        self._num_accepted += n
        if self._template is not None and self.is_finished():
            self._donate()
        return n

    def rollback(self, num_tokens: int) -> None:
        remaining = self._rollback_count(num_tokens, self._num_accepted)
        if remaining and not self._m.rollback(remaining):
            raise RuntimeError(f"llguidance rollback failed: {self._m.get_error()}")
        if remaining:
            del self._ids[-remaining:]
            del self._hashes[-remaining:]
            if self._lengths is not None:  # its state is a function of the tokens: replay those kept
                self._lengths = self._lengths.rule.tracker()
                self._lengths_feed(self._ids)
        self._num_accepted -= num_tokens

    def fork(self) -> LLGuidanceMatcher:
        """An independent copy in the same state (llguidance cannot roll back past a max_tokens lexeme)."""
        twin = object.__new__(LLGuidanceMatcher)
        twin.__dict__.update(self.__dict__)
        twin._m = self._m.deep_copy()
        twin._ids, twin._hashes = list(self._ids), list(self._hashes)
        if self._lengths is not None:
            twin._lengths = self._lengths.copy()
        return twin

    def forced_tokens(self) -> list[int]:
        if self.is_finished():
            return []
        # (The grammar without the bounds never forces a string's characters, so its forced runs keep them; and
        # accept_tokens checks them all the same.)
        return [t for t in self._m.compute_ff_tokens() if t not in self._eos] or self._closing_run(alone_too=True)

    def is_finished(self) -> bool:
        return self._eos_accepted or self._m.is_stopped() or self._m.is_error()

    def can_stop(self) -> bool:
        return self._eos_accepted or (self._m.is_accepting() and not self._m.is_error())

    def error(self) -> str | None:
        return _first_line(self._m.get_error()) if self._m.is_error() else None


@dataclass(frozen=True)
class _Grammar:
    """A CompiledGrammar's handle: the llguidance grammar text and its template matcher."""

    text: str
    template: _Template
    lengths: LengthRule | None = None  # string lengths taken out of the grammar (string_lengths.py)


class LLGuidanceBackend(GrammarBackend):
    """llguidance for one tokenizer.

    tokenizer: a transformers fast tokenizer. vocab_size: the model's lm_head width (>= len(tokenizer);
    ids past the tokenizer are never allowed); None means len(tokenizer). eos_token_ids: the ids that end
    generation (default: the tokenizer's eos_token_id). json_whitespace_flexible: allow any whitespace
    between JSON tokens (default False: `json.dumps` layout, `, ` and `: `). limits: llguidance
    `LLParserLimits` (the defaults bound per-token work, so a pathological grammar errors, never hangs).
    mask_threads: threads for `fill_bitmasks` (llguidance's executor; 0: the calling thread).
    warm_lexer: start each request's matcher as a copy of the grammar's template (a lexer warmed by finished
    requests, see _Template) instead of a fresh matcher. Off by default: measured on an H200 host (Llama-3-8B
    shape, long-keys JSON at batch 64, 14 mask threads), the copies made the parallel mask fill several times
    slower (jump-forward on 2406 vs 6068 tok/s with fresh matchers), while on one thread they save ~12%.
    string_lengths: a JSON schema's maxLength / minLength, where `split_lengths` can place them, are checked
    beside the grammar (string_lengths.py: the same masks, several times cheaper) instead of compiled into it.
    """

    name = "llguidance"

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int | None = None,
        eos_token_ids: list[int] | tuple[int, ...] | None = None,
        *,
        json_whitespace_flexible: bool = False,
        limits: llguidance.LLParserLimits | None = None,
        mask_threads: int = 2,
        warm_lexer: bool = False,
        string_lengths: bool = True,
    ):
        self._set_vocab(tokenizer, vocab_size, eos_token_ids)
        self.warm_lexer = warm_lexer
        self.string_lengths = string_lengths
        self._table_lock = threading.Lock()
        self._token_table: TokenTable | None = None
        self._json_options: dict = (
            {"whitespace_flexible": True}
            if json_whitespace_flexible
            else {
                "whitespace_flexible": False,
                "item_separator": specs.JSON_ITEM_SEPARATOR,
                "key_separator": specs.JSON_KEY_SEPARATOR,
            }
        )
        self._limits = limits
        self._mask_threads = mask_threads
        self._executor: llguidance.LLExecutor | None = None
        self._executor_lock = threading.Lock()
        self.shared_mask_rows_total = 0  # rows whose mask was copied from a row in the same state (fill_bitmasks)
        self.ll_tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=self.vocab_size, eos_token=list(self.eos_token_ids)
        )

    @property
    def cache_namespace(self) -> tuple:
        return (
            self.name,
            id(self.tokenizer),  # the backend keeps the tokenizer alive, so the id is not reused
            self.vocab_size,
            self.eos_token_ids,
            tuple(sorted(self._json_options.items())),
            self.string_lengths,
        )

    # ------------------------------------------------------------------ compile
    def _grammar_text(self, kind: str, spec: Any) -> tuple[str, dict]:
        """(llguidance grammar text, the string bounds taken out of a JSON schema: string_lengths.py)."""
        specs.check_kind(kind)
        if kind == "regex":
            # \\d means [0-9] (as in JSON Schema patterns and in xgrammar), not Rust's Unicode digits.
            lark_regex = llguidance.regex_to_lark(specs.check_text(kind, spec), use_ascii="d")
            return llguidance.LLMatcher.grammar_from_lark(f"start: /{lark_regex}/"), {}
        if kind in ("json_schema", "json_object"):
            schema = specs.JSON_OBJECT_SCHEMA if kind == "json_object" else specs.load_json_schema(spec)
            specs.check_json_schema_refs(schema)
            bounds: dict = {}
            if self.string_lengths:
                schema, bounds = split_lengths(schema)
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=self._json_options), bounds
            except ValueError as e:
                raise InvalidRequest(f"invalid json_schema: {e}", param="json_schema") from e
        if kind == "grammar":
            try:
                return llguidance.grammar_from("grammar", specs.check_text(kind, spec)), {}
            except ValueError as e:  # GBNF -> Lark conversion failed
                raise InvalidRequest(f"invalid grammar: {e}", param="grammar") from e
        choices = specs.check_choices(spec)
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(specs.lark_string_literal(c) for c in choices)
        ), {}

    def token_table(self) -> TokenTable:
        """The tokenizer's TokenTable for string lengths (built on first use, ~1-3 s for 128k tokens)."""
        with self._table_lock:
            if self._token_table is None:
                raw = [self.ll_tokenizer.decode_bytes([t]) for t in range(len(self.tokenizer))]
                self._token_table = TokenTable(raw, self.vocab_size)
            return self._token_table

    def compile(self, kind: str, spec: Any) -> CompiledGrammar:
        spec_text = specs.canonical_spec(kind, spec)
        grammar, bounds = self._grammar_text(kind, spec)
        param = specs._param_for(kind)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.ll_tokenizer, limits=self._limits
        )
        if is_error:
            raise InvalidRequest(f"invalid {kind}: {messages[0].strip()}", param=param)
        # Some grammars are well-formed yet match nothing ({"$ref": "#"}): llguidance only finds out when
        # it computes the first mask. Find out now, at submit time, instead of mid-generation.
        probe = llguidance.LLMatcher(self.ll_tokenizer, grammar, limits=self._limits, log_level=0)
        if not probe.is_error():
            probe.compute_bitmask()
        if probe.is_error():
            raise InvalidRequest(f"{kind} matches no output: {_first_line(probe.get_error())}", param=param)
        lengths = LengthRule(bounds, self.token_table()) if bounds else None
        return CompiledGrammar(kind=kind, spec_text=spec_text, backend_name=self.name,
                               handle=_Grammar(grammar, _Template(probe), lengths))

    def matcher(self, compiled: CompiledGrammar) -> LLGuidanceMatcher:
        if compiled.backend_name != self.name:
            raise ValueError(f"grammar compiled by {compiled.backend_name}, not {self.name}")
        if self.warm_lexer:
            template = compiled.handle.template
            m = template.copy()
        else:
            template = None
            m = llguidance.LLMatcher(self.ll_tokenizer, compiled.handle.text, limits=self._limits, log_level=0)
        if m.is_error():
            raise InvalidRequest(f"invalid {compiled.kind}: {_first_line(m.get_error())}")
        return LLGuidanceMatcher(m, self, template, compiled.handle)

    def token_text(self, token_id: int) -> str:
        return self.ll_tokenizer.decode_bytes([token_id]).decode("utf-8", errors="replace")

    def set_mask_threads(self, threads: int) -> None:
        """Threads for the next `fill_bitmasks` calls (0: the calling thread). Call between fills (the engine's
        loop thread between steps): the executor is rebuilt on the next fill."""
        if threads < 0:
            raise ValueError(f"mask threads must be >= 0, got {threads}")
        with self._executor_lock:
            self._mask_threads, self._executor = threads, None

    def fill_bitmasks_native(self, rows: list[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
        """llguidance's masks: rows whose matchers are in the same state (same grammar, same accepted tokens: often
        so for the rows of one schema at the same point of its fixed text) are computed once and copied; the other
        llguidance rows in parallel on the executor (mask_threads 0: on this thread); other matchers row by row.
        The string-length and budget rules are `finish_bitmasks`'."""
        rows = [(m.inner if isinstance(m, BudgetMatcher) else m, row) for m, row in rows]
        native: list[tuple[llguidance.LLMatcher, int]] = []
        rest: list[tuple[Matcher, int]] = []
        copies: list[tuple[int, int]] = []  # (row computed, row that gets its mask)
        leaders: dict[tuple, list[tuple[LLGuidanceMatcher, int]]] = {}
        for m, row in rows:
            if not isinstance(m, LLGuidanceMatcher) or m._eos_accepted:
                rest.append((m, row))
                continue
            key = m._state_key()
            if key is not None:
                same = leaders.setdefault(key, [])
                lead = next((r for other, r in same if other._ids == m._ids), None)
                if lead is not None:
                    copies.append((lead, row))
                    continue
                same.append((m, row))
            native.append((m._m, row))
        if len(native) > 1 and self._mask_threads > 0:
            with self._executor_lock:
                if self._executor is None:
                    self._executor = llguidance.LLExecutor(num_threads=self._mask_threads)
            fill_rows(self._executor, native, bitmask)
        else:
            for m, row in native:
                fill_row(m, bitmask, row)
        for m, row in rest:
            m.fill_bitmask(bitmask, row)
        for lead, row in copies:
            bitmask[row].copy_(bitmask[lead])
        self.shared_mask_rows_total += len(copies)

    def finish_bitmasks(self, rows: list[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
        """The rows' string lengths (`LLGuidanceMatcher.narrow`), then the budget rule of BudgetMatcher rows."""
        words = None
        for m, row in rows:
            inner = m.inner if isinstance(m, BudgetMatcher) else m
            if isinstance(inner, LLGuidanceMatcher) and inner._lengths is not None and not inner._eos_accepted:
                if words is None:
                    words = bitmask.numpy()
                inner.narrow_words(words[row])
        for m, row in rows:
            if isinstance(m, BudgetMatcher):
                m.steer(bitmask, row)
