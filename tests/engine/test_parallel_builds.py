"""Start-up's Triton builds in worker processes (engine/parallel_builds.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from prefixrt.config.engine_config import EngineConfig
from prefixrt.engine.builder import start_build_pool
from prefixrt.engine.parallel_builds import BuildPool

REPO = Path(__file__).resolve().parents[2]

# Triton's serialized specialization of one variant of a real kernel, built the way Triton's jit_cache_hook
# hands it over (Triton before 3.7 leaves the target out: the pool adds it), then built by the worker function and
# by a pool started inside a daemonic process, as `prefixrt serve` runs its engine. Run without the interpreter
# (conftest sets it for tests): under TRITON_INTERPRET=1 @triton.jit gives interpreted functions, with nothing to
# build.
WORKER_SCRIPT = textwrap.dedent("""
    import inspect, multiprocessing, os, sys
    from types import SimpleNamespace
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import serialize_specialization_data
    from prefixrt.engine import parallel_builds as pb
    from prefixrt.kernels import norm

    fn = norm._add_rms_norm_kernel
    names = [p.name for p in fn.params]
    target = GPUTarget("cuda", 90, 32)
    options = make_backend(target).parse_options({"num_warps": 4})
    consts = {"HAS_RESIDUAL": True, "GEMMA": False, "BLOCK": 128, "USE_PDL": False}
    sig = {n: "*fp32" if i < 5 else "fp32" if n == "eps" else "constexpr" if n in consts else "i32"
           for i, n in enumerate(names)}
    constants = {(names.index(n),): v for n, v in consts.items()}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(5)}
    args = [fn.fn.__qualname__, sig, constants, attrs, options, "key"]
    if len(inspect.signature(serialize_specialization_data).parameters) == 7:
        args.append(target)
    spec = pb._with_target(serialize_specialization_data(*args), {"backend": "cuda", "arch": 90, "warp_size": 32})

    def in_a_daemon(cache, answers):
        os.environ["TRITON_CACHE_DIR"] = cache
        pool = pb.BuildPool(2)
        pool._on_miss(fn=SimpleNamespace(module=fn.fn.__module__, name=fn.fn.__qualname__),
                      compile={"specialization_data": spec})
        r = pool.wait()
        answers.put((r.variants, r.built, r.failed))

    if __name__ == "__main__":
        cache = sys.argv[1]
        print("built:", pb._build(fn.fn.__module__, fn.fn.__qualname__, spec, os.path.join(cache, "a")))
        print("entries:", len(os.listdir(os.path.join(cache, "a"))))
        print("unknown kernel:", pb._build(fn.fn.__module__, "no_such_kernel", spec, cache))
        ctx = multiprocessing.get_context("spawn")
        answers = ctx.Queue()
        p = ctx.Process(target=in_a_daemon, args=(os.path.join(cache, "b"), answers), daemon=True)
        p.start()
        print("daemon pool:", answers.get(timeout=240))
        p.join()
        print("daemon entries:", len(os.listdir(os.path.join(cache, "b"))))
""")


def test_a_worker_builds_a_variant_from_tritons_serialized_form(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    script = tmp_path / "worker_check.py"
    script.write_text(WORKER_SCRIPT)
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines() if ": " in line)
    assert lines["built"] == "None"  # built, into the given cache folder
    assert int(lines["entries"]) >= 1
    assert lines["unknown kernel"].startswith("AttributeError")  # a failure is reported, never raised
    assert lines["daemon pool"] == "(1, 1, [])"  # a pool inside a daemonic process (the server's engine) works
    assert int(lines["daemon entries"]) >= 1


def test_the_pool_starts_only_for_an_empty_compile_cache_on_one_triton_rank(tmp_path):
    one = SimpleNamespace(size=1)
    empty = tmp_path / "empty"
    (empty / "triton").mkdir(parents=True)
    filled = tmp_path / "filled"
    (filled / "triton" / "SOMEKERNEL").mkdir(parents=True)
    assert start_build_pool(EngineConfig(), None, one) is None  # no compile cache (or not CUDA)
    assert start_build_pool(EngineConfig(), filled, one) is None  # a filled cache loads its kernels
    assert start_build_pool(EngineConfig(compile_workers=0), empty, one) is None
    assert start_build_pool(EngineConfig(), empty, SimpleNamespace(size=2)) is None  # tensor parallel
    assert start_build_pool(EngineConfig(attention_backend="torch"), empty, one) is None
    pool = start_build_pool(EngineConfig(compile_workers=1), empty, one)
    try:
        assert isinstance(pool, BuildPool) and pool.workers == 1
        report = pool.wait()  # nothing was sent: an empty report
        assert (report.variants, report.built, report.failed) == (0, 0, [])
    finally:
        pool.close()


@pytest.mark.gpu
def test_the_dry_pass_skips_launches_and_the_workers_fill_the_disk_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    from prefixrt.kernels.norm import add_rms_norm

    from prefixrt.engine.compile_cache import COMPILES

    x = torch.randn(3, 200, device="cuda")
    w = torch.randn(200, device="cuda")
    pool = BuildPool(2)
    with pool.discovering():
        out, _ = add_rms_norm(x, w, 1e-6, gemma=True)
    report = pool.wait()
    assert (report.variants, report.built, report.failed) == (1, 1, [])
    COMPILES.install()
    before = COMPILES.seconds[COMPILES.phase]
    out, _ = add_rms_norm(x, w, 1e-6, gemma=True)  # the same variant: loaded from the disk cache
    assert COMPILES.seconds[COMPILES.phase] - before < 0.5
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
