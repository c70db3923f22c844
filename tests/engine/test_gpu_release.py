"""GPU only: shutdown() releases every device allocation the engine made (KV pool, CUDA graphs and their
pool, weights, workspaces), so engines can be built one after another in one process."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_three_engines_release_their_memory():
    import prefixrt

    x = torch.randn(64, 64, device="cuda")
    (x @ x).sum().item()  # cuBLAS workspace and CUDA context exist before the baseline
    del x
    from prefixrt.engine.builder import clear_blas_workspaces

    clear_blas_workspaces()  # shutdown() drops them too
    start = torch.cuda.memory_allocated()
    for i in range(3):
        with prefixrt.Engine("llama-3.2-1b", load_format="dummy", kv_cache_tokens=16384, seed=i) as eng:
            out = eng.generate([[5, 6, 7, 8] * 20], {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
            assert len(out[0].token_ids) == 4
            assert torch.cuda.memory_allocated() > start + (1 << 30)  # weights + pool really were on the GPU
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == start, f"engine {i} left {torch.cuda.memory_allocated() - start} bytes"
