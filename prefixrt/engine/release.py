"""Releasing an engine's device memory once its loop has stopped: tensor-parallel ranks ended, then every owner
(runner, KV pool, request table, model) frees what it allocated, then the CUDA caches. The counterpart of
builder.py, which made them; Engine.shutdown calls it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from prefixrt.engine.builder import Built


def stop_ranks(built: Built) -> None:
    """Tensor parallelism: end the other ranks and leave the group (after the loop has stopped). No-op otherwise."""
    built.ranks.stop(built.core.runner if built.core is not None else None)


def release(built: Built) -> None:
    """Free every device allocation the engine made (graphs and their pool, KV pool, request table,
    workspaces, and the weights when the builder loaded them). The engine is unusable afterwards; call only
    once its loop has stopped. CPU engines are left alone (their memory goes with the objects)."""
    if built.core is None or built.device.type == "cpu":
        return
    free_device_memory(built)
    if built.device.type == "cuda":
        torch.cuda.synchronize(built.device)
        clear_blas_workspaces()
        torch.cuda.empty_cache()


def free_device_memory(built: Built) -> None:
    """Each owner frees its own: the runner its CUDA graphs and attention workspaces, the KV pool and the
    request table their tensors (the builder made them), the model its weights when the builder loaded them (an
    injected model is not ours to free)."""
    core = built.core
    core.runner.close()
    core.kv.pool.close()
    core.kv.table.close()
    if built.owns_model:
        built.model.release_weights()


def clear_blas_workspaces() -> None:
    """cuBLAS keeps a workspace per stream it ran on (graph capture uses its own stream): drop them."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
