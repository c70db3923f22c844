"""The prompt-cache fields on the server's routes: a request's CachePlan (prefixrt/lowering/prompt_cache.py)
resolved to token counts of its prompt, and the engine's decision on its kept prefixes said back.

- `resolve`: the PromptCache of a lowered chat request (each breakpoint's conversation rendered and tokenized in a
  worker thread, as the prompt was), for SamplingParams.prompt_cache.
- The decision (Completion/Chunk.keep_report, cache/pins.py) travels on the first output. `KEEP_HEADER` says it
  on the response: `kept=<tokens>` when every kept prefix was granted, `kept=<tokens>; refused=<tokens>;
  reason=<tenant_limit|capacity|no_prefix_cache>` when one was not. A stream's headers wait for its first output
  (`first_then_rest`), so they can carry it; `prefixrt_kept_prefixes_refused_total` counts refusals.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from starlette.concurrency import run_in_threadpool

from prefixrt.lowering.prompt_cache import CachePlan
from prefixrt.prompt_cache import PromptCache
from prefixrt.server.sse import ClientDisconnected, until_disconnect

KEEP_HEADER = "x-prompt-cache-keep"


async def resolve(eng, plan: CachePlan | None, ids: list, lower: Callable[[list[dict]], object]) -> PromptCache | None:
    """The PromptCache of a prompt tokenized as `ids`. lower(messages) lowers a cut conversation as the request
    was lowered (a LoweredChat: messages, template_tools, template_kwargs), which the engine then encodes."""
    if plan is None or plan.empty:
        return None

    def encode(messages: list[dict]) -> list:
        chat = lower(messages)
        return eng.encode_chat(chat.messages, chat.template_tools, False, chat.template_kwargs)

    if all(bp.upto is None for bp in plan.breakpoints):
        return plan.resolve(ids, encode)  # nothing to render again
    return await run_in_threadpool(plan.resolve, ids, encode)


def keep_header(report: dict | None) -> dict[str, str]:
    """The response header for a keep_report ({} without one)."""
    if not report:
        return {}
    value = f"kept={report['kept_tokens']}"
    if report.get("refused_tokens"):
        value += f"; refused={report['refused_tokens']}; reason={report['reason']}"
    return {KEEP_HEADER: value}


def with_keep_header(response, report: dict | None):
    for k, v in keep_header(report).items():
        response.headers[k] = v
    return response


async def first_output(request, chunks: AsyncIterator, close: Callable[[], None]) -> tuple[object | None, AsyncIterator]:
    """first_then_rest(chunks), given up (close() called: the request aborted) if the client leaves first."""
    try:
        return await until_disconnect(request, first_then_rest(chunks))
    except ClientDisconnected:
        close()
        raise


async def first_then_rest(chunks: AsyncIterator) -> tuple[object | None, AsyncIterator]:
    """(the first item of an async iterator or None when it is empty, an iterator over all of its items)."""
    it = chunks.__aiter__()
    try:
        first = await it.__anext__()
    except StopAsyncIteration:
        return None, _empty()

    async def again():
        yield first
        async for x in it:
            yield x

    return first, again()


async def _empty():
    return
    yield
