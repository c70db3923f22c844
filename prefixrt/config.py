"""EngineConfig: the engine's construction arguments, validated once (frozen afterwards)."""

from __future__ import annotations

from dataclasses import dataclass

from prefixrt.default_models import BASE_MODEL

POLICIES = ("lpm", "dfs", "fcfs")  # schedule_policy names; engine/loop/schedule_policy.py implements each
# host_kv_write_policy names (cache/tiered_radix.py): when a node's K/V is copied to the host tier.
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
# host_kv_prefetch names (engine/scheduler.py): loading a waiting request's host-tier prefix into the pool ahead of
# its admission. off: loaded at admission; best_effort: prefetched, admitted whether or not the load is done (its
# first forward waits for it); wait_complete: prefetched, admitted once the load is done (others run meanwhile).
PREFETCH_POLICIES = ("off", "best_effort", "wait_complete")
QUANTIZATIONS = (None, "fp8")  # quantization: weights as the checkpoint stores them, or FP8 (e4m3) decoder linears
# fp8_activation_scale (with FP8 weights): inputs taller than a decode batch run weight-only ("none"), or quantize
# their activations with one e4m3 scale per group of 64 K values of a token, or one per token
# (kernels/fp8_reference.py; the same names as its ACTIVATION_SCALES, which this layer cannot import:
# tests/engine/test_fp8_engine.py holds the two equal).
FP8_ACTIVATION_SCALES = ("none", "group", "token")
# fp8_speed_check (with FP8 weights on CUDA, model/fp8_speed_check.py; the same names as its SPEED_CHECKS): at start-up
# the FP8 linears are timed against bf16; slower ones are served as bf16 ("fallback"), refused ("error") or kept ("off").
FP8_SPEED_CHECKS = ("fallback", "error", "off")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # kv_cache_dtype: the model's dtype, or e4m3 with per-layer/head scales
# prefix_cache names: the radix tree (cache/radix.py), or the hash-block table of vLLM-style prefix caching
# (cache/block.py, full blocks of 16 tokens: the baseline of the table-cache ablation).
PREFIX_CACHES = ("radix", "block")


@dataclass(frozen=True)
class EngineConfig:
    model: str = BASE_MODEL
    load_format: str = "auto"  # "auto" | "dummy"
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    # FP8 weights (model/quantize.py): None loads the checkpoint as it is (a pre-quantized FP8 checkpoint as FP8);
    # "fp8" quantizes a float checkpoint's decoder linears at load (e4m3, per-output-channel scales).
    quantization: str | None = None
    # FP8 weights' activations for inputs taller than a decode batch (decode batches always run weight-only;
    # model/fp8_linear.py): "token", one e4m3 scale per token (the default: cuBLAS's row-wise _scaled_mm, 1.3-1.4x
    # faster than bf16 at 256-4096 rows on an H100; with fp8_smoothing +0.7-1.1% perplexity over bf16 on the
    # embedded models, +1.8-2.6% without); "none", weight-only too (the Triton W8A16 GEMM: 2x slower than bf16 at
    # tall inputs); "group", one scale per 64 K values of a token (the Triton w8a8 GEMM, as slow). docs/benchmarks.md,
    # "FP8".
    fp8_activation_scale: str = "token"
    # FP8 weights quantized at load (quantization="fp8" on a float checkpoint or dummy weights): the decoder linears'
    # inputs smoothed first, SmoothQuant's per-channel factors max|X|^a / max|W|^(1 - a) with this alpha a, calibrated
    # on a fixed text and folded exactly into the weights and norms (model/smoothing.py: no run-time cost). None or 0:
    # off. 0.75 measured best of 0.25-1 on both embedded models. Pre-quantized FP8 checkpoints are never smoothed.
    # docs/benchmarks.md, "FP8".
    fp8_smoothing: float | None = 0.75
    fp8_speed_check: str = "fallback"  # one of FP8_SPEED_CHECKS
    # K/V cache storage (cache/kv_pool.py): "auto" (the model's dtype) or "fp8_e4m3" (half the bytes of bf16 a token;
    # per-layer, per-kv-head scales from the checkpoint or calibrated at start-up, model/kv_calibration.py).
    kv_cache_dtype: str = "auto"
    attention_backend: str = "auto"  # "auto" | "triton" | "torch"
    kv_cache_tokens: int | None = None
    mem_fraction: float = 0.85
    page_size: int = 1
    radix_cache: bool = True  # False: no prefix cache at all (nothing is reused)
    prefix_cache: str = "radix"  # with radix_cache=True: which cache, one of PREFIX_CACHES
    schedule_policy: str = "lpm"
    chunked_prefill_tokens: int = 8192
    max_running_requests: int | None = None
    seed: int = 0
    max_context: int | None = None  # cap on the model's context (None: the model's own)
    aging_s: float = 5.0  # a waiting request older than this is admitted first, whatever the policy
    grammar_backend: str = "llguidance"  # "llguidance" | "xgrammar"
    grammar_timeout_s: float = 10.0  # a constraint that takes longer to compile is refused (InvalidRequest)
    cuda_graph: bool = True  # capture decode batches (CUDA only)
    # Persistent Triton/Inductor compile cache (CUDA; engine/compile_cache.py): None = under ~/.cache/prefixrt/compile
    # (or TRITON_CACHE_DIR when set), a folder = there (a deployment can ship it), "off" = Triton's own default.
    # Keyed by GPU, driver, versions and model shape inside the folder.
    compile_cache_dir: str | None = None
    # With an empty compile cache, the Triton kernels start-up needs are built in this many worker processes side
    # by side (engine/parallel_builds.py). None: the host's cores less two, at most 16; 0: one by one, in the engine.
    compile_workers: int | None = None
    # Shared-prefix (cascade) decode inside the decode graphs (CUDA, Triton backend): running requests that
    # share a cached prefix read its K/V once per tile. None: the engine's default (builder.CASCADE_DECODE).
    cascade_decode: bool | None = None
    # Programmatic dependent launch (kernels/_common.py) for the fused decode-path kernels (CUDA, Hopper and
    # later, Triton backend): each kernel is scheduled while the one before it finishes and the GEMV reads its
    # first weight tile meanwhile; small-batch linears then run the Triton GEMV wherever the table knows the
    # shape. None: the engine's default (model/rank_setup.py PDL).
    pdl: bool | None = None
    # Schedule step N+1 and post-process step N while the device runs (core.py). None: on for CUDA, off on the
    # CPU, where every op completes before the host goes on, so there is nothing to overlap with.
    overlap_schedule: bool | None = None
    # Build the grammar backend (vocabulary tables) at start-up rather than on the first constrained request.
    # None: on for CUDA engines, off on the CPU.
    grammar_warm_up: bool | None = None
    # Speculative decoding (speculative/, engine/loop/speculate.py): None (off), "ngram" (radix lookahead and the
    # request's own n-grams), "fixed:P[:SEED]" (a test drafter accepted at rate P) or "draft:MODEL" (a small model
    # of the same vocabulary, its K/V in a second pool at the target's slots). Runs the synchronous loop.
    speculative: str | None = None
    speculative_num_tokens: int = 4  # drafted tokens per step at most
    speculative_max_batch: int = 32  # no drafts when more decode rows than this are in a step
    speculative_adaptive: bool = True  # draft length by acceptance (speculative/draft_length.py); False: always the max
    cache_audit_rate: float = 0.0  # fraction of cache hits whose K/V is recomputed and checked (cache_audit.py)
    debug: bool = False  # check KV accounting every idle step; poison freed slots with NaN
    # Host tier of the KV cache (cache/tiered_radix.py): tokens of K/V kept in (pinned) host memory under the
    # radix tree. None or 0: off, the pool alone (as before).
    host_kv_cache_tokens: int | None = None
    host_kv_write_policy: str = "write_through"  # one of WRITE_POLICIES
    host_kv_write_threshold: int = 2  # write_through_selective: hits before a node is copied to the host
    host_kv_debug_delay_s: float = 0.0  # race mode: delay every layer of every host<->pool copy (tests)
    host_kv_prefetch: str = "wait_complete"  # one of PREFETCH_POLICIES
    # A new request that has waited this long for pool memory preempts running requests that have already
    # streamed (retracted to the host tier, resumed later); host tier only. None (default): never. Measured on
    # the agent workload (docs/benchmarks.md) it did not shorten first tokens there and cost wall time.
    host_kv_preempt_after_s: float | None = None
    # Disk tier below the host tier (cache/disk_radix.py): host evictions are written to files in this directory
    # and read back on a hit; the files outlive the engine (a restart comes up warm). Needs the host tier.
    kv_disk_dir: str | None = None
    kv_disk_max_gb: float = 64.0  # size cap of the directory's KV files (LRU files deleted beyond it)
    # Tenant fairness: once the pool must evict, a cache_salt holding more than this fraction of the
    # pool loses its own LRU prefixes first. None: one LRU for everyone.
    max_cached_fraction_per_salt: float | None = None
    # Kept prefixes (prompt caching's breakpoints and retention, cache/pins.py), as fractions of the tier that keeps
    # them (the host tier when there is one, else the pool): all pins together, and one cache_salt's. A keep over
    # either is refused (the response says so).
    max_pinned_fraction: float = 0.5
    max_pinned_fraction_per_salt: float = 0.25
    # Waiting requests of keyed sessions (prompt_cache_key, metadata.user_id) go least attained service of their
    # session first (engine/loop/sessions.py); False: each request on its own, as before.
    session_scheduling: bool = True
    # With the host tier: a finished turn of a keyed session (or one with kept prefixes) has its prefix loaded back
    # from the host tier into free pool pages ahead of its next request, when nothing waits (cache/session_prefetch.py);
    # False: loaded when the next request is admitted, as before.
    session_prefetch: bool = True
    # Tensor parallelism (parallel/layers.py, parallel/tp_worker.py): the model split over tp_size ranks, one process
    # each, started with torch.multiprocessing; rank 0 runs the scheduler and the radix tree and drives the
    # others. nnodes > 1: tp_size / nnodes ranks per machine, node 0 holding rank 0; dist_init_addr "host:port"
    # is the torch.distributed rendezvous (None: a free port on 127.0.0.1, one node only).
    tp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"EngineConfig: {msg}")

        if self.load_format not in ("auto", "dummy"):
            bad(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            bad(f"dtype must be auto/float32/bfloat16/float16, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            bad(f"quantization must be None or 'fp8', got {self.quantization!r}")
        if self.fp8_activation_scale not in FP8_ACTIVATION_SCALES:
            bad(f"fp8_activation_scale must be one of {FP8_ACTIVATION_SCALES}, got {self.fp8_activation_scale!r}")
        if self.fp8_smoothing is not None and not (
                isinstance(self.fp8_smoothing, (int, float)) and not isinstance(self.fp8_smoothing, bool)
                and 0 <= self.fp8_smoothing <= 1):
            bad(f"fp8_smoothing must be None or an alpha in [0, 1] (0: off), got {self.fp8_smoothing!r}")
        if self.fp8_speed_check not in FP8_SPEED_CHECKS:
            bad(f"fp8_speed_check must be one of {FP8_SPEED_CHECKS}, got {self.fp8_speed_check!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            bad(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.tp_size > 1 and (self.quantization or self.kv_cache_dtype != "auto"):
            bad("FP8 weights and the FP8 K/V cache are not supported with tp_size > 1")
        if self.attention_backend not in ("auto", "triton", "torch"):
            bad(f"attention_backend must be auto/triton/torch, got {self.attention_backend!r}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 2 * self.page_size:
            bad("kv_cache_tokens must hold at least two pages")
        if not 0 < self.mem_fraction < 1:
            bad("mem_fraction must be in (0, 1)")
        if self.page_size < 1:
            bad("page_size must be >= 1")
        if self.prefix_cache not in PREFIX_CACHES:
            bad(f"prefix_cache must be one of {PREFIX_CACHES}, got {self.prefix_cache!r}")
        if self.prefix_cache == "block" and self.radix_cache and (
                self.host_kv_cache_tokens or self.max_cached_fraction_per_salt is not None):
            bad("prefix_cache='block' has no host tier and no per-salt quota (those need the radix tree)")
        if self.schedule_policy not in POLICIES:
            bad(f"schedule_policy must be one of {POLICIES}, got {self.schedule_policy!r}")
        if self.chunked_prefill_tokens < 1:
            bad("chunked_prefill_tokens must be >= 1")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            bad("max_running_requests must be >= 1")
        if self.speculative is not None and not (
                self.speculative == "ngram" or str(self.speculative).startswith("fixed:")
                or (str(self.speculative).startswith("draft:") and str(self.speculative)[6:].strip())):
            bad(f"speculative must be None, 'ngram', 'fixed:P[:SEED]' or 'draft:MODEL', got {self.speculative!r}")
        if self.speculative_num_tokens < 1 or self.speculative_max_batch < 1:
            bad("speculative_num_tokens and speculative_max_batch must be >= 1")
        if not (isinstance(self.cache_audit_rate, (int, float)) and 0 <= self.cache_audit_rate <= 1):
            bad(f"cache_audit_rate must be in [0, 1], got {self.cache_audit_rate!r}")
        if self.host_kv_cache_tokens is not None and self.host_kv_cache_tokens < 0:
            bad("host_kv_cache_tokens must be >= 0")
        if self.host_kv_cache_tokens and self.host_kv_cache_tokens < 2 * self.page_size:
            bad("host_kv_cache_tokens must hold at least two pages")
        if self.host_kv_write_policy not in WRITE_POLICIES:
            bad(f"host_kv_write_policy must be one of {WRITE_POLICIES}, got {self.host_kv_write_policy!r}")
        if self.host_kv_write_threshold < 1:
            bad("host_kv_write_threshold must be >= 1")
        if self.host_kv_preempt_after_s is not None and not self.host_kv_preempt_after_s >= 0:
            bad("host_kv_preempt_after_s must be >= 0 or None")
        if self.host_kv_prefetch not in PREFETCH_POLICIES:
            bad(f"host_kv_prefetch must be one of {PREFETCH_POLICIES}, got {self.host_kv_prefetch!r}")
        if not self.host_kv_debug_delay_s >= 0:
            bad("host_kv_debug_delay_s must be >= 0")
        if self.kv_disk_dir is not None and not (self.host_kv_cache_tokens and self.radix_cache):
            bad("kv_disk_dir needs the host tier (host_kv_cache_tokens > 0) and radix_cache=True: disk hits load "
                "through host memory")
        if not self.kv_disk_max_gb > 0:
            bad("kv_disk_max_gb must be > 0")
        if self.max_cached_fraction_per_salt is not None and not 0 < self.max_cached_fraction_per_salt <= 1:
            bad("max_cached_fraction_per_salt must be in (0, 1]")
        for name in ("max_pinned_fraction", "max_pinned_fraction_per_salt"):
            if not 0 <= getattr(self, name) <= 1:
                bad(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        if self.tp_size < 1:
            bad("tp_size must be >= 1")
        if self.nnodes < 1 or self.tp_size % self.nnodes:
            bad(f"tp_size {self.tp_size} must be a multiple of nnodes {self.nnodes} (the same ranks on every node)")
        if not 0 <= self.node_rank < self.nnodes:
            bad(f"node_rank must be in [0, nnodes), got {self.node_rank}")
        if self.nnodes > 1 and not self.dist_init_addr:
            bad("nnodes > 1 needs dist_init_addr (host:port of node 0, reachable from every node)")
        if self.dist_init_addr is not None and not _is_host_port(self.dist_init_addr):
            bad(f"dist_init_addr must be host:port, got {self.dist_init_addr!r}")
        if self.tp_size > 1 and self.host_kv_cache_tokens:
            bad("the host KV tier is not supported with tp_size > 1")
        if self.grammar_backend not in ("llguidance", "xgrammar"):
            bad("grammar_backend must be 'llguidance' or 'xgrammar'")

    @property
    def fp8_smoothing_alpha(self) -> float | None:
        """The smoothing alpha quantize-at-load applies (fp8_smoothing), None when off (None or 0)."""
        return float(self.fp8_smoothing) if self.fp8_smoothing else None


def _is_host_port(addr: str) -> bool:
    host, sep, port = addr.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)
