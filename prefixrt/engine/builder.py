"""Builds an EngineCore from an EngineConfig: model, tokenizer, KV pool sizing, cache, scheduler, backend.

Kept apart from the front (engine.py) so that the front is only about threads and requests.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from prefixrt.cache.allocator import PageAllocator
from prefixrt.cache.kv_manager import KVManager
from prefixrt.cache.kv_pool import KVPool
from prefixrt.cache.naive import NoReuseCache
from prefixrt.cache.radix import RadixCache
from prefixrt.cache.req_table import ReqToTokenTable
from prefixrt.config import EngineConfig
from prefixrt.engine.core import EngineCore
from prefixrt.engine.scheduler import Scheduler, SchedulerConfig
from prefixrt.sampling.sampler import Sampler

log = logging.getLogger("prefixrt")

CPU_DEFAULT_KV_TOKENS = 16384
ACTIVATION_RESERVE_BYTES = 2 << 30  # GPU memory kept out of the KV pool for activations and graphs
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Built:
    core: EngineCore
    tokenizer: object
    tokenizer_lock: threading.Lock
    resolved: object  # registry.ResolvedModel
    model: object
    device: torch.device
    dtype: torch.dtype


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def build(config: EngineConfig, progress=None) -> Built:
    from prefixrt.model.loader import load_model
    from prefixrt.model.registry import load_tokenizer, resolve_model

    say = progress or (lambda msg: log.info(msg))
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    torch.manual_seed(config.seed)

    say(f"resolving model {config.model!r}")
    resolved = resolve_model(config.model)
    if resolved.dummy_only and config.load_format != "dummy":
        raise ValueError(f"{config.model!r} is a shape without weights: use load_format='dummy'")
    tokenizer = load_tokenizer(resolved)
    say(f"loading weights ({config.load_format}) from {resolved.path} as {dtype} on {device}")
    model = load_model(resolved.path, load_format=config.load_format, dtype=dtype, device=device)
    return assemble(config, model, tokenizer, resolved, device, dtype, say)


def assemble(config: EngineConfig, model, tokenizer, resolved, device, dtype, say=None) -> Built:
    """Everything after loading: KV pool sizing, cache, scheduler, backend, core. Tests inject models here."""
    say = say or (lambda msg: log.info(msg))
    max_context = model.max_context if config.max_context is None else min(config.max_context, model.max_context)
    bytes_per_token = KVPool.bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, dtype)
    if config.kv_cache_tokens is not None:
        num_slots = config.kv_cache_tokens + config.page_size  # + the reserved padding page
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = total * config.mem_fraction - (total - free) - ACTIVATION_RESERVE_BYTES
        num_slots = max(int(budget // bytes_per_token), 4 * config.page_size)
    else:
        num_slots = CPU_DEFAULT_KV_TOKENS + config.page_size
    num_slots = num_slots // config.page_size * config.page_size
    say(f"KV pool: {num_slots - config.page_size} tokens ({num_slots * bytes_per_token / 2**30:.2f} GiB)")
    pool = KVPool(num_slots, model.num_layers, model.num_kv_heads, model.head_dim, dtype, device)
    allocator = PageAllocator(num_slots, config.page_size)
    cache = RadixCache(allocator) if config.radix_cache else NoReuseCache(allocator)
    if config.debug and isinstance(cache, RadixCache):
        cache.on_evict = lambda slots: pool.poison(torch.tensor(slots, device=device))
    max_running = config.max_running_requests or (256 if device.type == "cuda" else 64)
    table = ReqToTokenTable(max_running + 1, max_context + 1, device)
    kv = KVManager(pool, allocator, table, cache, debug=config.debug)
    scheduler = Scheduler(kv, SchedulerConfig(
        policy=config.schedule_policy,
        chunked_prefill_tokens=config.chunked_prefill_tokens,
        max_running_requests=max_running,
        aging_s=config.aging_s,
    ))
    backend = make_attention_backend(config.attention_backend, pool, device, max_running)
    from prefixrt.model.runner import ModelRunner

    runner = ModelRunner(model, pool, backend)
    if config.cuda_graph and device.type == "cuda" and config.attention_backend != "torch":
        pad_row = table.alloc_row()  # never freed: stays all zeros, read by padded graph rows
        say(f"capturing decode CUDA graphs (batch sizes up to {max_running})")
        try:
            runner.capture_decode_graphs(table.table, pad_row, max_running, max_context)
        except Exception as e:  # keep serving, eagerly, and say so loudly
            runner.graphs = None
            log.warning("CUDA graph capture failed, decoding eagerly: %s", e, exc_info=True)
            print(f"WARNING: CUDA graph capture failed, decoding eagerly: {e}", flush=True)
    eos = sorted(set(model.eos_token_ids) | set(getattr(resolved, "extra_eos_token_ids", ()))
                 | ({tokenizer.eos_token_id} if getattr(tokenizer, "eos_token_id", None) is not None else set()))
    lock = threading.Lock()
    grammar = None
    try:
        from prefixrt.constrained import logits as grammar  # noqa: F811
    except ImportError:
        grammar = None
    core = EngineCore(
        runner, scheduler, Sampler(device, config.seed), eos, model.vocab_size,
        max_context, device, debug=config.debug, grammar=grammar, overlap=config.overlap_schedule,
    )
    return Built(core, tokenizer, lock, resolved, model, device, dtype)


def make_attention_backend(name: str, pool: KVPool, device: torch.device, max_batch: int):
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        if device.type != "cuda":
            raise ValueError("attention_backend='triton' needs a CUDA device (use 'torch' on the CPU)")
        from prefixrt.model.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(pool, max_batch_size=max_batch)
    from prefixrt.model.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(pool)
