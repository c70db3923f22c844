"""Kernel tests run under Triton's CPU interpreter when no GPU is present. The variable must be set before
triton is first imported, which is why it lives here rather than in the test module."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

_EMPTY, _EMPTY_LIKE = torch.empty, torch.empty_like


def _nan_filled(t):
    return t.fill_(float("nan")) if t.is_floating_point() and t.dtype.itemsize > 1 else t


@pytest.fixture(autouse=True)
def uninitialised_memory_is_nan(monkeypatch):
    """Float tensors from torch.empty / empty_like hold NaN here: a kernel that leaves part of its output or
    workspace unwritten, or reads a stale partial, fails every run instead of when the allocator hands back
    memory that happens to hold NaN (bytes and e4m3 tensors are left alone: every bit pattern is a value)."""
    monkeypatch.setattr(torch, "empty", lambda *a, **k: _nan_filled(_EMPTY(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: _nan_filled(_EMPTY_LIKE(*a, **k)))
