"""Builds an EngineCore from an EngineConfig: model and tokenizer (build), then one component after another
(assemble): the KV pool and its manager (cache/kv_setup.py), the scheduler (its SchedulerSettings), the model
runner and its kernels, the loop's hooks and the core.

Kept apart from the Engine (engine.py) so that the Engine is only about threads and requests.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from prefixrt.cache.kv_pool import KV_CACHE_DTYPES, KVPool
from prefixrt.cache.kv_setup import make_kv_manager, pool_slots
from prefixrt.cache.req_table import ReqToTokenTable
from prefixrt.config.engine_config import CacheSettings, EngineConfig, SchedulerSettings
from prefixrt.engine.detokenizer import DetokenizerWorker
from prefixrt.engine.fp8_weights import fp8_calibration_ids, prepare_weights
from prefixrt.engine.grammar import EngineGrammar
from prefixrt.engine.loop.core import EngineCore
from prefixrt.engine.loop.hooks import LoopHooks
from prefixrt.engine.loop.scheduler import Scheduler
from prefixrt.engine.parallel_builds import BuildPool, default_workers, prebuild
from prefixrt.engine.ranks import SingleDevice, start_ranks
from prefixrt.engine.stream import RequestStream
from prefixrt.engine.warm_up import EXTEND_GRAPH_TOKENS, head_layouts, warm_up_batches
from prefixrt.lora.build import build_lora
from prefixrt.model.cuda_graphs import CascadeSpec
from prefixrt.model.rank_setup import resolve_device, resolve_dtype
from prefixrt.sampling.sampler import Sampler
from prefixrt.stage_clock import StageClock

log = logging.getLogger("prefixrt")

# Shared-prefix (cascade) decode inside the decode graphs, for groups of >= 2 running requests sharing
# >= CASCADE_MIN_PREFIX cached tokens (engine/loop/prefix_groups.py, kernels/cascade_decode.py); EngineConfig.
# cascade_decode overrides it. On by default: on an H200 (docs/benchmarks.md) an fp32 engine gives greedy
# outputs identical to plain decode on 64 of 64 RAG prompts (logprob rel err 9e-7), and the RAG case streamed
# with text runs 1.31x faster in bf16. In bf16 with dummy weights greedy outputs flip on near-ties as they do
# between any two correct attention kernels (see the torch-backend baseline there).
CASCADE_DECODE = True
CASCADE_MIN_PREFIX = 256



@dataclass
class Built:
    core: EngineCore
    startup: dict  # start-up report: seconds per phase, CUDA graph capture lines (printed at start-up)
    tokenizer: object
    tokenizer_lock: threading.Lock
    resolved: object  # registry.ResolvedModel
    model: object
    device: torch.device
    dtype: torch.dtype
    ranks: object  # the rank strategy (engine/ranks.py; stop_ranks() ends tensor-parallel ranks)
    owns_model: bool = False  # the builder loaded the weights (release() frees them); False when injected
    image_processor: object = None  # a vision-language model's ImageProcessor (multimodal/processor.py), else None


def build(config: EngineConfig, progress=None, deliver=RequestStream.push_many) -> Built:
    """Resolve, load and assemble the engine for `config`. Its start-up line says where the time went, by stage
    (StageClock: resolving, a first use's conversion stages, the tokenizer, loading, assembling, warming up)."""
    from prefixrt.hub.registry import resolve_model

    say = progress or (lambda msg: log.info(msg))
    clock = StageClock()
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    torch.manual_seed(config.seed)

    say(f"resolving model {config.model!r}")
    with clock.stage("resolve"):
        resolved = resolve_model(config.model, clock)
    if resolved.dummy_only and config.load_format != "dummy":
        raise ValueError(f"{config.model!r} is a shape without weights: use load_format='dummy'")
    with clock.stage("tokenizer"):
        tokenizer = tokenizer_while_the_device_starts(resolved, device, say)
    with clock.stage("start ranks"):
        ranks = start_ranks(config, resolved.path, say)
    try:
        say(f"loading weights ({config.load_format}) from {resolved.path} as {dtype} on {ranks.device}"
            + (f" (rank 0 of {ranks.size})" if ranks.size > 1 else ""))
        with clock.stage("load weights"):
            model = ranks.load_model(resolved.path, config, dtype, fp8_calibration_ids(config, tokenizer))
        load_s = clock.total()
        with clock.stage("assemble"):
            built = assemble(config, model, tokenizer, resolved, ranks.device, dtype, say, ranks=ranks,
                             deliver=deliver, clock=clock)
    except BaseException:
        ranks.stop()
        raise
    built.owns_model = True
    built.startup["load_s"] = load_s
    built.startup["total_s"] = clock.total()
    built.startup["stages"] = dict(clock.seconds)
    say(f"start-up: {clock.summary()}")
    return built


def assemble(config: EngineConfig, model, tokenizer, resolved, device, dtype, say=None, ranks=None,
             deliver=RequestStream.push_many, clock: StageClock | None = None) -> Built:
    """Everything after loading, one component after another (deliver: where the loop's outputs go,
    LoopHooks.deliver). Tests inject models here. ranks: the rank strategy (engine/ranks.py; default one device).
    With tensor parallelism (this is rank 0) the pool size is agreed with the other ranks, which get the table
    shape, and the runner drives them. clock: where the stages' seconds go (FP8 speed check; KV pool; on CUDA
    build kernels, warm up and capture graphs)."""
    clock = clock or StageClock()
    say = say or (lambda msg: log.info(msg))
    ranks = ranks if ranks is not None else SingleDevice(device)
    startup: dict = {"graphs": []}
    fp8_weights = prepare_weights(config, model, tokenizer, dtype, startup, clock, say)
    with clock.stage("LoRA adapters"):  # their GPU slots take device memory: before the pool is sized
        lora, lora_graphs = build_lora(config, model, device, dtype, say)
    grammar = engine_grammar(config, model, tokenizer, resolved)
    if grammar_warm_up(config, device):  # its vocabulary tables build while the rest of start-up runs
        grammar.start_warm()
    compile_dir = start_compile_log(config, model, device, dtype, say)
    build_pool = start_build_pool(config, compile_dir, ranks)
    max_context = model.max_context if config.max_context is None else min(config.max_context, model.max_context)
    max_running = config.max_running_requests or (256 if device.type == "cuda" else 64)
    draft = load_draft_model(config, model, device, dtype, say)
    pool = make_pool(config, model, draft, tokenizer, device, dtype, ranks, clock, say)
    table = ReqToTokenTable(max_running + 1, max_context + 1, device)
    ranks.send_setup(pool.num_slots, table.max_requests, table.max_context, max_running)
    kv = make_kv_manager(config.section(CacheSettings), pool, table, say,
                         lambda: kv_identity(config, resolved, pool, fp8_weights))
    scheduler = Scheduler(kv, config.section(SchedulerSettings), max_running, adapters=lora)
    runner = ranks.make_runner(config, model, pool, max_running, startup, say, table)
    prepare_kernels(config, model, runner, table, device, max_context, max_running, build_pool, ranks, startup,
                    clock, say, lora_graphs)
    if device.type == "cuda":
        startup["compile"] = compile_report(compile_dir, say)
    lock = threading.Lock()
    hooks = LoopHooks(
        deliver=deliver,
        detokenizer=DetokenizerWorker(tokenizer, lock, deliver),  # started by the Engine
        grammar=grammar,
    )
    encoder, processor = _vision_parts(config, model, resolved)
    core = EngineCore(
        runner, scheduler, Sampler(device, config.seed), grammar.eos_token_ids, model.vocab_size, max_context,
        device, hooks, debug=config.debug, prefix_grouper=prefix_grouper(config, runner),
        auditor=cache_auditor(config, kv, runner, device), encoder=encoder,
        overlap=overlap_schedule(config, device, say), speculator=_speculator(config, kv, model.vocab_size,
                                                                             max_context, max_running, draft, device,
                                                                             dtype),
    )
    return Built(core, startup, tokenizer, lock, resolved, model, device, dtype, ranks=ranks,
                 image_processor=processor)


def make_pool(config: EngineConfig, model, draft, tokenizer, device, dtype, ranks, clock: StageClock,
              say) -> KVPool:
    """The KV pool, sized for the device (cache/kv_setup.py pool_slots; every rank agrees on one size), in the
    model's dtype or e4m3 with its scales set before anything is written. A draft model's K/V has the same
    slots, so a token costs both."""
    kv_dtype = KV_CACHE_DTYPES.get(config.kv_cache_dtype, dtype)  # "auto": the model's dtype
    bytes_per_token = KVPool.bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, kv_dtype)
    if draft is not None:
        bytes_per_token += KVPool.bytes_per_token(draft.num_layers, draft.num_kv_heads, draft.head_dim, dtype)
    num_slots = ranks.agree_num_slots(pool_slots(config.section(CacheSettings), bytes_per_token, device))
    say(f"KV pool: {num_slots - config.page_size} tokens ({num_slots * bytes_per_token / 2**30:.2f} GiB"
        f"{' per rank' if ranks.size > 1 else ''})")
    with clock.stage("KV pool"):
        pool = KVPool(num_slots, model.num_layers, model.num_kv_heads, model.head_dim, kv_dtype, device)
    if pool.quantized:  # before anything is written: the scales are constants of the pool
        from prefixrt.model.kv_calibration import set_kv_scales

        set_kv_scales(pool, model, tokenizer, say)
    return pool


def prepare_kernels(config: EngineConfig, model, runner, table, device, max_context: int, max_running: int,
                    build_pool, ranks, startup: dict, clock: StageClock, say, lora_graphs=None) -> None:
    """Triton on CUDA: the kernels start-up needs (built side by side when the compile cache is empty), the eager
    EXTEND shapes warmed up, then the CUDA graphs captured (plain decode graphs alone if the full set fails, then
    eager). Nothing elsewhere. lora_graphs: how the graphs run LoRA adapters (lora/build.py), None without."""
    if not (device.type == "cuda" and config.attention_backend != "torch"):
        return
    attention = runner.attn_backend
    pad_row = table.alloc_row()  # never freed: stays all zeros (padding reads it)
    batches = warm_up_batches(table.table, pad_row, max_context, max_running, config.chunked_prefill_tokens,
                              device, head_layouts(model))
    if build_pool is not None:  # an empty compile cache: what follows loads every kernel from disk instead
        capture = (dict(req_to_token=table.table, pad_row=pad_row, max_batch_size=max_running,
                        max_context=max_context, max_extend_tokens=EXTEND_GRAPH_TOKENS,
                        cascade=cascade_spec(attention, config),
                        max_verify_tokens=verify_graph_tokens(config, max_running), lora=lora_graphs)
                   if config.cuda_graph else None)
        with clock.stage("build kernels"):
            report = prebuild(build_pool, runner, batches, capture)
        startup["parallel_builds"] = dataclasses.asdict(report)
        say(report.line())
    t = time.perf_counter()
    with clock.stage("warm up"):
        startup["warm_up_s"] = runner.warm_up(batches)
    say(f"kernels warmed up for long-prefix EXTEND shapes in {time.perf_counter() - t:.1f}s")
    if not config.cuda_graph:
        return
    say(f"capturing CUDA graphs (decode batch sizes up to {max_running}, EXTEND up to "
        f"{EXTEND_GRAPH_TOKENS} tokens)")
    t = time.perf_counter()
    with clock.stage("capture graphs"):  # on failure: plain decode graphs alone, then eager
        verify = verify_graph_tokens(config, max_running)
        for extend_tokens, cascade in ((EXTEND_GRAPH_TOKENS, cascade_spec(attention, config)), (0, None)):
            try:
                startup["graphs"] = runner.capture_graphs(table.table, pad_row, max_running, max_context,
                                                          max_extend_tokens=extend_tokens, cascade=cascade,
                                                          max_verify_tokens=verify if extend_tokens else 0,
                                                          lora=lora_graphs)
                break
            except Exception as e:  # keep serving, eagerly, and say so loudly
                ranks.on_capture_failure(e)  # raises where the retry cannot be common to every rank
                runner.release_graphs()
                what = "EXTEND/cascade graphs" if extend_tokens else "decode graphs"
                log.warning("CUDA graph capture (%s) failed: %s", what, e, exc_info=True)
                print(f"WARNING: CUDA graph capture ({what}) failed, running those batches eagerly: {e}",
                      flush=True)
    startup["capture_s"] = time.perf_counter() - t
    for line in startup["graphs"]:
        say(line)


def prefix_grouper(config: EngineConfig, runner):
    """The PrefixGrouper of cascade decode (engine/loop/prefix_groups.py) when cascade graphs were captured."""
    if not (cascade_enabled(config) and runner.graphs is not None and getattr(runner.graphs, "cascade", None)):
        return None
    from prefixrt.engine.loop.prefix_groups import PrefixGrouper

    return PrefixGrouper(config.page_size, min_prefix_len=CASCADE_MIN_PREFIX)


def cache_auditor(config: EngineConfig, kv, runner, device):
    """The CacheAuditor of cache_audit_rate (engine/loop/cache_audit.py), when the cache keeps anything to audit."""
    if not (config.cache_audit_rate > 0 and kv.cache.retains):
        return None
    from prefixrt.engine.loop.cache_audit import CacheAuditor

    return CacheAuditor(kv, runner, device, config.cache_audit_rate, seed=config.seed,
                        chunk_tokens=config.chunked_prefill_tokens)


def overlap_schedule(config: EngineConfig, device, say) -> bool:
    """Whether the loop overlaps scheduling with the device (EngineConfig.overlap_schedule; default on CUDA), never
    with speculative decoding (which runs the synchronous loop)."""
    overlap = config.overlap_schedule if config.overlap_schedule is not None else device.type == "cuda"
    if overlap and config.speculative is not None:
        say("speculative decoding runs the synchronous loop: the overlap scheduler is off")
        return False
    return overlap


def verify_graph_tokens(config: EngineConfig, max_running: int) -> int:
    """Tokens up to which speculative decoding's verify forwards replay CUDA graphs (model/cuda_graphs.py
    VerifyGraphs): the largest speculating batch times its last token + drafts, at most EXTEND_GRAPH_TOKENS;
    0 without speculation."""
    if config.speculative is None:
        return 0
    rows = min(max_running, config.speculative_max_batch)
    return min(EXTEND_GRAPH_TOKENS, rows * (config.speculative_num_tokens + 1))


def load_draft_model(config: EngineConfig, target, device, dtype, say):
    """The draft model of speculative="draft:MODEL" (a registry name or a folder), checked against the target
    (engine/loop/draft_model.py check_draft_model; ValueError); None for any other spec."""
    spec = config.speculative
    if not (isinstance(spec, str) and spec.startswith("draft:")):
        return None
    from prefixrt.engine.loop.draft_model import check_draft_model
    from prefixrt.hub.loader import load_model
    from prefixrt.hub.registry import resolve_model
    from prefixrt.speculative.spec import parse_spec

    resolved = resolve_model(parse_spec(spec)[1]["model"])
    fmt = "dummy" if resolved.dummy_only else config.load_format
    say(f"loading the draft model ({fmt}) from {resolved.path} as {dtype}")
    draft = load_model(resolved.path, load_format=fmt, dtype=dtype, device=device)
    check_draft_model(target, draft, config)
    return draft


def _speculator(config: EngineConfig, kv, vocab_size: int, max_context: int, max_running: int, draft=None,
                device=None, dtype=None):
    """The Speculator of EngineConfig.speculative (engine/loop/speculate.py), None without one; draft: the draft
    model of a "draft:MODEL" spec, run over a pool of its own at the target pool's slots
    (engine/loop/draft_model.py)."""
    if config.speculative is None:
        return None
    from prefixrt.engine.loop.speculate import Speculator
    from prefixrt.speculative.draft_length import AdaptiveDraftLength
    from prefixrt.speculative.spec import make_drafter

    lengths = AdaptiveDraftLength(config.speculative_num_tokens, max_batch=config.speculative_max_batch,
                                  adaptive=config.speculative_adaptive)
    if draft is not None:
        from prefixrt.engine.loop.draft_model import DraftModelDrafter
        from prefixrt.model.rank_setup import make_runner

        pool = KVPool(kv.pool.num_slots, draft.num_layers, draft.num_kv_heads, draft.head_dim, dtype, device)
        drafter = DraftModelDrafter(make_runner(config, draft, pool, device, max_running), kv, device)
    else:
        drafter = make_drafter(config.speculative, vocab_size)
    return Speculator(drafter, kv, lengths, max_context)


def _vision_parts(config: EngineConfig, model, resolved):
    """(EncoderCache, ImageProcessor) of a vision-language model, else (None, None). The processor is read from
    the model folder's preprocessor_config.json (None without one: image requests are then refused). With the
    radix cache off, encoder outputs are not kept either."""
    if getattr(model, "vision", None) is None:
        return None, None
    from prefixrt.multimodal.inputs import DEFAULT_ENCODER_CACHE_IMAGES, EncoderCache
    from prefixrt.multimodal.processor import ImageProcessor

    encoder = EncoderCache(model.encode_images, DEFAULT_ENCODER_CACHE_IMAGES if config.radix_cache else 0)
    folder = Path(str(getattr(resolved, "path", "") or ""))
    processor = ImageProcessor.from_folder(folder) if (folder / "preprocessor_config.json").is_file() else None
    return encoder, processor


def start_compile_log(config: EngineConfig, model, device, dtype, say) -> Path | None:
    """CUDA: point Triton's disk cache at config.compile_cache_dir (engine/compile_cache.py) and start counting
    kernel builds. Returns the cache folder (None: off, or not CUDA)."""
    if device.type != "cuda":
        return None
    from prefixrt.engine.compile_cache import COMPILES, model_shape, use_compile_cache

    COMPILES.install()
    if config.compile_cache_dir == "off":
        return None
    if config.compile_cache_dir is None and os.environ.get("TRITON_CACHE_DIR"):
        say(f"compile cache: {os.environ['TRITON_CACHE_DIR']} (TRITON_CACHE_DIR)")  # the user's own wins
        return None
    folder = use_compile_cache(config.compile_cache_dir, device, model_shape(model, dtype))
    say(f"compile cache: {folder}")
    return folder


def tokenizer_while_the_device_starts(resolved, device: torch.device, say):
    """load_tokenizer(resolved) on a thread while this one starts the CUDA context (each takes seconds on a GPU
    host). Only the context: anything that imports transformers here could race the thread's import of it."""
    from prefixrt.hub.registry import load_tokenizer

    if device.type != "cuda":
        return load_tokenizer(resolved)
    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefixrt-tokenizer-load") as loading:
        tokenizer = loading.submit(load_tokenizer, resolved)
        torch.zeros(1, device=device)
        context_s = time.perf_counter() - t
        tokenizer = tokenizer.result()
    say(f"tokenizer and CUDA context ready in {time.perf_counter() - t:.1f}s (the context alone {context_s:.1f}s)")
    return tokenizer


def engine_grammar(config: EngineConfig, model, tokenizer, resolved) -> EngineGrammar:
    """Constrained decoding's engine part, its end-of-sequence ids from the model, the resolved model and the
    tokenizer."""
    eos = sorted(set(model.eos_token_ids) | set(getattr(resolved, "extra_eos_token_ids", ()))
                 | ({tokenizer.eos_token_id} if getattr(tokenizer, "eos_token_id", None) is not None else set()))
    return EngineGrammar(config.grammar_backend, tokenizer, model.vocab_size, eos, config.grammar_timeout_s)


def grammar_warm_up(config: EngineConfig, device: torch.device) -> bool:
    """Whether start-up builds the grammar backend (EngineConfig.grammar_warm_up; default: on CUDA)."""
    return config.grammar_warm_up if config.grammar_warm_up is not None else device.type == "cuda"


def start_build_pool(config: EngineConfig, folder: Path | None, ranks):
    """Worker processes for start-up's Triton builds (engine/parallel_builds.py) when they pay: CUDA, the Triton
    backend, one rank, and an empty compile cache (a filled one loads every kernel in a fraction of a second).
    None otherwise."""
    from prefixrt.engine.compile_cache import count_cached_kernels

    workers = default_workers() if config.compile_workers is None else config.compile_workers
    if (folder is None or workers <= 0 or ranks.size != 1 or config.attention_backend == "torch"
            or count_cached_kernels(folder) > 0):
        return None
    try:
        return BuildPool(workers)
    except Exception as e:  # no workers: the engine builds every kernel itself, as with compile_workers=0
        log.warning("could not start worker processes for kernel builds (%s); building in the engine process", e)
        return None


def compile_report(folder: Path | None, say) -> dict:
    """What start-up built (Triton kernels: how many, how long, how many new in the disk cache), said and returned
    for the start-up report."""
    from prefixrt.engine.compile_cache import COMPILES, count_cached_kernels

    report = {"builds": COMPILES.counts["startup"], "seconds": COMPILES.seconds["startup"],
              "cache_dir": str(folder) if folder else None, "cached_kernels": count_cached_kernels(folder)}
    say(f"compiled: {COMPILES.summary('startup')}; {report['cached_kernels']} kernels in the disk cache")
    return report


def kv_identity(config: EngineConfig, resolved, pool: KVPool, fp8_weights: bool | None = None) -> str:
    """What K/V on disk must have been computed with to be reused: the model revision, the weight files (name,
    size and modification time: a checkpoint re-saved in place has a new revision here, even where the folder
    digest, which counts weights by size, would not change), dummy weights' seed, dtype and K/V shape; with FP8, the
    K/V scales and the weights' quantization and smoothing. fp8_weights: whether the model serves FP8 weights (False
    after the start-up speed check fell back to bf16; None: as config.quantization says)."""
    import hashlib

    h = hashlib.sha256()
    folder = Path(str(getattr(resolved, "path", "") or ""))
    if folder.is_dir():
        for f in sorted(folder.iterdir()):
            if f.suffix in (".safetensors", ".bin", ".pt", ".gguf"):
                st = f.stat()
                h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    weights = f"dummy-seed-{config.seed}" if config.load_format == "dummy" else h.hexdigest()[:16]
    fp8 = f"|scales:{pool.scales_digest()}" if pool.quantized else ""  # FP8 bytes mean K/V under these scales only
    smoothing = f":smoothing-{config.fp8_smoothing_alpha}" if config.fp8_smoothing_alpha else ""  # other weights
    if config.quantization and fp8_weights is not False:  # FP8 weights compute other K/V
        fp8 += f"|quantization:{config.quantization}:{config.fp8_activation_scale}{smoothing}"
    elif config.quantization:
        fp8 += f"|quantization:dequantized-fp8{smoothing}"
    return (f"{resolved.revision}|weights:{weights}|{pool.dtype}|kv:{pool.num_layers}x{pool.num_kv_heads}"
            f"x{pool.head_dim}{fp8}")


def cascade_enabled(config: EngineConfig) -> bool:
    return CASCADE_DECODE if config.cascade_decode is None else config.cascade_decode


def cascade_spec(attention, config: EngineConfig) -> CascadeSpec | None:
    """The cascade decode graphs for this backend, or None (none captured)."""
    if not cascade_enabled(config) or not getattr(attention, "use_cascade", False):
        return None
    return CascadeSpec(queries_per_tile=attention.cascade_queries_per_tile, min_prefix_len=CASCADE_MIN_PREFIX,
                       min_group_size=attention.cascade_min_group_size)


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
