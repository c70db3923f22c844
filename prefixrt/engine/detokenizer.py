"""Incremental detokenization: text deltas from a growing list of token ids, never splitting a multi-byte
character or a word-piece merge (the prefix/read offset method: decode a small window twice and emit only
the stable difference)."""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, lock=None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.prefix_offset = 0
        self.read_offset = 0
        self.lock = lock

    def _decode(self, ids: list[int]) -> str:
        if self.lock is None:
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        with self.lock:
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, ids: list[int]) -> str:
        """ids: all output ids so far (growing). Returns the new stable text."""
        prefix_text = self._decode(ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(ids)
            return delta
        return ""

    def flush(self, ids: list[int]) -> str:
        """Whatever is left at the end (a dangling partial character is emitted as-is)."""
        prefix_text = self._decode(ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(ids)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""


def find_stop(text: str, stops: list[str], search_from: int) -> tuple[int, str] | None:
    """Earliest occurrence of any stop string that ends at or after search_from. Returns (index, stop)."""
    best = None
    for s in stops:
        i = text.find(s, max(0, search_from - len(s) + 1))
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best


def stop_holdback(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string: text a stream must
    hold back because a stop may still complete over it."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold
