"""SGLang's native HTTP API, so SGLang's clients and benchmark scripts run against `prefixrt serve` unchanged:
`POST /generate` in SGLang's dialect (a body with `text` or `input_ids`; app.py routes a body with prefixrt's
`prompt` / `prompts` to prefixrt's own /generate), `GET /get_model_info` (and `/model_info`), `GET /get_server_info`
(and `/server_info`), `GET /health_generate`. `/flush_cache` is app.py's (GET or POST, as SGLang takes it).

The request is lowered by prefixrt/lowering/sglang.py. Each output is SGLang's object:
`{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
"e2e_latency", ...logprobs}}`, where finish_reason is `{"type": "stop", "matched": <stop string or token id>}`,
`{"type": "length", "length": n}` or None while a stream runs. With return_logprob, meta_info carries
`input_token_logprobs` (prompt positions from logprob_start_len; the first prompt token's logprob is None) and
`output_token_logprobs`, each a list of `[logprob, token_id, text or None]`, and with top_logprobs_num
`output_top_logprobs` (a list of such triples per position; `input_top_logprobs` is empty: prompt positions
report their own token's logprob only, and asking for alternatives there is a 400).

A stream sends, as SGLang does by default, one SSE event per engine chunk holding the output so far (cumulative
`text`, `output_ids` and logprob lists; `index` the output's position in a batch), then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from prefixrt.engine.process.messages import PackedIds
from prefixrt.errors import InvalidRequest
from prefixrt.lowering.sglang import GenerateItem, GeneratePlan, LogprobRequest, lower_generate_request
from prefixrt.server.body import OffloadedBodyRoute
from prefixrt.server.errors import RequestFailed, error_response
from prefixrt.server.sse import JSON, SSE_DONE, EventStream, merge_streams, sse, until_disconnect

router = APIRouter(route_class=OffloadedBodyRoute)

_UNSUPPORTED = {"input_embeds": "input_embeds", "image_data": "images", "video_data": "video",
                "audio_data": "audio", "session_params": "sessions", "token_ids_logprob": "token_ids_logprob"}
HEALTH_PROMPT = "hi"  # /health_generate generates one token after it


def _engine(request: Request):
    return request.app.state.engine


def _model_info(request: Request) -> dict:
    eng = _engine(request)
    path = getattr(eng, "model_path", None) or eng.model_name
    return {"model_path": path, "tokenizer_path": path, "is_generation": True, "preferred_sampling_params": None,
            "weight_version": getattr(eng, "model_revision", None),
            "served_model_name": request.app.state.model_name, "has_image_understanding": False,
            "has_audio_understanding": False}


@router.get("/get_model_info")
async def get_model_info(request: Request):
    """SGLang's model card: `model_path` (the local folder the weights and tokenizer were loaded from, which
    SGLang's clients load a tokenizer and pick a chat template from), `is_generation`."""
    return JSON(_model_info(request))


@router.get("/model_info")
async def model_info(request: Request):
    return JSON(_model_info(request))


async def _server_info(request: Request) -> dict:
    eng = _engine(request)
    stats = (await run_in_threadpool(eng.stats)).to_dict()
    return {**_model_info(request), "context_length": getattr(eng, "max_context", None),
            "max_total_num_tokens": getattr(eng, "kv_total_tokens", None), "page_size": getattr(eng, "page_size", None),
            "version": request.app.version, "internal_states": [{**stats, "avg_spec_accept_length": None}]}


@router.get("/get_server_info")
async def get_server_info(request: Request):
    """The model card, the context and KV pool sizes, and `internal_states[0]`: the engine's stats."""
    return JSON(await _server_info(request))


@router.get("/server_info")
async def server_info(request: Request):
    return JSON(await _server_info(request))


@router.get("/health_generate")
async def health_generate(request: Request):
    """200 when the engine generates a token now (SGLang's deep health check); 503 otherwise."""
    eng = _engine(request)
    rid = f"health-{uuid.uuid4().hex}"
    try:
        c = await asyncio.wait_for(eng.agenerate(HEALTH_PROMPT, {"max_new_tokens": 1, "request_id": rid}), 60)
    except asyncio.TimeoutError:
        eng.abort(rid)
        return error_response(503, "the engine did not generate a token within 60 s", "server_error",
                              code="unhealthy", retry=True)
    if c.finish_reason == "abort":
        return error_response(503, f"the engine failed a one-token request: {c.error or 'aborted'}", "server_error",
                              code="unhealthy", retry=True)
    return JSON({})


def _refuse_unsupported(body) -> None:
    for name, what in _UNSUPPORTED.items():
        if getattr(body, name, None) not in (None, [], {}):
            raise InvalidRequest(f"{what} are not supported on /generate", param=name)
    lora = body.lora_path
    if lora not in (None, "") and not (isinstance(lora, list) and all(x in (None, "") for x in lora)):
        raise InvalidRequest("lora_path is not supported on /generate: name a LoRA adapter as `model` on the OpenAI "
                             "routes or the Messages API", param="lora_path")
    if body.return_hidden_states:
        raise InvalidRequest("hidden states are not returned", param="return_hidden_states")


async def generate(body, request: Request):
    """POST /generate in SGLang's dialect (called by app.py's /generate for a body with text or input_ids)."""
    started = time.perf_counter()
    _refuse_unsupported(body)
    fields = body.model_dump(include={"text", "input_ids", "sampling_params", "rid", "return_logprob",
                                      "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs"})
    plan = lower_generate_request(fields, lambda: uuid.uuid4().hex)
    eng, lc = _engine(request), request.app.state.lifecycle
    encoded = [await eng.aencode(PackedIds.of(it.prompt) if isinstance(it.prompt, list) else it.prompt)
               for it in plan.items]
    prompt_lps = [await _prompt_logprobs(eng, ids, it.logprobs) for ids, it in zip(encoded, plan.items)]
    rids = [it.params.request_id for it in plan.items]
    if not body.stream:
        async def run():
            return await asyncio.gather(*(eng.agenerate(ids, it.params) for ids, it in zip(encoded, plan.items)))

        with lc.serving(eng, rids):
            cs = await until_disconnect(request, run())
        latency = time.perf_counter() - started
        outputs: list = [None] * (len(plan.items) * plan.n)
        for k, (c, it) in enumerate(zip(cs, plan.items)):
            for j, s in enumerate(c.outputs or [c]):
                if s.finish_reason == "abort":
                    raise RequestFailed.for_abort(lc, s.error)
                out = _Output(it, prompt_lps[k], _sample_rid(it, j, plan.n))
                out.add(s)
                outputs[plan.output_position(k, j)] = out.to_dict(c.prompt_tokens, c.cached_tokens, latency, s)
        return JSON(outputs[0] if plan.single else outputs)
    opened = []
    try:
        for ids, it in zip(encoded, plan.items):
            opened.append(await eng.astream_open(ids, it.params, coalesce=True))
    except Exception:
        for r in rids:
            eng.abort(r)
        raise
    lc.register(eng, rids)

    def close():
        for r in rids:
            eng.abort(r)
        lc.release(rids)

    return EventStream(_events(plan, opened, prompt_lps, started, lc), on_close=close)


def _sample_rid(item: GenerateItem, sample: int, n: int) -> str:
    return item.params.request_id if n == 1 else f"{item.params.request_id}-{sample}"


async def _events(plan: GeneratePlan, streams: list, prompt_lps: list, started: float, lc) -> AsyncIterator[str]:
    outs: dict[int, _Output] = {}
    try:
        async for k, ch in merge_streams(streams):
            if ch.finish_reason == "abort":
                yield RequestFailed.for_abort(lc, ch.error).event()
                break
            it = plan.items[k]
            at = plan.output_position(k, ch.index)
            out = outs.get(at) or outs.setdefault(at, _Output(it, prompt_lps[k], _sample_rid(it, ch.index, plan.n)))
            out.add(ch)
            latency = time.perf_counter() - started if ch.finish_reason is not None else None
            event = out.to_dict(ch.prompt_tokens, ch.cached_tokens, latency, ch)
            if not plan.single:
                event["index"] = at
            yield sse(event)
    except Exception as e:  # a bug: end the stream with an error event rather than cutting it
        yield RequestFailed(500, f"internal error: {type(e).__name__}: {e}", code="internal_error").event()
    yield SSE_DONE


class _Output:
    """One output (a prompt's sample) being assembled from a Completion or a stream's Chunks."""

    def __init__(self, item: GenerateItem, prompt_logprobs: list | None, rid: str):
        self.ask: LogprobRequest | None = item.logprobs
        self.prompt_logprobs = prompt_logprobs
        self.rid = rid
        self.text = ""
        self.ids: list[int] = []
        self.entries: list[dict] = []

    def add(self, part) -> None:
        """Append a Completion's or a Chunk's text, ids and logprob entries."""
        self.text += part.text
        self.ids += list(part.token_ids)
        self.entries += part.logprobs or []

    def to_dict(self, prompt_tokens: int, cached_tokens: int, latency: float | None, last) -> dict:
        meta = {"id": self.rid, "finish_reason": _finish_reason(last), "prompt_tokens": prompt_tokens,
                "completion_tokens": last.completion_tokens, "cached_tokens": cached_tokens}
        if latency is not None:
            meta["e2e_latency"] = latency
        if self.ask is not None:
            text = self.ask.with_text
            meta["input_token_logprobs"] = self.prompt_logprobs or []
            meta["output_token_logprobs"] = [[e["logprob"], e["token_id"], e["token"] if text else None]
                                             for e in self.entries]
            if self.ask.top > 0:
                meta["input_top_logprobs"] = []
                meta["output_top_logprobs"] = [
                    [[t["logprob"], t["token_id"], t["token"] if text else None] for t in e.get("top_logprobs", [])]
                    for e in self.entries]
        return {"text": self.text, "output_ids": list(self.ids), "meta_info": meta}


def _finish_reason(last) -> dict | None:
    reason = last.finish_reason
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": last.completion_tokens}
    return {"type": reason, "matched": last.matched_stop}


async def _prompt_logprobs(eng, ids: list[int], ask: LogprobRequest | None) -> list | None:
    """`[logprob, token_id, text or None]` for the prompt's positions from ask.input_from (the first prompt token's
    logprob None: nothing predicts it), scored by the engine; None when none are asked for."""
    if ask is None or ask.input_from is None:
        return None
    if ask.input_from > len(ids):
        raise InvalidRequest(f"logprob_start_len {ask.input_from} is past the prompt's {len(ids)} tokens",
                             param="logprob_start_len")
    start = ask.input_from
    scored_from = max(start, 1)
    lps: list = []
    if scored_from < len(ids):
        _, _, (lps,) = await run_in_threadpool(eng.score_continuations, ids[:scored_from], [ids[scored_from:]])
    values = ([None] if start == 0 else []) + list(lps)
    texts = await run_in_threadpool(_token_texts, eng, ids[start:]) if ask.with_text else [None] * len(values)
    return [[lp, t, s] for lp, t, s in zip(values, ids[start:], texts)]


def _token_texts(eng, ids: list[int]) -> list[str]:
    tok = eng.tokenizer
    lock = getattr(eng, "tokenizer_lock", None)
    if lock is None:
        return [tok.decode([t]) for t in ids]
    with lock:
        return [tok.decode([t]) for t in ids]
