"""Triton kernel builds in worker processes at start-up, for an empty compile cache.

Start-up's warm-up forwards and graph captures compile every Triton kernel variant a served workload can reach
(engine/builder.py), one after another on the engine's thread: on an H200 about 85 builds, 0.6 s each. Here they
are built side by side:

1. `BuildPool(workers)` starts worker processes while the engine loads: plain `python -m` subprocesses that never
   touch CUDA and read one build a line on stdin (the engine may itself run in a daemonic process, which
   multiprocessing forbids to have children; a closed stdin, as when the engine dies, ends a worker).
2. `with pool.discovering():` the warm-up forwards and the eager warm phase of graph capture run once as a dry
   pass. Triton calls its `jit_cache_hook` before building a variant it has not built in this process; the hook
   sends that variant's specialization (Triton's own serialized form) to a worker and returns True, which makes
   Triton skip the build and the launch. The dry pass's outputs are garbage and never used: the kernels read
   only indices the host wrote (request table, slots, plans), so a skipped kernel leaves nothing unsafe behind.
3. `pool.wait()`: every worker compiles its variants into the shared disk cache (TRITON_CACHE_DIR).
4. The real warm-up and capture run as before; each variant is then loaded from disk instead of built.

Anything a worker cannot build is built in the engine process in step 4 as without the pool, so the outcome never
depends on it; only the time does. `prebuild` runs steps 2-3 for a ModelRunner.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger("prefixrt")


def default_workers() -> int:
    """Worker processes when the config leaves it open: the host's cores less two (the engine's threads), 1-16."""
    return max(1, min(16, (os.cpu_count() or 2) - 2))


@dataclass
class BuildReport:
    variants: int = 0  # distinct kernel variants the dry pass found unbuilt
    built: int = 0  # of which the workers built (or found on disk)
    failed: list = field(default_factory=list)  # "kernel: error" for each one a worker could not build
    seconds: float = 0.0  # from the dry pass's start to the last build
    workers: int = 0

    def line(self) -> str:
        failed = f", {len(self.failed)} left to the engine process" if self.failed else ""
        return (f"parallel Triton builds: {self.built} of {self.variants} kernel variants built by {self.workers} "
                f"worker processes in {self.seconds:.1f}s{failed}")


class BuildPool:
    """Worker processes that build Triton kernel variants into the disk cache (see the module docstring)."""

    def __init__(self, workers: int):
        self.workers = workers
        self.jobs: queue.Queue = queue.Queue()  # (job line, future); None stops one feeder
        self.futures: dict[tuple, concurrent.futures.Future] = {}
        self.report = BuildReport(workers=workers)
        self._t0: float | None = None
        self._target: dict | None = None
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="",  # building needs no GPU: never take memory on one
                   PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        env.pop("TRITON_INTERPRET", None)
        self.procs = [subprocess.Popen([sys.executable, "-m", "prefixrt.engine.parallel_builds"], env=env, text=True,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
                      for _ in range(workers)]  # started now: they import torch and Triton while the engine loads
        self.feeders = [threading.Thread(target=self._feed, args=(proc,), daemon=True, name="prefixrt-build-feed")
                        for proc in self.procs]
        for t in self.feeders:
            t.start()

    def _feed(self, proc: subprocess.Popen) -> None:
        """Hand this worker one job at a time and resolve its future with the worker's answer."""
        while (item := self.jobs.get()) is not None:
            line, fut = item
            try:
                proc.stdin.write(line + "\n")
                proc.stdin.flush()
                answer = proc.stdout.readline()
                if not answer:
                    raise RuntimeError(f"the build worker exited (code {proc.poll()})")
                fut.set_result(json.loads(answer)["error"])
            except Exception as e:  # a dead worker: this and every later job it would take fail, not hang
                fut.set_result(f"{type(e).__name__}: {e}")

    @contextlib.contextmanager
    def discovering(self):
        """While inside: a Triton launch of a variant this process has not built is skipped and its build sent
        to a worker. Not thread-safe: the dry pass runs on the caller's thread alone."""
        from triton import knobs

        rt = knobs.runtime
        saved = rt.jit_cache_hook
        self._t0 = self._t0 or time.perf_counter()
        self._target = self._target or _current_target()
        rt.jit_cache_hook = self._on_miss
        try:
            yield self
        finally:
            rt.jit_cache_hook = saved

    def _on_miss(self, *args, **kwargs) -> bool:
        fn, compile_info = kwargs.get("fn"), kwargs.get("compile") or {}
        spec = compile_info.get("specialization_data")
        if fn is None or spec is None:
            return False  # a Triton without serialized specializations: build here, as always
        module, name = fn.module, fn.name
        key = (module, name, spec)
        if key not in self.futures:
            fut = self.futures[key] = concurrent.futures.Future()
            job = {"module": module, "name": name, "spec": _with_target(spec, self._target),
                   "cache_dir": os.environ.get("TRITON_CACHE_DIR")}
            self.jobs.put((json.dumps(job), fut))
        return True  # skip the build and the launch

    def wait(self) -> BuildReport:
        """Wait for every build sent so far; the workers stop. Returns the report."""
        r = self.report
        r.variants = len(self.futures)
        for (_, name, _), fut in self.futures.items():
            err = fut.result()
            if err is None:
                r.built += 1
            else:
                r.failed.append(f"{name}: {err}")
        if r.failed:
            log.warning("%d kernel variants could not be built in worker processes (first: %s); the engine process "
                        "builds them", len(r.failed), r.failed[0])
        r.seconds = time.perf_counter() - (self._t0 or time.perf_counter())
        self.close()
        return r

    def close(self) -> None:
        """Stop the feeders and the workers (a worker ends at the end of its stdin). Idempotent."""
        for _ in self.feeders:
            self.jobs.put(None)
        for proc in self.procs:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.feeders = []


def prebuild(pool: BuildPool, runner, warm_batches: list, capture_kwargs: dict | None) -> BuildReport:
    """Steps 2-3 of the module docstring for a ModelRunner: the dry pass over the warm-up batches and, with
    capture_kwargs (ModelRunner.capture_graphs' arguments), over graph capture's warm phase; then the builds."""
    try:
        with pool.discovering():
            runner.warm_up(warm_batches)
            if capture_kwargs is not None:
                runner.capture_graphs(**capture_kwargs, warm_only=True)
    except Exception as e:  # the real warm-up then builds whatever is left, as without the pool
        log.warning("the dry pass for parallel kernel builds stopped: %s", e, exc_info=True)
    return pool.wait()


def _current_target() -> dict | None:
    """The engine's GPU target as Triton serializes it, or None where there is none to ask."""
    try:
        from triton.runtime.driver import driver

        t = driver.active.get_current_target()
        return {"backend": t.backend, "arch": t.arch, "warp_size": t.warp_size}
    except Exception:
        return None


def _with_target(spec: str, target: dict | None) -> str:
    """Triton before 3.7 leaves the GPU target out of the serialized specialization; a worker has no GPU to ask."""
    obj = json.loads(spec)
    if "target" in obj or target is None:
        return spec
    return json.dumps({**obj, "target": target})


# ---------------------------------------------------------------------------------------------- in the workers
def _serve() -> None:
    """A worker: one JSON job a line on stdin ({module, name, spec, cache_dir}), one {"error": ...} line back."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever a build prints goes to stderr, never into the answers
    import torch  # noqa: F401  (imported once, before the first build arrives: the kernels' modules need it)
    import triton  # noqa: F401

    for line in sys.stdin:
        job = json.loads(line)
        answers.write(json.dumps({"error": _build(job["module"], job["name"], job["spec"], job["cache_dir"])}) + "\n")
        answers.flush()


def _build(module: str, name: str, spec: str, cache_dir: str | None) -> str | None:
    """Build one variant from Triton's serialized specialization into cache_dir. None, or why not."""
    import importlib

    try:
        if cache_dir:
            os.environ["TRITON_CACHE_DIR"] = cache_dir
        import triton

        fn = importlib.import_module(module)
        for part in name.split("."):
            fn = getattr(fn, part)
        src, target, options = _decode(fn, json.loads(spec))
        triton.compile(src, target=target, options=options)
        return None
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def _decode(fn, obj: dict):
    """(ASTSource, GPUTarget, options dict) from the dict of triton.runtime.jit.serialize_specialization_data, as
    JITFunction.preload reads it, without touching a device."""
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:
        from triton.compiler import make_backend
    except ImportError:
        from triton.compiler.compiler import make_backend

    def as_tuple(v):
        return tuple(as_tuple(x) for x in v) if isinstance(v, list) else v

    def constant(v):
        if isinstance(v, str) and tl.dtype.is_dtype(v):
            return tl.dtype(v)
        if isinstance(v, dict) and "constexpr" in v:
            return tl.constexpr(as_tuple(v["constexpr"]))
        if isinstance(v, dict):
            raise ValueError(f"a constant this build cannot decode: {v}")
        return as_tuple(v)

    constexprs = {tuple(k): constant(v) for k, v in zip(obj["constant_keys"], obj["constant_vals"])}
    attrs = {tuple(k): v for k, v in zip(obj["attrs_keys"], obj["attrs_vals"])}
    signature = {k: as_tuple(v) for k, v in obj["signature"].items()}
    target = GPUTarget(**obj["target"])
    options = make_backend(target).parse_options({k: as_tuple(v) for k, v in obj["options"].items()})
    return ASTSource(fn, signature, constexprs, attrs), target, options.__dict__


if __name__ == "__main__":
    _serve()
