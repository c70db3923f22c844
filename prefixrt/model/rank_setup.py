"""What every rank builds the same way (a single-device engine is rank 0 of 1): device, dtype, attention backend
and model runner (the KV pool's size: cache/kv_setup.py). engine/builder.py builds the rest of the engine around
them on rank 0; parallel/tp_worker.py builds only these on the other tensor-parallel ranks (and rank 0's
TPDriverRunner over make_attention's backend).
"""

from __future__ import annotations

import time

import torch

from prefixrt.cache.kv_pool import KVPool
from prefixrt.config.engine_config import EngineConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


# Programmatic dependent launch of the fused decode-path kernels at batch 1 (kernels/_common.py, PDL_MAX_ROWS;
# EngineConfig.pdl overrides it). On: batch-1 decode at 4k context 4.6% faster on an H200, other batches unchanged.
PDL = True


def make_runner(config: EngineConfig, model, pool: KVPool, device: torch.device, max_running: int,
                startup: dict | None = None, say=None):
    """The ModelRunner over `pool` with make_attention's backend (a single device, or a rank that follows)."""
    from prefixrt.model.runner import ModelRunner

    return ModelRunner(model, pool, make_attention(config, model, pool, device, max_running, startup, say))


def make_attention(config: EngineConfig, model, pool: KVPool, device: torch.device, max_running: int,
                   startup: dict | None = None, say=None):
    """The attention backend over `pool`; with Triton on CUDA, the model's fused layer kernels are switched on
    (startup, say: the start-up report and progress line)."""
    attention = make_attention_backend(config.attention_backend, pool, device, max_running, config.page_size)
    if device.type == "cuda" and type(attention).__name__ == "TritonAttentionBackend":
        from prefixrt.model.layers import use_fused_kernels

        t = time.perf_counter()
        from prefixrt.kernels._common import pdl_supported

        pdl = (PDL if config.pdl is None else config.pdl) and pdl_supported(device)
        use_fused_kernels(model, pdl=pdl)  # before warm-up and capture: the graphs record the fused kernels
        if startup is not None:
            startup["pdl"] = pdl
            startup["fused_kernels_s"] = time.perf_counter() - t
        if say is not None:
            say(f"fused Triton layer kernels on (small-batch GEMV layouts from the measured table) in "
                f"{time.perf_counter() - t:.1f}s")
    return attention


def make_attention_backend(name: str, pool: KVPool, device: torch.device, max_batch: int, page_size: int = 1):
    """'auto' is Triton on CUDA, torch elsewhere. 'triton' on the CPU runs only under Triton's interpreter
    (TRITON_INTERPRET=1: slow, for tests of the kernels inside a whole engine)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        from prefixrt.kernels._common import interpreting

        if device.type != "cuda" and not interpreting():
            raise ValueError("attention_backend='triton' needs a CUDA device (use 'torch' on the CPU)")
        from prefixrt.model.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(pool, max_batch_size=max_batch, page_size=page_size)
    from prefixrt.model.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(pool)
