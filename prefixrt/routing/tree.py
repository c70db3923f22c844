"""ApproxPrefixTree: what the router believes one replica's radix cache holds, over token ids.

The tree is kept at block granularity: a prompt's ids are cut into blocks of `block_size` tokens and block i
is named by a hash chained over blocks 0..i (so a name stands for the whole prefix up to that block, and two
prompts share a node exactly when they share every token up to it — a prefix tree whose nodes are named by
their path). A trailing partial block is not recorded. Lookups (`match`) never mutate; `insert` records a
prompt as most recently used and prunes least-recently-used blocks beyond `max_tokens`.

Invariant: every recorded block's parent is recorded and was used at least as recently (insert touches a
path leaf first and root last), so LRU pruning always removes leaves and never orphans a block.

It is approximate by design: the replica may have evicted what the tree still holds (the tree's capacity
should be about the replica's KV capacity), and hash collisions, at 2^-64 per pair, are ignored.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

_ROOT = 0x9E3779B97F4A7C15  # the chain's seed: the empty prefix


def block_keys(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hash of every full block of token_ids: keys[i] names the prefix token_ids[:(i+1)*block_size].
    Deterministic across processes (hashes of int tuples do not depend on PYTHONHASHSEED)."""
    keys = []
    parent = _ROOT
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        keys.append(parent)
    return keys


class ApproxPrefixTree:
    """One replica's approximate prefix cache: full blocks of token ids with LRU order."""

    def __init__(self, block_size: int = 16, max_tokens: int = 1 << 20):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if max_tokens < block_size:
            raise ValueError(f"max_tokens ({max_tokens}) must hold at least one block of {block_size} tokens")
        self.block_size = block_size
        self.max_blocks = max_tokens // block_size
        self._blocks: OrderedDict[int, None] = OrderedDict()  # key -> None; first = least recently used

    @property
    def num_tokens(self) -> int:
        """Tokens recorded (full blocks only)."""
        return len(self._blocks) * self.block_size

    def set_max_tokens(self, max_tokens: int) -> None:
        """Change the capacity (e.g. to the replica's reported KV size); prunes at once if it shrank."""
        self.max_blocks = max(1, max_tokens // self.block_size)
        self._prune()

    def match(self, keys: Sequence[int]) -> int:
        """How many leading tokens of the prompt whose block_keys are `keys` the tree holds. Does not mutate."""
        n = 0
        for k in keys:
            if k not in self._blocks:
                break
            n += 1
        return n * self.block_size

    def insert(self, keys: Sequence[int]) -> None:
        """Record the prompt's blocks as most recently used (leaf first, root last), then prune to capacity."""
        for k in reversed(keys):
            self._blocks[k] = None
            self._blocks.move_to_end(k)
        self._prune()

    def clear(self) -> None:
        self._blocks.clear()

    def _prune(self) -> None:
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)
