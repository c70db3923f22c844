"""The constrained-decoding seam: a compiled grammar, a per-request matcher, and the backend that makes both.

How the engine uses it (the whole contract, in order):

    compiler = GrammarCompiler(LLGuidanceBackend(tokenizer, vocab_size, eos_token_ids))  # once per engine
    # submit time, in the CALLER's thread (never the scheduler's): may block up to the timeout
    compiled = compiler.compile("json_schema", schema)          # InvalidRequest -> HTTP 400, nothing scheduled
    matcher = compiler.backend.matcher(compiled)                 # one per request (one per sample when n > 1)
    prefill += matcher.forced_tokens(); matcher.accept_tokens(those)   # step 0: forced text joins the prefill
    # every decode step, in the scheduler thread, for each constrained row i of the batch:
    bitmask = allocate_bitmask(batch, backend.vocab_size)        # CPU int32 [B, ceil(V/32)]; reuse it across steps
    matcher.fill_bitmask(bitmask, i)                             # unconstrained rows: leave them all-ones (-1)
    apply_token_bitmask(logits, bitmask.to(logits.device))       # logits [B, V_model], in place
    token = sample(logits[i])
    matcher.accept_token(token)                                  # False only if the sampler ignored the mask
    if matcher.is_finished(): finish the request
    else: forced = matcher.forced_tokens(); accept them; schedule them as a multi-token extend next step

Ownership and mutation:
  * `CompiledGrammar` is immutable and shared: the compiler's cache hands the same object to every request
    with the same (kind, spec); it is safe to use from any thread.
  * A `Matcher` is owned by exactly one request and mutated only by it (accept_token / accept_tokens /
    rollback). It is not thread-safe; the scheduler thread is its only user after creation.
  * `fill_bitmask` writes one row of a bitmask the caller owns; it never changes the matcher.
  * `forced_tokens`, `is_finished`, `can_stop` are queries: they never change what the matcher accepted.
  * A `GrammarBackend` holds the tokenizer-derived tables (built once, ~1 s for a 150k vocab) and is
    shared read-only by all threads; `compile` is thread-safe.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal

import torch

ConstraintKind = Literal["regex", "json_schema", "grammar", "choices", "json_object"]
CONSTRAINT_KINDS: tuple[str, ...] = ("regex", "json_schema", "grammar", "choices", "json_object")


@dataclass(frozen=True)
class CompiledGrammar:
    """A grammar compiled for one backend and one tokenizer. Immutable; share it freely.

    `spec_text` is the canonical text the cache keys on (see `spec.canonical_spec`); `handle` is the
    backend's own object (llguidance: the grammar text and a template matcher; an `xgrammar.CompiledGrammar`), opaque
    to callers.
    """

    kind: str
    spec_text: str
    backend_name: str
    handle: Any


class Matcher(ABC):
    """Per-request grammar state: which tokens may come next, given the tokens accepted so far.

    Token ids are the model's ids in [0, vocab_size). Ids past the tokenizer's vocabulary (lm_head
    padding) are never allowed. A matcher starts before the first generated token: the prompt is
    not part of what it matches.
    """

    vocab_size: int  # the model's vocab size (bit width of one mask row is 32 * ceil(vocab_size / 32))

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-next-token mask into `bitmask[row]` (bit t of the row is 1 iff token t is allowed).

        `bitmask`: CPU int32 tensor [B, ceil(vocab_size / 32)], C-contiguous (from `allocate_bitmask`).
        Mutates only that row; the matcher is unchanged. EOS ids are allowed exactly when `can_stop()`.
        After the matcher is finished, only the EOS ids are allowed (a row that is never all-zero).
        """

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance past one token. Returns False if the grammar rejects it; the matcher is then unchanged.

        Accepting an EOS id while `can_stop()` finishes the matcher.
        """

    def accept_tokens(self, token_ids: list[int]) -> int:
        """Accept tokens in order until one is rejected; returns how many were accepted (rollback-able)."""
        for n, token_id in enumerate(token_ids):
            if not self.accept_token(token_id):
                return n
        return len(token_ids)

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (e.g. rejected speculative tokens). Mutates the matcher.

        Raises ValueError if fewer than `num_tokens` tokens were accepted.
        """

    def _rollback_count(self, num_tokens: int, num_accepted: int) -> int:
        """The start of rollback() for a matcher that counts accepted tokens in `num_accepted` and marks an
        accepted EOS (outside its grammar engine) in `self._eos_accepted`: checks the count, un-accepts the EOS
        if it is among the tokens undone, and returns how many grammar tokens remain to undo."""
        if not 0 <= num_tokens <= num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: only {num_accepted} accepted")
        if num_tokens and self._eos_accepted:
            self._eos_accepted = False
            return num_tokens - 1
        return num_tokens

    @abstractmethod
    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next, to be fed as one multi-token extend (jump-forward).

        Does not accept them: the caller calls `accept_tokens(forced)` when it schedules them.
        They are the tokenizer's canonical tokenization of the forced text, and the last token that
        could merge with text the grammar allows after it is held back (so `{"name": "` never ends in a
        token that a sampled continuation would have absorbed). Never re-tokenizes what was already
        accepted. Empty when nothing is forced or the matcher is finished; never contains EOS.
        """

    @abstractmethod
    def is_finished(self) -> bool:
        """True once no further token but EOS can be accepted: EOS was accepted, the grammar is complete
        and cannot be extended (e.g. `(yes|no)` after "yes"), or the matcher hit an error (see `error`).
        The engine should then end the request (finish_reason "stop")."""

    @abstractmethod
    def can_stop(self) -> bool:
        """True if the text so far is a complete match, i.e. EOS is allowed now."""

    def error(self) -> str | None:
        """A message if the matcher stopped on an internal error (e.g. a parser resource limit), else None.

        The engine should abort the request with this message rather than return a truncated match.
        """
        return None


class GrammarBackend(ABC):
    """Turns a constraint spec into a `CompiledGrammar` and makes per-request `Matcher`s for it.

    Built once per (tokenizer, model vocab size, EOS ids); shared by all threads. Kinds:
      "regex"        a regular expression the whole output must fully match
      "json_schema"  a dict, JSON text, or a pydantic BaseModel subclass
      "grammar"      grammar text (which dialects: see the concrete backend)
      "choices"      a non-empty list of non-empty strings; the output is exactly one of them
      "json_object"  any JSON object (spec ignored; OpenAI response_format json_object)
    """

    name: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    def _set_vocab(self, tokenizer: Any, vocab_size: int | None, eos_token_ids) -> None:
        """Resolve the model vocab size (>= the tokenizer's ids; padded ids are always masked) and the EOS
        ids (default: the tokenizer's), shared by every backend's constructor."""
        num_tokenizer_ids = len(tokenizer)
        self.vocab_size = num_tokenizer_ids if vocab_size is None else int(vocab_size)
        if self.vocab_size < num_tokenizer_ids:
            raise ValueError(
                f"vocab_size {self.vocab_size} is smaller than the tokenizer's {num_tokenizer_ids} ids; "
                "pass the model's lm_head width"
            )
        if eos_token_ids is None:
            if tokenizer.eos_token_id is None:
                raise ValueError("the tokenizer has no eos_token_id: pass eos_token_ids")
            eos_token_ids = [tokenizer.eos_token_id]
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.tokenizer = tokenizer

    @abstractmethod
    def compile(self, kind: str, spec: Any) -> CompiledGrammar:
        """Compile `spec` of `kind`. Pure with respect to the backend (thread-safe, no shared mutation).

        Raises InvalidRequest with a message naming the problem for: an unknown kind, an invalid regex,
        malformed JSON or JSON schema, an unresolvable `$ref` or a self-referential schema with no finite
        instance, a grammar syntax error, empty choices, or a constraint no string can satisfy.
        """

    @abstractmethod
    def matcher(self, compiled: CompiledGrammar) -> Matcher:
        """A fresh matcher at the start of `compiled`. Cheap (microseconds); one per request."""

    @property
    @abstractmethod
    def cache_namespace(self) -> tuple:
        """What, besides (kind, spec), a compiled grammar depends on: backend, tokenizer, vocab, EOS, options.

        The compiler keys its cache on (cache_namespace, kind, canonical spec text).
        """

    def token_text(self, token_id: int) -> str:
        """One token's decoded text (what `JsonState` follows; a partial UTF-8 byte decodes as U+FFFD)."""
        return self.tokenizer.decode([token_id])

    def fill_bitmasks(self, rows: list[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
        """Fill several rows at once: `matcher.fill_bitmask(bitmask, row)` for each pair.

        Backends override this to compute the rows in parallel outside the GIL.
        """
        self.fill_bitmasks_native(rows, bitmask)
        self.finish_bitmasks(rows, bitmask)

    def set_mask_threads(self, threads: int) -> None:
        """Threads for the next `fill_bitmasks` calls. This default fills row by row on the calling thread and
        has no threads to set: it raises ValueError. Parallel backends override it."""
        raise ValueError(f"the {type(self).__name__} grammar backend fills masks on the calling thread only")

    def fill_bitmasks_native(self, rows: list[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
        """The part of `fill_bitmasks` that runs in the grammar library (outside the GIL where it can): for a
        worker thread. `finish_bitmasks` on the same rows completes them; the two together are fill_bitmasks."""
        for matcher, row in rows:
            matcher.fill_bitmask(bitmask, row)

    def finish_bitmasks(self, rows: list[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
        """The Python part of `fill_bitmasks` (rules narrowing the grammar's rows), for the thread that owns the
        matchers: run there it does not wait for the GIL behind that thread's own work. Default: nothing."""
        return None
