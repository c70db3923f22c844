"""RequestStream: the channel from the scheduler loop (producer thread) to one caller (sync or asyncio).

The loop pushes StepOutput events; a sync caller blocks on get(), an asyncio caller awaits aget() (events
are handed to its event loop with call_soon_threadsafe, so no thread is parked per waiting request).
"""

from __future__ import annotations

import asyncio
import queue
from dataclasses import dataclass


@dataclass
class StepOutput:
    index: int  # which of the n samples
    token_ids: list[int]  # new tokens
    text: str | None  # new text when the loop tracks text (stop strings); None: the caller detokenizes
    logprobs: list[dict] | None = None
    finished: bool = False
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    choice_scores: dict | None = None
    final_text: str | None = None  # on the last event of a loop-tracked request: the whole (truncated) text
    input_logprobs: list[float] | None = None  # prompt logprobs asked for with Req.input_logprobs_from


class RequestStream:
    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        self._loop = loop
        self._q: queue.Queue | asyncio.Queue = asyncio.Queue() if loop is not None else queue.Queue()

    def push(self, item: StepOutput) -> None:
        """Called from the scheduler thread."""
        if self._loop is None:
            self._q.put(item)
        else:
            try:
                self._loop.call_soon_threadsafe(self._q.put_nowait, item)
            except RuntimeError:
                pass  # the caller's event loop is closed: nobody is listening any more

    def get(self, timeout: float | None = None) -> StepOutput:
        return self._q.get(timeout=timeout)

    async def aget(self) -> StepOutput:
        return await self._q.get()
