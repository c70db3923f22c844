"""Provider: the interface adapters and the frontend depend on (never on engine internals).

Implemented by prefixrt.Engine (in-process) and prefixrt.RemoteEngine (a `prefixrt serve` server).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any, Protocol, runtime_checkable

from prefixrt.outputs import Chunk, Completion, EngineStats
from prefixrt.params import SamplingParams

Prompt = Any  # str | list[int] | list[dict] (chat messages)


@runtime_checkable
class Provider(Protocol):
    model_name: str

    @property
    def tokenizer(self) -> Any:
        """The HF tokenizer, or None when not available (a remote provider may not have it)."""

    def generate(self, prompt: Prompt | list[Prompt], params: SamplingParams | dict | None = None
                 ) -> Completion | list[Completion]: ...

    async def agenerate(self, prompt: Prompt | list[Prompt], params: SamplingParams | dict | None = None
                        ) -> Completion | list[Completion]: ...

    def stream(self, prompt: Prompt, params: SamplingParams | dict | None = None) -> Iterator[Chunk]: ...

    def astream(self, prompt: Prompt, params: SamplingParams | dict | None = None) -> AsyncIterator[Chunk]: ...

    def cache_prefix(self, prompt: Prompt, cache_salt: str | None = None) -> int: ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...
