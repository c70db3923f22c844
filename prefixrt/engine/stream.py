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
    timing: tuple | None = None  # on the last event: (queue_s, prefill_s, decode_s), postprocess.request_timing
    keep_report: dict | None = None  # on the first event: the decision on its kept prefixes (cache/pins.py)

    def __reduce__(self):
        # Pickled as a constructor call with the fields in order (an engine process sends one per request per
        # step): half the time to pickle and a third of the time to unpickle of the default field-name dict.
        # tests/engine/process/test_process_boundary.py checks that every field is here, in order.
        return (StepOutput, (self.index, self.token_ids, self.text, self.logprobs, self.finished, self.finish_reason,
                             self.matched_stop, self.prompt_tokens, self.cached_tokens, self.error,
                             self.choice_scores, self.final_text, self.input_logprobs, self.timing,
                             self.keep_report))


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

    @staticmethod
    def push_many(items: list[tuple[RequestStream, StepOutput]]) -> None:
        """Deliver a step's outputs: one wake-up per asyncio loop instead of one per token (each
        call_soon_threadsafe writes to the loop's self-pipe)."""
        by_loop: dict[int, tuple[asyncio.AbstractEventLoop, list]] = {}
        for stream, item in items:
            if stream._loop is None:
                stream._q.put(item)
            else:
                by_loop.setdefault(id(stream._loop), (stream._loop, []))[1].append((stream._q, item))
        for loop, pairs in by_loop.values():
            try:
                loop.call_soon_threadsafe(_deliver, pairs)
            except RuntimeError:
                pass  # that event loop is closed: nobody is listening any more

    def get(self, timeout: float | None = None) -> StepOutput:
        return self._q.get(timeout=timeout)

    async def aget(self) -> StepOutput:
        return await self._q.get()

    async def aget_ready(self) -> list[StepOutput]:
        """Wait for the next event, then take every event already queued behind it: [next, ...] in order.
        Never waits for more than the first (an asyncio caller only)."""
        items = [await self._q.get()]
        while not self._q.empty():
            items.append(self._q.get_nowait())
        return items


def _deliver(pairs) -> None:
    for q, item in pairs:
        q.put_nowait(item)
