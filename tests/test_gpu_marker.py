"""CUDA-only tests carry the `gpu` marker, the one way a test says it needs CUDA: tests/conftest.py skips such tests
where there is none, and benchmarks/gpu_tests.py runs exactly them on a GPU machine (docs/gpu-tests.md). A test
that skipped itself on a missing CUDA by other means would be run by neither."""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks.gpu_tests import gpu_test_files

TESTS = Path(__file__).resolve().parent
# skipif(not torch.cuda.is_available(), ...) / pytest.skip(...) under `if not torch.cuda.is_available()`
CUDA_SKIP = re.compile(r"skipif\(\s*not\s+[\w.\"()]*cuda\.is_available\(\)|if not [\w.]*cuda\.is_available\(\):\s*"
                       r"\n\s*pytest\.skip")


def test_no_test_skips_on_a_missing_cuda_but_through_the_gpu_marker():
    offenders = [str(p.relative_to(TESTS)) for p in TESTS.rglob("*.py")
                 if p != Path(__file__).resolve() and CUDA_SKIP.search(p.read_text())]
    assert offenders == [], "mark these tests @pytest.mark.gpu instead"


def test_the_gpu_run_selects_every_module_that_marks_a_test_gpu():
    mentions = {str(p.relative_to(TESTS.parent)) for p in TESTS.rglob("*.py")
                if p != Path(__file__).resolve() and "mark.gpu" in p.read_text()}
    assert set(gpu_test_files()) == mentions  # (a `marks=pytest.mark.gpu` form the selection misses shows here)
    assert {"tests/cache/test_transfer_cuda.py", "tests/engine/test_gpu_release.py",
            "tests/engine/test_parallel_builds.py", "tests/kernels/test_pdl.py",
            "tests/kernels/test_attention_kernels.py", "tests/constrained/test_logits.py"} <= mentions
