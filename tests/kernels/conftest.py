"""Kernel tests run under Triton's CPU interpreter when no GPU is present. The variable must be set before
triton is first imported, which is why it lives here rather than in the test module."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
