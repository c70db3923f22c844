"""The persistent compile cache and the record of what Triton compiled.

`use_compile_cache` points Triton's on-disk kernel cache (and TorchInductor's, for anything torch.compile'd) at
a folder keyed by what a compiled kernel depends on: the GPU, its driver, the torch / Triton / CUDA versions and
the model's shape. The first start on a machine fills it; later starts, and replicas shipped with the folder,
load every kernel from it instead of compiling. A key that differs (another GPU, a driver update) gets a folder
of its own, so a stale kernel is never loaded.

`COMPILES` counts every kernel Triton builds in this process (its JIT cache missed: compiled anew or loaded
from the disk cache), through Triton's compile hooks, split into start-up and serving: a served workload after
start-up should compile nothing (benchmarks/gpu_server.py checks it; the engine's metrics export both).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_ROOT = Path("~/.cache/prefixrt/compile")


def machine_key(device, model_shape: dict) -> dict:
    """What a compiled kernel depends on: GPU name and compute capability, driver, torch / Triton / CUDA
    versions, and the model's shape (layers, heads, head dim, hidden and vocabulary sizes, dtype...)."""
    import torch

    key: dict = {"torch": torch.__version__, "cuda": torch.version.cuda, "model": model_shape}
    try:
        import triton

        key["triton"] = triton.__version__
    except ImportError:
        key["triton"] = None
    if getattr(device, "type", str(device)) == "cuda":
        props = torch.cuda.get_device_properties(device)
        key["gpu"] = props.name
        key["capability"] = f"{props.major}.{props.minor}"
        key["driver"] = _driver_version()
    else:
        key["gpu"] = str(device)
    return key


def _driver_version() -> str | None:
    try:  # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15 ..."
        first = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
        return next((w for w in first.split() if w[:1].isdigit() and "." in w), first)
    except (OSError, IndexError):
        pass
    try:
        import torch

        return str(torch._C._cuda_getDriverVersion())
    except Exception:
        return None


def cache_dir(root: str | os.PathLike | None, key: dict) -> Path:
    """root / '<gpu>-<hash of key>': one folder per key (the key itself written beside the kernels)."""
    base = Path(root).expanduser() if root else DEFAULT_ROOT.expanduser()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    gpu = "".join(c if c.isalnum() else "-" for c in str(key.get("gpu", "device"))).strip("-").lower()
    return base / f"{gpu}-{digest}"


def use_compile_cache(root: str | os.PathLike | None, device, model_shape: dict) -> Path:
    """Point Triton's cache (TRITON_CACHE_DIR) and TorchInductor's (TORCHINDUCTOR_CACHE_DIR) at
    cache_dir(root, key) for this process (before anything compiles). Returns the folder."""
    key = machine_key(device, model_shape)
    folder = cache_dir(root, key)
    (folder / "triton").mkdir(parents=True, exist_ok=True)
    (folder / "key.json").write_text(json.dumps(key, indent=1, sort_keys=True, default=str))
    os.environ["TRITON_CACHE_DIR"] = str(folder / "triton")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "inductor")
    return folder


def model_shape(model, dtype) -> dict:
    """The shape fields of a model that its kernels' compiled code depends on."""
    layers = getattr(model, "attention_layers", [])
    return {
        "class": type(model).__name__, "layers": len(layers), "dtype": str(dtype),
        "heads": sorted({(a.num_heads, a.num_kv_heads, a.head_dim) for a in layers}),
        "vocab": getattr(model, "vocab_size", None),
        "hidden": getattr(getattr(model, "config", None), "hidden_size", None),
        "intermediate": getattr(getattr(model, "config", None), "intermediate_size", None),
    }


def count_cached_kernels(folder: Path | None) -> int:
    """Kernels in a Triton cache folder (one subfolder each)."""
    d = None if folder is None else Path(folder) / "triton"
    try:
        return sum(1 for _ in d.iterdir()) if d is not None else 0
    except OSError:
        return 0


@dataclass
class CompileLog:
    """Counts Triton's kernel builds per phase ('startup' until mark_serving(), then 'serving')."""

    phase: str = "startup"
    counts: dict = field(default_factory=lambda: {"startup": 0, "serving": 0})
    seconds: dict = field(default_factory=lambda: {"startup": 0.0, "serving": 0.0})
    kernels: dict = field(default_factory=dict)  # (phase, kernel name) -> builds
    installed: bool = False
    _open: dict = field(default_factory=dict)  # thread id -> start time of its build in progress
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def install(self) -> bool:
        """Chain onto Triton's compile hooks (once per process). False where Triton has none."""
        if self.installed:
            return True
        try:
            from triton import knobs
        except ImportError:
            return False
        rt = knobs.runtime
        before, after = rt.jit_cache_hook, rt.jit_post_compile_hook

        def on_build(*args, **kwargs):
            with self._lock:
                self._open[threading.get_ident()] = time.perf_counter()
                self.counts[self.phase] += 1
                name = getattr(kwargs.get("fn"), "name", "?")
                k = (self.phase, name)
                self.kernels[k] = self.kernels.get(k, 0) + 1
            return before(*args, **kwargs) if before else None  # a true result would skip the build

        def on_built(*args, **kwargs):
            with self._lock:
                t0 = self._open.pop(threading.get_ident(), None)
                if t0 is not None:
                    self.seconds[self.phase] += time.perf_counter() - t0
            return after(*args, **kwargs) if after else None

        rt.jit_cache_hook, rt.jit_post_compile_hook = on_build, on_built
        self.installed = True
        return True

    def mark_serving(self) -> None:
        with self._lock:
            self.phase = "serving"

    def summary(self, phase: str = "startup") -> str:
        by_kernel = sorted(((n, c) for (p, n), c in self.kernels.items() if p == phase), key=lambda x: -x[1])
        names = ", ".join(f"{n} x{c}" for n, c in by_kernel) or "none"
        return f"{self.counts[phase]} Triton kernel builds in {self.seconds[phase]:.1f}s ({names})"


COMPILES = CompileLog()
