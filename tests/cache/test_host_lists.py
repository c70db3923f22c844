"""int64_tensor (the per-step index arrays' host conversion) equals its torch.tensor reference."""

import pytest
import torch

from prefixrt.cache.host_lists import int64_tensor, int64_tensor_reference


@pytest.mark.parametrize("parts", [
    ([],),
    ([], [], []),
    ([7],),
    (list(range(3580)), [5] * 3580, range(100, 3680)),
    ([2**62, -(2**62), 0], [-1]),
])
def test_int64_tensor_matches_reference(parts):
    got, want = int64_tensor(*parts), int64_tensor_reference(*parts)
    assert got.dtype == torch.int64 and got.shape == want.shape
    assert torch.equal(got, want)


def test_int64_tensor_owns_its_memory():
    rows = [1, 2, 3]
    t = int64_tensor(rows)
    rows[0] = 99
    assert t.tolist() == [1, 2, 3]
