"""Mutations the test suite must catch (docs/mutations.md): each plants one bug in a temporary copy of the repo and
runs only the tests meant to catch it. Not part of CI (a full run takes minutes, the FP8 one far longer); run it
before changing these tests and whenever the code of a mutation changes.

    PYTHONPATH=$PWD python -m tests.mutations [NAME ...] [--list] [--baseline] [--timeout S]

Prints `caught` / `NOT caught` per mutation (a test of it failed / all passed; `INCONCLUSIVE` when the run outlasted
--timeout: the FP8 test alone takes tens of minutes on a busy 2-core machine). A mutation whose tests need CUDA is
reported as not run on a machine without one. A mutation with `pending` names the change that will make its test
catch it; until then `NOT caught` is its expected result. --baseline first runs each mutation's tests on the
unmutated copy (they must pass, or a failure would prove nothing). Exit status 1 when a mutation that should be
caught was not (or its baseline failed), else 0.
tests/test_mutations.py checks, in CI, that every mutation still applies (its search text occurs once).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    bug: str  # what the mutation plants, in one line
    path: str  # the file it edits (relative to the repo)
    search: str  # text that occurs exactly once in that file
    replace: str
    tests: tuple[str, ...]  # pytest node ids that must catch it
    gpu: bool = False  # its tests need CUDA
    pending: str | None = None  # not caught yet: the change that will make its test catch it


MUTATIONS = (
    # ---- the weak checks found by mutation (each made exact)
    Mutation(
        "gemma3-causal-images", "Gemma-3 image blocks attend causally (the bidirectional spans dropped)",
        "prefixrt/model/vision.py", "                mine.append((start, end))", "                pass",
        ("tests/engine/test_vlm_engine.py::test_gemma3_logprobs_match_transformers_where_image_attention_matters",)),
    Mutation(
        "penalty-skips-images", "repetition penalty not applied to requests with images",
        "prefixrt/sampling/sampler.py", "        if p.repetition_penalty != 1.0 and r.all_ids:",
        "        if p.repetition_penalty != 1.0 and r.all_ids and r.images is None:",
        ("tests/engine/test_vlm_engine.py::test_repetition_penalty_with_images_equals_transformers",)),
    Mutation(
        "warm-up-misses-a-variant", "the extend dispatch leaves short extends unpacked, a variant the warm-up never builds",
        "kernels/extend_attention.py", "        pack_heads = pack_heads_by_default(heads_per_kv, has_map, block_m)\n",
        "        pack_heads = pack_heads_by_default(heads_per_kv, has_map, block_m) and max_extend_len > 8\n",
        ("tests/engine/test_warm_up_coverage.py",)),
    Mutation(
        "retraction-drops-its-kv", "a request retracted for memory frees its decoded K/V instead of publishing it",
        "prefixrt/cache/kv_manager.py", "        if self.cache.retains:\n            self.cache_unfinished(req)\n",
        "        if self.cache.retains:\n            if not to_host:\n                self.cache_unfinished(req)\n",
        ("tests/engine/loop/test_scheduler.py::test_out_of_memory_retracts_lowest_priority_and_it_resumes_on_its_published_kv",
         "tests/engine/test_engine.py::test_a_request_retracted_for_memory_resumes_on_its_own_kv")),
    Mutation(
        "no-nan-poison", "debug mode no longer poisons freed slots with NaN (a read before a load lands goes unseen)",
        "prefixrt/cache/kv_pool.py", "        if slots.numel() == 0 or not self.dtype.is_floating_point:\n            return",
        "        if True:\n            return",
        ("tests/engine/test_memory_pressure.py::test_a_forward_not_waiting_for_its_load_reads_poisoned_slots",)),
    Mutation(
        "fp8-smoothing-skipped", "quantize-at-load skips the smoothing of the FP8 linears' inputs (per-token "
        "activation scales then cost +2.57% perplexity on Gemma-3-270M against +1.11% smoothed)",
        "prefixrt/model/quantize.py",
        "    if smoothing and not any(m.weight_scale is not None for m in fp8_linears(model).values()):",
        "    if False:",
        ("tests/engine/test_fp8_engine.py::test_fp8_engine_smooths_before_quantizing",
         "tests/model/test_fp8_accuracy.py::test_fp8_weights_and_kv_cache_keep_accuracy")),
    Mutation(
        "cuda-copy-wrong-host-runs", "the host tier's CUDA copies read every staging chunk from the first chunk's host "
        "slots", "prefixrt/cache/transfer.py", "                runs = _runs(host_slots[c:c + m])",
        "                runs = _runs(host_slots[:m])",
        ("tests/cache/test_transfer_cuda.py",), gpu=True),
    Mutation(
        "dry-pass-without-hook", "parallel builds' dry pass never hooks Triton (every variant built on the engine's "
        "thread)", "prefixrt/engine/parallel_builds.py", "        rt.jit_cache_hook = self._on_miss\n",
        "        rt.jit_cache_hook = saved\n",
        ("tests/engine/test_parallel_builds.py::test_the_dry_pass_skips_launches_and_the_workers_fill_the_disk_cache",),
        gpu=True),
    Mutation(
        "auto-without-calls", 'tool_choice="auto" decodes text only (the grammar\'s calls branch dropped)',
        "prefixrt/lowering/tools.py", '            lines += ["start: TEXT | calls", f"TEXT: {text}"]',
        '            lines += ["start: TEXT", f"TEXT: {text}"]',
        ("tests/server/test_native_tools.py::test_auto_gives_the_branch_the_model_picks",)),
    Mutation(
        "serve-refuses-large-images", "`prefixrt serve` limits request bodies to 256 KiB by default (large images: 413)",
        "prefixrt/server/settings.py", "max_request_bytes: int = setting(DEFAULT_MAX_BODY_BYTES,",
        "max_request_bytes: int = setting(256 * 1024,",
        ("tests/server/test_images.py::test_image_over_a_socket_to_prefixrt_serve",)),
    Mutation(
        "fp8-checkpoint-per-tensor-refused", "compressed-tensors checkpoints with per-tensor weight scales refused",
        "prefixrt/hub/fp8_checkpoint.py", '        if strategy not in ("channel", "tensor", "block"):',
        '        if strategy not in ("channel", "block"):',
        ("tests/hub/test_fp8_checkpoints.py::test_compressed_tensors_checkpoints",)),
    Mutation(
        "session-prefetch-is-a-use", "a session prefetch's lookup touches the path, so a prefetched prefix outranks "
        "prefixes used since", "prefixrt/cache/tier_loads.py",
        "        m = cache.match_prefix(ids, salt, touch=False)\n        if not m.host_length:\n            return None\n",
        "        m = cache.match_prefix(ids, salt)\n        if not m.host_length:\n            return None\n",
        ("tests/cache/test_session_prefetch.py::test_prefetch_keeps_the_prefix_recency",)),
    Mutation(
        "session-prefetch-ignores-running-need", "session prefetch takes every free page, the running requests' "
        "remaining need included", "prefixrt/engine/loop/scheduler.py",
        "        sp.run(kv.allocator.free_pages - reserved)", "        sp.run(kv.allocator.free_pages)",
        ("tests/cache/test_session_prefetch.py::"
         "test_prefetch_takes_free_pages_only_never_a_running_request_or_a_cached_prefix",)),
    # ---- caught before the checks above were made exact (they must stay caught)
    Mutation(
        "v-not-loaded", "a load from the host tier copies K back but not V",
        "prefixrt/cache/transfer.py",
        "                        byte_view(self.pool.v_buffers[layer]).index_copy_(0, g, byte_view(block[:, layer, 1]))\n",
        "                        pass\n",
        ("tests/engine/test_memory_pressure.py::test_host_tier_under_pressure_equals_unbounded_pool",)),
    Mutation(
        "backup-counts-no-copy", "a backup to the host tier is counted but copies nothing",
        "prefixrt/cache/transfer.py", "                        byte_view(self.host.kv[:, layer]).index_copy_(0, h, byte_view(kv))\n",
        "                        pass\n",
        ("tests/engine/test_memory_pressure.py::test_host_tier_under_pressure_equals_unbounded_pool",)),
    Mutation(
        "spec-accepts-wrong-draft", "speculation goes on accepting drafts after one the target rejected",
        "prefixrt/engine/loop/speculate.py", "            if draft is None or tok != draft:\n                break\n",
        "            if draft is None:\n                break\n",
        ("tests/engine/test_speculative.py::test_greedy_outputs_identical_to_no_speculation",)),
    Mutation(
        "residual-keeps-draft", "rejection sampling leaves the rejected draft in the residual it redraws from",
        "prefixrt/speculative/rejection.py", "        residual[draft] = 0\n", "        pass\n",
        ("tests/speculative/test_rejection.py",)),
    Mutation(
        "image-hash-ignores-pixels", "an image's cache key hashes its size and settings but not its pixels",
        "prefixrt/multimodal/images.py", "    h.update(image.tobytes())\n", "",
        ("tests/engine/test_vlm_engine.py::test_different_images_of_one_size_never_share",)),
)

_IGNORE = shutil.ignore_patterns(".git", "__pycache__", "*.pyc", ".venv", "venv", ".whl", "*.egg-info",
                                 ".ruff_cache", ".pytest_cache", "node_modules")


def apply(m: Mutation, root: Path) -> None:
    """Plant m in the tree at root. Raises ValueError when its search text does not occur exactly once."""
    path = root / m.path
    text = path.read_text()
    if text.count(m.search) != 1:
        raise ValueError(f"{m.name}: the search text occurs {text.count(m.search)} times in {m.path}")
    path.write_text(text.replace(m.search, m.replace))


def run_tests(root: Path, tests: tuple[str, ...], timeout: float) -> tuple[int, str]:
    """pytest on `tests` in the tree at root (its own code imported): (exit status, the summary line)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *tests]
    try:
        out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout:.0f} s"
    lines = [line.strip("= ") for line in (out.stdout + out.stderr).splitlines()
             if re.search(r"\d+ (passed|failed|error|errors|skipped)\b", line)]
    return out.returncode, lines[-1] if lines else (out.stdout + out.stderr).strip()[-300:]


def verdict(rc: int, summary: str) -> str:
    if rc == 0:
        return "NOT caught (all its tests skipped)" if "passed" not in summary else "NOT caught"
    if rc == 1:
        return "caught"
    if rc == 2:
        return "caught (collection failed or the run was interrupted)"
    if rc == 124:
        return "INCONCLUSIVE (its tests timed out: --timeout)"
    return f"ERROR (pytest exit {rc})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="mutations to run (default: all)")
    ap.add_argument("--list", action="store_true", help="list the mutations and their tests, run nothing")
    ap.add_argument("--baseline", action="store_true", help="first run each mutation's tests unmutated")
    ap.add_argument("--timeout", type=float, default=2400, help="seconds per pytest run (default 2400)")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    unknown = set(args.names) - {m.name for m in MUTATIONS}
    if unknown:
        ap.error(f"unknown mutations: {sorted(unknown)}")
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.bug}\n    {m.path}; tests: {' '.join(m.tests)}")
        return 0
    import torch

    cuda = torch.cuda.is_available()
    failures = 0
    with tempfile.TemporaryDirectory(prefix="prefixrt-mutants-") as tmp:
        for m in chosen:
            t0 = time.monotonic()
            if m.gpu and not cuda:
                print(f"{m.name:36s} not run here: its tests need a CUDA GPU ({' '.join(m.tests)})", flush=True)
                continue
            root = Path(tmp) / m.name
            shutil.copytree(REPO, root, ignore=_IGNORE)
            if args.baseline:
                rc, summary = run_tests(root, m.tests, args.timeout)
                if rc != 0:
                    failures += 1
                    print(f"{m.name:36s} BASELINE FAILED (unmutated: {summary})", flush=True)
                    continue
            apply(m, root)
            rc, summary = run_tests(root, m.tests, args.timeout)
            result = verdict(rc, summary)
            note = ""
            if m.pending is not None:
                note = f"  [expected: NOT caught until {m.pending}]"
            elif not result.startswith("caught"):
                failures += 1
            print(f"{m.name:36s} {result} ({summary}; {time.monotonic() - t0:.0f} s){note}", flush=True)
            shutil.rmtree(root, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
