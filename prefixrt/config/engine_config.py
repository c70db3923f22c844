"""EngineConfig: the engine's settings, declared once, in sections, validated once (frozen afterwards).

Each section is the settings one part of the engine reads (the scheduler gets its SchedulerSettings, the KV cache
its CacheSettings: `section_of(config, SchedulerSettings)`); EngineConfig is all of them, flat, as `Engine(...)`
takes them. A setting is one `setting(...)` declaration (config/settings.py): its default, help, choices and
range live there, and its command-line flag and ENGINE_FLAGS entry are generated from it (config/flags.py). A
rule between settings is checked in its section's `_check` (EngineConfig's for rules across sections).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from prefixrt.config.settings import check_fields, section_of, setting
from prefixrt.default_models import BASE_MODEL

POLICIES = ("lpm", "dfs", "fcfs")  # schedule_policy names; engine/loop/schedule_policy.py implements each
# host_kv_write_policy names (cache/tiered_radix.py): when a node's K/V is copied to the host tier.
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
# host_kv_prefetch names (engine/loop/scheduler.py): loading a waiting request's host-tier prefix into the pool
# ahead of its admission.
PREFETCH_POLICIES = ("wait_complete", "best_effort", "off")
# fp8_activation_scale (with FP8 weights): the same names as kernels/fp8_reference.py's ACTIVATION_SCALES, which
# this layer cannot import (tests/engine/test_fp8_engine.py holds the two equal).
FP8_ACTIVATION_SCALES = ("none", "group", "token")
# fp8_speed_check (with FP8 weights on CUDA): the same names as model/fp8_speed_check.py's SPEED_CHECKS.
FP8_SPEED_CHECKS = ("fallback", "error", "off")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
PREFIX_CACHES = ("radix", "block")
# PEFT target module names a LoRA adapter may adapt (model/lora.py lands each in its fused projection)
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class Settings:
    """A section of settings: its fields checked against their declarations, then its `_check` rules (and those
    of every section it is made of). Raises ValueError naming the setting."""

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"{type(self).__name__}: {msg}")

        check_fields(self, bad)
        for cls in reversed(type(self).__mro__):
            check = cls.__dict__.get("_check")
            if check is not None:
                check(self, bad)


@dataclass(frozen=True)
class ModelSettings(Settings):
    """The model and its weights (hub/, model/)."""

    model: str = setting(BASE_MODEL, "registry name or local HF folder")
    load_format: str = setting("auto", "auto: the checkpoint's weights; dummy: random weights from config.json "
                               "(benchmarks)", choices=("auto", "dummy"), flag=True)
    device: str = setting("auto", "auto (cuda if available, else cpu) | cpu | cuda | cuda:N", flag=True)
    dtype: str = setting("auto", "auto: bfloat16 on GPU, float32 on CPU",
                         choices=("auto", "float32", "bfloat16", "float16"), flag=True)
    quantization: str | None = setting(
        None, "fp8: FP8 (e4m3) weights for the decoder's linear layers, a float checkpoint quantized at load "
        "(per-channel weight scales); default: the weights as the checkpoint stores them (a pre-quantized FP8 "
        "checkpoint loads as FP8)", choices=(None, "fp8"), flag=True)
    fp8_activation_scale: str = setting(
        "token", "with FP8 weights, inputs taller than a decode batch (which always runs weight-only; "
        "model/fp8_linear.py): token (the default: one e4m3 scale per token, cuBLAS's row-wise FP8 GEMM, 1.3-1.4x "
        "faster than bf16 at 256-4096 rows on an H100; with fp8_smoothing +0.7-1.1% perplexity over bf16 on the "
        "embedded models, +1.8-2.6% without), none (weight-only too: the Triton W8A16 GEMM, 2x slower than bf16 at "
        "tall inputs) or group (activations quantized with one scale per 64 values of a token: the Triton w8a8 GEMM, "
        "as slow); docs/benchmarks.md, FP8", choices=FP8_ACTIVATION_SCALES, flag=True)
    fp8_smoothing: float | None = setting(
        0.75, "with quantization fp8 on a float checkpoint (or dummy weights): smooth the decoder linears' inputs "
        "before quantizing, SmoothQuant's per-channel factors max|X|^ALPHA / max|W|^(1-ALPHA), calibrated on a fixed "
        "text and folded exactly into the weights and norms (model/smoothing.py: no run-time cost); None or 0: off; "
        "0.75 (the default) measured best of 0.25-1 on both embedded models; pre-quantized FP8 checkpoints are never "
        "smoothed; docs/benchmarks.md, FP8", flag=True, metavar="ALPHA")
    fp8_speed_check: str = setting(
        "fallback", "with FP8 weights on a GPU, time them against bf16 at start-up: fallback (the default: serve "
        "bf16 weights when FP8 would be slower, with a log line), error (refuse to start then) or off",
        choices=FP8_SPEED_CHECKS, flag=True)
    max_context: int | None = setting(None, "cap on the model's context in tokens (None: the model's own)")
    seed: int = setting(0, "seed of dummy weights and of sampling without a request seed", flag=True)

    def _check(self, bad):
        alpha = self.fp8_smoothing
        if alpha is not None and not (isinstance(alpha, (int, float)) and not isinstance(alpha, bool)
                                      and 0 <= alpha <= 1):
            bad(f"fp8_smoothing must be None or an alpha in [0, 1] (0: off), got {alpha!r}")

    @property
    def fp8_smoothing_alpha(self) -> float | None:
        """The smoothing alpha quantize-at-load applies (fp8_smoothing), None when off (None or 0)."""
        return float(self.fp8_smoothing) if self.fp8_smoothing else None


@dataclass(frozen=True)
class RunnerSettings(Settings):
    """How the model runs on the device (model/, engine/loop/core.py)."""

    attention_backend: str = setting("auto", "auto: triton on CUDA, torch elsewhere (torch: the reference path)",
                                     choices=("auto", "triton", "torch"), flag=True)
    cuda_graph: bool = setting(True, "capture decode batches in CUDA graphs (CUDA only)")
    cascade_decode: bool | None = setting(
        None, "shared-prefix (cascade) decode in the CUDA decode graphs: requests sharing a cached prefix read its "
        "K/V once (default: on with CUDA graphs and the Triton backend; engine/builder.py CASCADE_DECODE)", flag=True)
    pdl: bool | None = setting(None, "programmatic dependent launch of the fused decode-path kernels (CUDA, Hopper "
                               "and later; None: model/rank_setup.py PDL)")
    overlap_schedule: bool | None = setting(None, "schedule step N+1 and post-process step N while the device runs "
                                            "(None: on for CUDA, off on the CPU)")
    compile_cache_dir: str | None = setting(
        None, "persistent Triton kernel cache (CUDA): a later start, or a replica shipped with the folder, loads "
        "its kernels instead of compiling them; one subfolder per GPU, driver, torch/Triton version and model shape "
        "(default ~/.cache/prefixrt/compile, or TRITON_CACHE_DIR when set; off: Triton's own)",
        flag=True, metavar="DIR|off")
    compile_workers: int | None = setting(
        None, "with an empty compile cache, build the Triton kernels start-up needs in N worker processes side by "
        "side (default: the host's cores less two, at most 16; 0: one by one in the engine)", flag=True, metavar="N")


@dataclass(frozen=True)
class CacheSettings(Settings):
    """KV memory: the pool, the prefix cache and its host and disk tiers (cache/)."""

    kv_cache_tokens: int | None = setting(None, "KV pool size in tokens; None: from mem_fraction (GPU) or "
                                          "cache/kv_pool.py CPU_DEFAULT_KV_TOKENS", flag=True)
    mem_fraction: float = setting(0.85, "fraction of the GPU's memory the engine may use (the KV pool takes what "
                                  "the weights and activations leave)", flag=True)
    page_size: int = setting(1, "radix cache / allocator granularity, in tokens", minimum=1, flag=True)
    kv_cache_dtype: str = setting(
        "auto", "fp8_e4m3: store K/V in FP8 (half the bytes of bf16: about twice the cached tokens), one scale per "
        "layer and kv head (from the checkpoint, else calibrated at start-up); default: the model's dtype",
        choices=KV_CACHE_DTYPES, flag=True)
    radix_cache: bool = setting(True, "cross-request prefix reuse (False: no prefix cache at all)",
                                flag="--no-radix-cache", flag_help="disable cross-request prefix reuse")
    prefix_cache: str = setting("radix", "block: a vLLM-style hash-block table cache instead of the radix tree "
                                "(an ablation)", choices=PREFIX_CACHES, flag=True)
    radix_insert_below: bool = setting(
        True, "the radix tree publishes a running request's prompt from its locked node (RadixCache.insert_below); "
        "False: by insert + match from the root, the reference path (an ablation: benchmarks/host_admission.py)")
    max_cached_fraction_per_salt: float | None = setting(
        None, "once the KV pool must evict, a cache_salt holding more than this fraction of it loses its own LRU "
        "prefixes first (tenant fairness); default off", flag=True)
    max_pinned_fraction: float = setting(
        0.5, "kept prefixes (prompt-cache breakpoints and retention, cache/pins.py) may hold at most this fraction of "
        "the tier that keeps them: the host KV tier when on, else the GPU pool (default 0.5); a keep over it is "
        "refused (the response says so)", flag=True)
    max_pinned_fraction_per_salt: float = setting(
        0.25, "one cache_salt's kept prefixes at most this fraction of that tier; a keep over it is refused and the "
        "response says so (default 0.25)", flag=True)
    host_kv_cache_tokens: int | None = setting(
        None, "host tier of the KV cache, in tokens (pinned host memory on CUDA): prefixes evicted from the GPU "
        "pool move there and load back on a hit (docs/serving.md); default off", minimum=0, flag=True)
    host_kv_write_policy: str = setting("write_through", "when a prefix is copied to the host tier "
                                        "(docs/serving.md)", choices=WRITE_POLICIES, flag=True)
    host_kv_write_threshold: int = setting(2, "write_through_selective: hits before a prefix is copied to the host "
                                           "tier", minimum=1, flag=True)
    host_kv_debug_delay_s: float = setting(0.0, "race mode: delay every layer of every host<->pool copy (tests)",
                                           minimum=0)
    kv_disk_dir: str | None = setting(
        None, "disk tier of the KV cache below the host tier (needs --host-kv-cache-tokens): prefixes evicted from "
        "host memory are written there and read back on a hit; they outlive the server, so a restart comes up warm "
        "(docs/serving.md); default off", flag=True)
    kv_disk_max_gb: float = setting(64.0, "size cap of --kv-disk-dir's KV files in GiB (least recently used files "
                                    "deleted first)", flag=True)
    cache_audit_rate: float = setting(
        0.0, "fraction of cache hits whose K/V is recomputed off the critical path and compared (mismatches: "
        "prefixrt_cache_audit_mismatch_total); e.g. 0.001", flag=True)
    debug: bool = setting(False, "check KV accounting whenever the scheduler is idle (slow); poison freed slots "
                          "with NaN", flag=True)

    def _check(self, bad):
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 2 * self.page_size:
            bad("kv_cache_tokens must hold at least two pages")
        if not 0 < self.mem_fraction < 1:
            bad("mem_fraction must be in (0, 1)")
        if self.prefix_cache == "block" and self.radix_cache and (
                self.host_kv_cache_tokens or self.max_cached_fraction_per_salt is not None):
            bad("prefix_cache='block' has no host tier and no per-salt quota (those need the radix tree)")
        if not (isinstance(self.cache_audit_rate, (int, float)) and 0 <= self.cache_audit_rate <= 1):
            bad(f"cache_audit_rate must be in [0, 1], got {self.cache_audit_rate!r}")
        if self.host_kv_cache_tokens and self.host_kv_cache_tokens < 2 * self.page_size:
            bad("host_kv_cache_tokens must hold at least two pages")
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


@dataclass(frozen=True)
class SchedulerSettings(Settings):
    """Which requests run next and how many tokens each feeds (engine/loop/scheduler.py)."""

    schedule_policy: str = setting("lpm", "waiting requests' order: longest prefix match, depth-first over the "
                                   "radix tree, or arrival", choices=POLICIES, flag=True)
    chunked_prefill_tokens: int = setting(8192, "prompt tokens fed per step at most (a longer prompt is prefilled "
                                          "in chunks)", minimum=1, flag=True)
    max_running_requests: int | None = setting(None, "requests running at once at most (None: 256 on CUDA, 64 on "
                                               "the CPU)", minimum=1, flag=True)
    aging_s: float = setting(5.0, "a waiting request older than this is admitted first, whatever the policy")
    dedup_shared_prefill: bool = setting(True, "hold back a request that shares an uncached prefix with one "
                                         "prefilling it, so the prefix is prefilled once")
    host_kv_prefetch: str = setting(
        "wait_complete", "load a waiting request's host-tier prefix into the GPU pool ahead of its admission: "
        "wait_complete admits it once loaded (others run meanwhile), best_effort whenever it fits (its first "
        "forward waits for the load), off loads at admission (docs/serving.md)", choices=PREFETCH_POLICIES,
        flag=True)
    max_prefetching: int = setting(8, "waiting requests with a prefetched host-tier prefix at once", minimum=1)
    host_kv_preempt_after_s: float | None = setting(
        None, "with the host tier: a new request waiting this long for GPU memory preempts running requests that "
        "have already streamed (moved to the host, resumed later); None: never", minimum=0, flag=True,
        flag_default=-1.0, flag_help="with the host tier: a new request waiting this long for GPU memory preempts "
        "running requests that have already streamed (moved to the host, resumed later); negative (default): off")
    max_preemptions: int = setting(2, "times one request may be preempted (it is not a victim after that)",
                                   minimum=0)
    session_scheduling: bool = setting(
        True, "waiting requests of keyed sessions (prompt_cache_key, Anthropic metadata.user_id) go least attained "
        "service of their session first (engine/loop/sessions.py; default on)", flag=True)
    session_prefetch: bool = setting(
        True, "with the host tier: when a keyed session's turn ends (or a request keeps a prefix), load its prefix "
        "back from the host tier into free GPU pool pages ahead of its next request, when nothing waits "
        "(cache/session_prefetch.py, docs/serving.md; default on); off: loaded when the next request is admitted",
        flag=True)


@dataclass(frozen=True)
class SpeculativeSettings(Settings):
    """Speculative decoding (speculative/, engine/loop/speculate.py)."""

    speculative: str | None = setting(
        None, "speculative decoding: ngram drafts what the radix cache and the request's own context hold after its "
        "last tokens; draft:MODEL drafts with a small model of the same vocabulary (a registry name or a folder); "
        "fixed:P[:SEED] is a test drafter accepted at rate P (docs/serving.md); runs the synchronous loop; "
        "default off", flag=True, metavar="ngram|draft:MODEL|fixed:P")
    speculative_num_tokens: int = setting(4, "tokens drafted per step at most (adaptive below it)", minimum=1,
                                          flag=True)
    speculative_max_batch: int = setting(32, "no drafts in steps with more decode rows than this", minimum=1)
    speculative_adaptive: bool = setting(True, "draft length by each request's acceptance "
                                         "(speculative/draft_length.py); False: always speculative_num_tokens")

    def _check(self, bad):
        spec = self.speculative
        if spec is not None and not (spec == "ngram" or str(spec).startswith("fixed:")
                                     or (str(spec).startswith("draft:") and str(spec)[6:].strip())):
            bad(f"speculative must be None, 'ngram', 'fixed:P[:SEED]' or 'draft:MODEL', got {spec!r}")


@dataclass(frozen=True)
class GrammarSettings(Settings):
    """Constrained decoding (constrained/, engine/grammar.py)."""

    grammar_backend: str = setting("llguidance", "the grammar library: json_schema, regex, grammar, choices",
                                   choices=("llguidance", "xgrammar"))
    grammar_timeout_s: float = setting(10.0, "a constraint that takes longer to compile is refused "
                                       "(InvalidRequest)")
    grammar_warm_up: bool | None = setting(None, "build the grammar backend's vocabulary tables at start-up rather "
                                           "than on the first constrained request (None: on CUDA)")


@dataclass(frozen=True)
class ParallelSettings(Settings):
    """Tensor parallelism (parallel/): the model split over tp_size ranks, one process each; rank 0 runs the
    scheduler and the radix tree and drives the others."""

    tp_size: int = setting(1, "tensor parallelism: split the model over this many ranks (GPUs; processes on the "
                           "CPU), one process each; rank 0 schedules (docs/serving.md)", minimum=1,
                           flag=("--tp", "--tp-size"))
    nnodes: int = setting(1, "tensor parallelism over this many machines (--tp per all)", flag=True)
    node_rank: int = setting(0, "this machine's index; node 0 serves, the others run their ranks only", flag=True)
    dist_init_addr: str | None = setting(None, "host:port of node 0 for the torch.distributed rendezvous (needed "
                                         "with --nnodes > 1; default: a free port on 127.0.0.1)", flag=True)

    def _check(self, bad):
        if self.nnodes < 1 or self.tp_size % self.nnodes:
            bad(f"tp_size {self.tp_size} must be a multiple of nnodes {self.nnodes} (the same ranks on every node)")
        if not 0 <= self.node_rank < self.nnodes:
            bad(f"node_rank must be in [0, nnodes), got {self.node_rank}")
        if self.nnodes > 1 and not self.dist_init_addr:
            bad("nnodes > 1 needs dist_init_addr (host:port of node 0, reachable from every node)")
        if self.dist_init_addr is not None and not _is_host_port(self.dist_init_addr):
            bad(f"dist_init_addr must be host:port, got {self.dist_init_addr!r}")


@dataclass(frozen=True)
class LoraSettings(Settings):
    """LoRA adapters (lora/): name -> PEFT adapter folder, loaded at start-up; enable_lora without any gives the slots
    for adapters loaded at run time (Engine.load_lora_adapter, POST /v1/load_lora_adapter). A request picks one by
    SamplingParams.lora (model=<name> on the server)."""

    lora_adapters: dict[str, str] | None = setting(
        None, "LoRA adapters (PEFT folders: adapter_config.json + adapter_model.safetensors) to serve, each as a model "
        "of its own name (`model=NAME`; /v1/models lists it with the base as parent); the flag's NAME=PATH pairs "
        "become the name -> folder mapping (config/flags.py lora_modules)", flag="--lora-modules", nargs="+",
        metavar="NAME=PATH")
    enable_lora: bool = setting(False, "serve LoRA adapters loaded at run time (POST /v1/load_lora_adapter) even "
                                "with no --lora-modules", flag=True)
    max_loras: int = setting(8, "LoRA adapters resident on the device at once (an LRU over the loaded ones, which "
                             "stay on the host)", minimum=1, flag=True)
    max_lora_rank: int | None = setting(None, "the adapter slots' rank (higher-rank adapters are refused); default: "
                                        "the largest --lora-modules rank, at least 16", minimum=1, flag=True)
    lora_target_modules: tuple[str, ...] = setting(LORA_TARGET_MODULES, "projections given adapter slots (an "
                                                   "adapter targeting another is refused)")
    lora_debug_load_delay_s: float = setting(0.0, "race mode: every adapter load first waits this long (CPU; tests)",
                                             minimum=0)

    def _check(self, bad):
        if self.lora_adapters is not None and not (isinstance(self.lora_adapters, dict) and all(
                isinstance(k, str) and isinstance(v, (str, os.PathLike)) for k, v in self.lora_adapters.items())):
            bad("lora_adapters must map adapter names to PEFT adapter folders")
        if self.max_lora_rank is not None and not 1 <= self.max_lora_rank <= 512:
            bad(f"max_lora_rank must be in [1, 512], got {self.max_lora_rank!r}")
        unknown = sorted(set(self.lora_target_modules) - set(LORA_TARGET_MODULES))
        if unknown or not self.lora_target_modules:
            bad(f"lora_target_modules must be a non-empty subset of {LORA_TARGET_MODULES}, got {unknown or '()'}")

    @property
    def lora_enabled(self) -> bool:
        return bool(self.lora_adapters) or self.enable_lora


# The sections, in the order EngineConfig lists their fields.
SECTIONS = (ModelSettings, RunnerSettings, CacheSettings, SchedulerSettings, SpeculativeSettings, GrammarSettings,
            ParallelSettings, LoraSettings)


@dataclass(frozen=True)
class EngineConfig(*reversed(SECTIONS)):
    """Every section's settings, flat: `Engine(model, **settings)`. (Dataclass fields come base by base from the
    last base, so the reversed bases list the fields in SECTIONS' order.)"""

    def section(self, section: type):
        """This config's values of one section's settings, as that section (what its component reads)."""
        return section_of(self, section)

    def _check(self, bad):
        if self.tp_size > 1 and (self.quantization or self.kv_cache_dtype != "auto"):
            bad("FP8 weights and the FP8 K/V cache are not supported with tp_size > 1")
        if self.tp_size > 1 and self.host_kv_cache_tokens:
            bad("the host KV tier is not supported with tp_size > 1")
        if self.lora_enabled and self.tp_size > 1:
            bad("LoRA adapters are not supported with tp_size > 1")
        if self.lora_enabled and self.quantization == "fp8" and self.fp8_smoothing_alpha is not None:
            # smoothing divides the projections' inputs and v_proj / up_proj's rows by its factors (model/smoothing.py);
            # an adapter's A and B were trained on the unsmoothed ones, so its update would be wrong
            bad("LoRA adapters over FP8 weights need fp8_smoothing=0 (--fp8-smoothing 0): smoothing rescales the "
                "inputs the adapters were trained on")


def setting_names(section: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(section))


def _is_host_port(addr: str) -> bool:
    host, sep, port = addr.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)
