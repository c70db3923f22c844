"""The compile cache's folder key and the Triton build log (engine/compile_cache.py)."""

from __future__ import annotations

import os

import pytest

from prefixrt.engine import compile_cache as cc


def test_cache_folder_is_keyed_by_everything_a_kernel_depends_on(tmp_path):
    key = {"gpu": "NVIDIA H200", "driver": "550.54.15", "torch": "2.11", "triton": "3.6", "cuda": "12.8",
           "model": {"layers": 32, "heads": [(32, 8, 128)], "dtype": "torch.bfloat16"}}
    base = cc.cache_dir(tmp_path, key)
    assert base.parent == tmp_path and base.name.startswith("nvidia-h200-")
    assert cc.cache_dir(tmp_path, dict(key)) == base  # stable
    for field, other in [("gpu", "NVIDIA H100"), ("driver", "560.1"), ("torch", "2.12"), ("triton", "3.7"),
                         ("model", {**key["model"], "layers": 16})]:
        assert cc.cache_dir(tmp_path, {**key, field: other}) != base, field
    assert cc.cache_dir(None, key).parent == cc.DEFAULT_ROOT.expanduser()


def test_use_compile_cache_points_triton_there(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    folder = cc.use_compile_cache(tmp_path, "cpu", {"layers": 2})
    assert os.environ["TRITON_CACHE_DIR"] == str(folder / "triton") and (folder / "key.json").is_file()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder / "inductor")
    from triton import knobs

    assert knobs.cache.dir == str(folder / "triton")


def test_the_build_log_counts_builds_per_phase_and_keeps_earlier_hooks(monkeypatch):
    knobs = pytest.importorskip("triton").knobs
    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: seen.append("before") and None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append("after"))
    log = cc.CompileLog()
    assert log.install()

    class Fn:
        name = "_extend_kernel"

    assert not knobs.runtime.jit_cache_hook(fn=Fn(), key=1)  # never asks Triton to skip the build
    knobs.runtime.jit_post_compile_hook(fn=Fn(), key=1)
    log.mark_serving()
    knobs.runtime.jit_cache_hook(fn=Fn(), key=2)
    knobs.runtime.jit_post_compile_hook(fn=Fn(), key=2)
    assert log.counts == {"startup": 1, "serving": 1} and seen == ["before", "after"] * 2
    assert log.seconds["startup"] >= 0 and "_extend_kernel x1" in log.summary("startup")
