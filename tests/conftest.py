"""Shared fixtures: tiny transformers checkpoints, a tiny byte-level tokenizer, and engines built on them (tiny
VLMs too: `vlm_checkpoints`, `make_vlm`).

Every engine made through `make_engine` is checked at teardown: idle, kv_free + kv_evictable == kv_total,
kv_locked == 0, and the internal accounting (free + cached + private == total) holds.

The real Gemma-3-270M: `gemma_engine_session` (in-process) and `gemma_server_session` (`prefixrt serve`), one of
each for the whole session; tests that only read from the model use these instead of building their own.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

# Without a GPU the Triton kernels run under the CPU interpreter. The variable must be set before triton is
# first imported, and collecting any test module may import it (llguidance does), so it is set here, in the
# root conftest, which pytest loads before collecting any test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.helpers.engines import assert_idle_and_clean, check_and_shut_down, make_tiny_tokenizer  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    """A test marked `gpu` needs CUDA: without it, it is skipped (benchmarks/gpu_tests.py runs every such test on a
    GPU machine and writes the summary to docs/gpu-tests.md)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none here); benchmarks/gpu_tests.py runs it on one")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def underestimated_decode(monkeypatch):
    """Admission that reserves one decode token per request (its estimate far too low), so a small pool fills
    while requests decode and the scheduler must retract: the last-resort path, exercised on purpose."""
    from prefixrt.engine.loop.admission import DecodeEstimate

    def remaining(self, req):
        return min(1, max(0, req.params.max_new_tokens - len(req.output_ids) - req.num_unresolved))

    monkeypatch.setattr(DecodeEstimate, "remaining", remaining)


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    """A byte-level BPE with 320 ids (matching the tiny checkpoints' vocab): <pad>=0, <bos>=1, <eos>=2."""
    return make_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """name -> (folder, transformers model) for every architecture, built once per session."""
    from tests.helpers.checkpoints import save_tiny_checkpoint

    cache = {}

    def get(name: str):
        if name not in cache:
            path = tmp_path_factory.mktemp(f"ckpt-{name}")
            cache[name] = (path, save_tiny_checkpoint(name, path))
        return cache[name]

    return get


@pytest.fixture
def make_engine(tiny_checkpoints, tiny_tokenizer):
    """make_engine(arch="llama", folder=None, **engine_kwargs) -> Engine on a tiny checkpoint (CPU, fp32); folder:
    a checkpoint folder of its own instead of tiny_checkpoints(arch)."""
    from prefixrt.engine.engine import Engine
    from prefixrt.hub.loader import load_model

    engines = []

    def make(arch: str = "llama", folder=None, **kwargs):
        path = folder if folder is not None else tiny_checkpoints(arch)[0]
        model = load_model(path, dtype="float32", device="cpu")
        resolved = SimpleNamespace(name=f"tiny-{arch}", revision="test", extra_eos_token_ids=(), path=str(path))
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("debug", True)
        kwargs.setdefault("kv_cache_tokens", 4096)
        if os.environ.get("PREFIXRT_TEST_CACHE_AUDIT"):  # e.g. 1.0: audit cache hits in every engine test
            kwargs.setdefault("cache_audit_rate", float(os.environ["PREFIXRT_TEST_CACHE_AUDIT"]))
        eng = Engine(f"tiny-{arch}", _parts=(model, tiny_tokenizer, resolved), **kwargs)
        engines.append(eng)
        return eng

    yield make
    check_and_shut_down(*engines, skip_stopped=True)  # (a test that restarts an engine checks the first one itself)


@pytest.fixture(scope="session")
def vlm_checkpoints(tmp_path_factory):
    """name -> (folder, transformers model) of the tiny vision-language checkpoints (tests/helpers/checkpoints.py
    VLM_NAMES), each with its image processor, built once per session."""
    from tests.helpers.checkpoints import save_tiny_vlm_checkpoint

    cache = {}

    def get(name: str):
        if name not in cache:
            path = tmp_path_factory.mktemp(f"vlm-{name}")
            cache[name] = (path, save_tiny_vlm_checkpoint(path, name)[0])
        return cache[name]

    return get


@pytest.fixture
def make_vlm(vlm_checkpoints, make_engine):
    """make_vlm(name="gemma3_vlm", **engine_kwargs) -> Engine on a tiny VLM (CPU, fp32, the tiny tokenizer)."""
    return lambda name="gemma3_vlm", **kwargs: make_engine(name, folder=vlm_checkpoints(name)[0], **kwargs)


# ---------------------------------------------------------------------------------------------- Gemma-3-270M
# One Gemma engine and one Gemma server for the whole session (each holds 2.5-3.3 GB): every test that only
# reads from the real model shares them. Tests that need other engine options build their own.

GEMMA = "gemma-3-270m"


def skip_without_gemma() -> None:
    """Skip the calling test when the embedded Gemma-3-270M's package is not installed."""
    from prefixrt.hub.registry import list_models

    row = next((r for r in list_models() if r["name"] == GEMMA), None)
    if row is None or not row["available"]:
        pytest.skip(f"{GEMMA} is unavailable: {row and row['unavailable_reason']}")


@pytest.fixture(scope="session")
def gemma_engine_session():
    """THE in-process Gemma-3-270M of the test session, built on first use and shut down at session end.

    Options: `Engine("gemma-3-270m", device="cpu", dtype="float32", debug=True)` (debug: KV accounting is checked
    at every idle step and freed slots are poisoned with NaN), the default CPU KV pool. It is also the engine
    that `prefixrt.LM("gemma-3-270m")`, `ChatPrefixRT(model="gemma-3-270m")` and
    `prefixrt.adapters.provider_handle.shared_engine("gemma-3-270m")` return while the fixture is active, so adapter
    tests that name the model reach this engine too.

    Contract for users: only read from it. Do not shut it down or change its settings, and leave it idle (no
    request running or waiting) when the test ends. The radix cache is shared, so assert lower bounds on
    cached tokens (or `flush_cache()` first), never exact counts that depend on earlier tests. Skips the test
    when the model's package is missing. At teardown the engine must be idle and clean (assert_idle_and_clean).
    """
    from prefixrt.adapters import provider_handle

    from prefixrt.engine.engine import Engine

    skip_without_gemma()
    eng = Engine(GEMMA, device="cpu", dtype="float32", debug=True, progress=False)
    key = (GEMMA, ())  # shared_engine's key for the model with no engine kwargs (what LM(model) passes)
    with provider_handle._shared_lock:
        provider_handle._shared_engines[key] = eng
    try:
        assert provider_handle.shared_engine(GEMMA) is eng, "adapters' shared_engine key changed: update this fixture"
        yield eng
        assert_idle_and_clean(eng)
    finally:
        with provider_handle._shared_lock:
            if provider_handle._shared_engines.get(key) is eng:
                del provider_handle._shared_engines[key]
        eng.shutdown()


@pytest.fixture(scope="session")
def gemma_server_session(tmp_path_factory):
    """THE live `prefixrt serve --model gemma-3-270m --device cpu --debug` of the test session, a subprocess on
    127.0.0.1 in its own process group (killed with the test process), started on first use and stopped at
    session end. Yields a tests.helpers.serve.ServeProcess: `.url` (the base URL; the OpenAI API is under
    `/v1`), `.stats()`, `.log()`.

    Contract for users: the same as gemma_engine_session's (only read; leave it idle; cached-token counts depend
    on earlier tests unless you flush the cache). At teardown its /stats must show it idle with every KV slot
    free or evictable, with no traceback in its log.
    """
    from tests.helpers.serve import ServeProcess, assert_clean

    skip_without_gemma()
    args = ["--model", GEMMA, "--device", "cpu", "--debug", "--log-level", "warning"]
    with ServeProcess(args, tmp_path_factory.mktemp("gemma-serve") / "serve.log", ready_timeout=300) as live:
        yield live
        assert_clean(live.wait_idle())
        assert "Traceback" not in live.log(), live.log()[-3000:]
        # Then the group is killed: a clean exit on SIGTERM is the tiny `server` fixture's check
        # (tests/server/conftest.py), the same code path, without the model's slow shutdown.


@pytest.fixture(scope="session")
def gemma_reference_session():
    """transformers' greedy continuations on the converted Gemma-3-270M folder, computed once per session (the
    model is loaded for this only, not kept): the oracle of the engine test and the subject of the
    converted-folder test. A SimpleNamespace:

    - folder: the converted folder (resolve_model("gemma-3-270m").path);
    - continuations: greedy_reference(folder, PROMPTS), MAX_NEW_TOKENS new token ids per prompt of
      tests.helpers.gemma_oracle.PROMPTS (fp32, eager attention);
    - rerun_first: a second greedy run of PROMPTS[0] on the same loaded model (a determinism check).
    """
    from prefixrt.hub.registry import resolve_model
    from tests.helpers.gemma_oracle import PROMPTS, greedy, load_reference

    skip_without_gemma()
    folder = str(resolve_model(GEMMA).path)
    tokenizer, model = load_reference(folder)
    continuations = greedy(tokenizer, model, PROMPTS)
    rerun_first = greedy(tokenizer, model, PROMPTS[:1])[0]
    del model
    return SimpleNamespace(folder=folder, continuations=continuations, rerun_first=rerun_first)
