"""Host lists of ints -> one int64 CPU tensor, fast: the per-step index arrays (request-table writes, a
forward's packed batch) are built as Python lists; torch.tensor(list) converts them element by element with
type inference (milliseconds for a batch that admits long cached prefixes); numpy.fromiter converts in C,
3-4x faster.
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch


def int64_tensor(*parts) -> torch.Tensor:
    """The concatenation of parts (sized iterables of ints) as a flat int64 CPU tensor (its own memory)."""
    count = sum(len(p) for p in parts)
    return torch.from_numpy(np.fromiter(chain.from_iterable(parts), dtype=np.int64, count=count))


def int64_tensor_reference(*parts) -> torch.Tensor:
    """The reference: torch.tensor over the concatenated list."""
    return torch.tensor([x for part in parts for x in part], dtype=torch.int64)
