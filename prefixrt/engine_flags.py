"""The engine's command-line flags, shared by `prefixrt serve`, `generate` and `chat`: their argparse
definitions, the mistakes that can be named before a model loads, the parsed flags as Engine keyword arguments,
and starting an engine with progress lines on stderr.

Nothing here imports the engine, the server or torch at import time: `start_engine` starts the class its caller
passes (Engine, ProcessEngine, ...), so `prefixrt generate` and `prefixrt chat` never load the server.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from prefixrt.config import EngineConfig
from prefixrt.default_models import CHAT_MODEL

# The flags that become Engine keyword arguments as they are (EngineConfig fields of the same name).
ENGINE_FLAGS = ("load_format", "device", "dtype", "quantization", "fp8_activation_scale", "fp8_smoothing",
                "fp8_speed_check",
                "kv_cache_dtype",
                "attention_backend",
                "kv_cache_tokens", "mem_fraction", "page_size", "prefix_cache", "schedule_policy",
                "chunked_prefill_tokens", "max_running_requests", "seed", "debug",
                "cache_audit_rate", "host_kv_cache_tokens", "host_kv_write_policy", "host_kv_write_threshold",
                "host_kv_prefetch", "host_kv_preempt_after_s",
                "max_cached_fraction_per_salt", "max_pinned_fraction", "max_pinned_fraction_per_salt", "session_scheduling",
                "session_prefetch", "kv_disk_dir", "kv_disk_max_gb", "tp_size", "nnodes", "node_rank",
                "dist_init_addr", "cascade_decode", "compile_cache_dir", "compile_workers", "speculative",
                "speculative_num_tokens")


def add_engine_args(p: argparse.ArgumentParser, default_model: str | None = CHAT_MODEL) -> None:
    """Engine construction flags (docs/api.md's Engine arguments), shared by `serve`, `generate` and `chat`.
    default_model None: the command picks the model (generate: CHAT_MODEL with --chat, else BASE_MODEL)."""
    p.add_argument("--model", default=default_model,
                   help=f"registry name or local HF folder (default: {default_model or 'see the command'})")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="fp8: FP8 (e4m3) weights for the decoder's linear layers, a float checkpoint quantized at "
                        "load (per-channel weight scales); default: the weights as the checkpoint stores them (a "
                        "pre-quantized FP8 checkpoint loads as FP8)")
    p.add_argument("--fp8-activation-scale", choices=["none", "group", "token"],
                   default=EngineConfig.fp8_activation_scale,
                   help="with FP8 weights, inputs taller than a decode batch (which always runs weight-only): "
                        "none (weight-only too: the Triton W8A16 GEMM, slower than bf16 at large batches), group "
                        "(activations quantized with one e4m3 scale per 64 values of a token) or token (one per "
                        f"token: cuBLAS's row-wise FP8 GEMM, the fastest; default {EngineConfig.fp8_activation_scale})")
    p.add_argument("--fp8-smoothing", type=float, default=EngineConfig.fp8_smoothing, metavar="ALPHA",
                   help="with --quantization fp8 on a float checkpoint: smooth the decoder linears' inputs before "
                        "quantizing (SmoothQuant factors max|X|^ALPHA / max|W|^(1-ALPHA), calibrated on a fixed "
                        "text and folded exactly into the weights: no run-time cost); 0: off "
                        f"(default {EngineConfig.fp8_smoothing})")
    p.add_argument("--fp8-speed-check", choices=["fallback", "error", "off"], default="fallback",
                   help="with FP8 weights on a GPU, time them against bf16 at start-up: fallback (the default: serve "
                        "bf16 weights when FP8 would be slower, with a log line), error (refuse to start then) or off")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3"], default="auto",
                   help="fp8_e4m3: store K/V in FP8 (half the bytes of bf16: about twice the cached tokens), one scale "
                        "per layer and kv head (from the checkpoint, else calibrated at start-up); default: the "
                        "model's dtype")
    p.add_argument("--attention-backend", choices=["auto", "triton", "torch"], default="auto")
    p.add_argument("--kv-cache-tokens", type=int, default=None)
    p.add_argument("--mem-fraction", type=float, default=0.85)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--no-radix-cache", action="store_true", help="disable cross-request prefix reuse")
    p.add_argument("--schedule-policy", choices=["lpm", "dfs", "fcfs"], default="lpm")
    p.add_argument("--prefix-cache", choices=["radix", "block"], default="radix",
                   help="block: a vLLM-style hash-block table cache instead of the radix tree (an ablation)")
    p.add_argument("--chunked-prefill-tokens", type=int, default=8192)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--debug", action="store_true", help="check KV accounting whenever the scheduler is idle (slow)")
    p.add_argument("--host-kv-cache-tokens", type=int, default=None,
                   help="host tier of the KV cache, in tokens (pinned host memory on CUDA): prefixes evicted from "
                        "the GPU pool move there and load back on a hit (docs/serving.md); default off")
    p.add_argument("--host-kv-write-policy", choices=["write_through", "write_through_selective", "write_back"],
                   default="write_through", help="when a prefix is copied to the host tier (docs/serving.md)")
    p.add_argument("--host-kv-write-threshold", type=int, default=2,
                   help="write_through_selective: hits before a prefix is copied to the host tier")
    p.add_argument("--host-kv-prefetch", choices=["wait_complete", "best_effort", "off"], default="wait_complete",
                   help="load a waiting request's host-tier prefix into the GPU pool ahead of its admission: "
                        "wait_complete admits it once loaded (others run meanwhile), best_effort whenever it fits "
                        "(its first forward waits for the load), off loads at admission (docs/serving.md)")
    p.add_argument("--host-kv-preempt-after-s", type=float, default=-1.0,
                   help="with the host tier: a new request waiting this long for GPU memory preempts running "
                        "requests that have already streamed (moved to the host, resumed later); negative "
                        "(default): off")
    p.add_argument("--compile-cache-dir", default=None, metavar="DIR|off",
                   help="persistent Triton kernel cache (CUDA): a later start, or a replica shipped with the folder, "
                        "loads its kernels instead of compiling them; one subfolder per GPU, driver, torch/Triton "
                        "version and model shape (default ~/.cache/prefixrt/compile; off: Triton's own)")
    p.add_argument("--compile-workers", type=int, default=None, metavar="N",
                   help="with an empty compile cache, build the Triton kernels start-up needs in N worker processes "
                        "side by side (default: the host's cores less two, at most 16; 0: one by one in the engine)")
    p.add_argument("--kv-disk-dir", default=None,
                   help="disk tier of the KV cache below the host tier (needs --host-kv-cache-tokens): prefixes "
                        "evicted from host memory are written there and read back on a hit; they outlive the "
                        "server, so a restart comes up warm (docs/serving.md); default off")
    p.add_argument("--kv-disk-max-gb", type=float, default=64.0,
                   help="size cap of --kv-disk-dir's KV files in GiB (least recently used files deleted first)")
    p.add_argument("--max-cached-fraction-per-salt", type=float, default=None,
                   help="once the KV pool must evict, a cache_salt holding more than this fraction of it loses "
                        "its own LRU prefixes first (tenant fairness); default off")
    p.add_argument("--max-pinned-fraction", type=float, default=0.5,
                   help="kept prefixes (prompt-cache breakpoints and retention) may hold at most this fraction of the "
                        "tier that keeps them: the host KV tier when on, else the GPU pool (default 0.5)")
    p.add_argument("--max-pinned-fraction-per-salt", type=float, default=0.25,
                   help="one cache_salt's kept prefixes at most this fraction of that tier; a keep over it is "
                        "refused and the response says so (default 0.25)")
    p.add_argument("--session-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="waiting requests of keyed sessions (prompt_cache_key, Anthropic metadata.user_id) go least "
                        "attained service of their session first (default on)")
    p.add_argument("--session-prefetch", action=argparse.BooleanOptionalAction,
                   default=EngineConfig.session_prefetch,
                   help="with --host-kv-cache-tokens: when a keyed session's turn ends (or it keeps a prefix), load "
                        "its prefix back from the host tier into free GPU pool pages ahead of its next request "
                        f"(docs/serving.md; default {'on' if EngineConfig.session_prefetch else 'off'})")
    p.add_argument("--cascade-decode", action=argparse.BooleanOptionalAction, default=None,
                   help="shared-prefix (cascade) decode in the CUDA decode graphs: requests sharing a cached prefix "
                        "read its K/V once (default: on with CUDA graphs and the Triton backend)")
    p.add_argument("--tp", "--tp-size", dest="tp_size", type=int, default=1,
                   help="tensor parallelism: split the model over this many ranks (GPUs; processes on the CPU), "
                        "one process each; rank 0 schedules (docs/serving.md)")
    p.add_argument("--nnodes", type=int, default=1, help="tensor parallelism over this many machines (--tp per all)")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this machine's index; node 0 serves, the others run their ranks only")
    p.add_argument("--dist-init-addr", default=None,
                   help="host:port of node 0 for the torch.distributed rendezvous (needed with --nnodes > 1; "
                        "default: a free port on 127.0.0.1)")
    p.add_argument("--speculative", default=None, metavar="ngram|draft:MODEL|fixed:P",
                   help="speculative decoding: ngram drafts what the radix cache and the request's own context hold "
                        "after its last tokens; draft:MODEL drafts with a small model of the same vocabulary "
                        "(a registry name or a folder); fixed:P is a test drafter accepted at rate P (docs/serving.md); "
                        "runs the synchronous loop; default off")
    p.add_argument("--speculative-num-tokens", type=int, default=4,
                   help="tokens drafted per step at most (adaptive below it)")
    p.add_argument("--cache-audit-rate", type=float, default=0.0,
                   help="fraction of cache hits whose K/V is recomputed off the critical path and compared "
                        "(mismatches: prefixrt_cache_audit_mismatch_total); e.g. 0.001")


def check_engine_args(args: argparse.Namespace) -> None:
    """Mistakes that can be named before anything loads; raises ValueError with a one-line message."""
    device = str(getattr(args, "device", "auto"))
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise ValueError(f"--device {device}: {why}; use --device cpu (or auto)")
    elif device not in ("auto", "cpu"):
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {device!r}")
    model = getattr(args, "model", None)
    if model and not os.path.isdir(os.path.expanduser(model)):
        from prefixrt.hub.catalogue import ENTRIES

        entry = ENTRIES.get(model.strip().lower())
        if entry is None:
            from prefixrt.hub.registry import resolve_model

            resolve_model(model)  # raises the registry's one-line InvalidRequest (names the built-in models)
        elif entry.kind == "dummy" and getattr(args, "load_format", "auto") != "dummy":
            raise ValueError(f"{entry.name!r} is a shape without weights: use --load-format dummy")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed flags as Engine keyword arguments."""
    kw = {name: getattr(args, name) for name in ENGINE_FLAGS}
    kw["radix_cache"] = not args.no_radix_cache
    if kw["host_kv_preempt_after_s"] is not None and kw["host_kv_preempt_after_s"] < 0:
        kw["host_kv_preempt_after_s"] = None
    return kw


def progress_printer() -> Callable[[str], None]:
    """A progress callback: each message on stderr with the seconds since this call."""
    t0 = time.monotonic()

    def progress(msg: str) -> None:
        print(f"[prefixrt {time.monotonic() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    return progress


def start_engine(args: argparse.Namespace, make: Callable[..., Any], where: str = "in this process"):
    """`make(args.model, progress=..., **engine_kwargs(args))` (Engine, ProcessEngine, ...), saying on stderr that
    it starts (and `where`) and when it is ready."""
    progress = progress_printer()
    progress(f"starting engine for {args.model!r} ({where})")
    eng = make(args.model, progress=progress, **engine_kwargs(args))
    progress(f"engine ready: {eng.model_name} on {eng.device}, context {eng.max_context} tokens")
    return eng
