"""EngineGrammar: constrained decoding as one engine uses it. The grammar backend and its GrammarCompiler are
built on first use (the backend's vocabulary tables take about a second; several for a 128k-token vocabulary),
or at start-up by `warm`; `bitmask_ops` (constrained/logits.py) allocates and applies token bitmasks, None
when the constrained extra's libraries are missing.

Shared by the callers' threads (compile at submit time) and the loop (masks: engine/loop/grammar_masks.py reads
`backend`, None until built).
"""

from __future__ import annotations

import os
import threading

import torch


class EngineGrammar:
    def __init__(self, backend_name: str, tokenizer, vocab_size: int, eos_token_ids: list[int], timeout_s: float):
        self.backend_name = backend_name  # "llguidance" | "xgrammar" (EngineConfig.grammar_backend)
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.timeout_s = timeout_s
        try:
            from prefixrt.constrained import logits as bitmask_ops
        except ImportError:
            bitmask_ops = None
        self.bitmask_ops = bitmask_ops
        self._compiler = None
        self._lock = threading.Lock()
        self._tables: threading.Thread | None = None  # start_warm's background build
        self._tables_error: BaseException | None = None

    @property
    def backend(self):
        """The GrammarBackend, or None until the compiler is built."""
        compiler = self._compiler
        return compiler.backend if compiler is not None else None

    def compiler(self):
        """The GrammarCompiler (built on first use, thread-safe)."""
        with self._lock:
            if self._compiler is None:
                from prefixrt.constrained import GrammarCompiler, make_backend

                # A mask inside a free-text JSON string walks most of the vocabulary (~1 ms a row for 128k
                # tokens): every core but the loop's and the detokenizer's fills rows.
                opts = {"mask_threads": max(2, min(16, (os.cpu_count() or 2) - 2))}
                backend = make_backend(self.backend_name, self.tokenizer, self.vocab_size, self.eos_token_ids, **opts)
                self._compiler = GrammarCompiler(backend, timeout_s=self.timeout_s)
            return self._compiler

    def use_backend(self, backend_name: str) -> None:
        """Drop the built backend: the next compile builds `backend_name` (benchmarks compare backends in one
        engine; requests compiled before keep their own matchers)."""
        with self._lock:
            self.backend_name, self._compiler = backend_name, None

    def warm(self, device: torch.device) -> None:
        """Build the backend and its vocabulary tables now (and, on CUDA, compile the mask kernel) instead of
        at the first constrained request. Raises what building raises. After start_warm: waits for its tables."""
        if self._tables is not None:
            self._tables.join()
            self._tables = None
            if self._tables_error is not None:
                error, self._tables_error = self._tables_error, None
                raise error
        else:
            self._warm_tables()
        self._warm_kernels(device)

    def start_warm(self) -> None:
        """Start building the backend and its vocabulary tables on a thread, so start-up's other steps (CUDA
        init, weights, kernel builds, graph capture) run meanwhile; `warm` then waits for it. The tables are
        host work that mostly leaves the GIL free; nothing here touches the GPU (capture may be running)."""

        def build() -> None:
            try:
                self._warm_tables()
            except BaseException as e:  # re-raised by warm, on the caller's thread
                self._tables_error = e

        self._tables = threading.Thread(target=build, name="prefixrt-grammar-warm", daemon=True)
        self._tables.start()

    def _warm_tables(self) -> None:
        backend = self.compiler().backend
        if getattr(backend, "string_lengths", False):
            backend.token_table()  # llguidance: JSON string lengths checked beside the grammar

    def _warm_kernels(self, device: torch.device) -> None:
        ops = self.bitmask_ops
        if device.type == "cuda" and ops is not None:
            # The mask kernel (a Triton kernel compiled on first use): row counts 1, a multiple of 16 and
            # neither, the variants Triton specialises integer arguments into.
            for rows in (1, 16, 17):
                logits = torch.zeros(rows, self.vocab_size, dtype=torch.float32, device=device)
                ops.apply_token_bitmask(logits, ops.allocate_bitmask(rows, self.vocab_size).to(device))
            torch.cuda.synchronize(device)
