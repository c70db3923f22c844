"""Drop-in OpenAI clients backed by an in-process Engine: no server, no sockets.

    from prefixrt.openai import OpenAI
    client = OpenAI(model="smollm2-135m-instruct")          # or OpenAI(engine=eng)
    client.chat.completions.create(model="smollm2-135m-instruct", messages=[...])

The returned objects are real `openai.OpenAI` / `openai.AsyncOpenAI` clients; their httpx client's transport
runs the server's own ASGI app in-process (prefixrt.server.app.create_app), so requests, responses, errors and
streaming are exactly those of `prefixrt serve`. Streams arrive incrementally; breaking out of one aborts it.
The `model` field of requests is not checked (the server's `--any-model-name`): whatever name the calling code
uses is served by this engine, so code written for a vendor's model name runs unchanged.
"""

from __future__ import annotations

from typing import Any

try:
    import httpx
    import openai as _openai

    from prefixrt.server.app import create_app
except ModuleNotFoundError as _missing:  # name the extras instead of a bare "No module named ..."
    raise ModuleNotFoundError(
        f"prefixrt.openai needs the {_missing.name!r} package: pip install 'prefixrt[openai,server]'",
        name=_missing.name,
    ) from _missing

from prefixrt.default_models import CHAT_MODEL
from prefixrt.server.inprocess import AsyncASGIStreamTransport, SyncASGIStreamTransport

BASE_URL = "http://prefixrt.local/v1"


def _engine_and_owner(engine, model: str | None, engine_kwargs: dict):
    if engine is not None:
        if model is not None or engine_kwargs:
            raise TypeError("give either engine= or model=/engine keyword arguments, not both")
        return engine, None
    from prefixrt.engine.engine import Engine

    eng = Engine(model or CHAT_MODEL, **engine_kwargs)
    return eng, eng.shutdown


def OpenAI(engine=None, model: str | None = None, *, api_key: str = "prefixrt", max_retries: int = 0,
           **engine_kwargs: Any) -> _openai.OpenAI:
    """A real `openai.OpenAI` whose requests run on `engine` (or on a new Engine(model, **engine_kwargs),
    shut down when the client is closed)."""
    eng, on_close = _engine_and_owner(engine, model, engine_kwargs)
    transport = SyncASGIStreamTransport(create_app(eng, any_model_name=True), on_close=on_close)
    http_client = httpx.Client(transport=transport, base_url=BASE_URL, timeout=None)
    client = _openai.OpenAI(api_key=api_key, base_url=BASE_URL, http_client=http_client, max_retries=max_retries)
    client.prefixrt_engine = eng
    return client


def AsyncOpenAI(engine=None, model: str | None = None, *, api_key: str = "prefixrt", max_retries: int = 0,
                **engine_kwargs: Any) -> _openai.AsyncOpenAI:
    """A real `openai.AsyncOpenAI` whose requests run on `engine` in the caller's event loop."""
    eng, on_close = _engine_and_owner(engine, model, engine_kwargs)
    transport = AsyncASGIStreamTransport(create_app(eng, any_model_name=True), on_close=on_close)
    http_client = httpx.AsyncClient(transport=transport, base_url=BASE_URL, timeout=None)
    client = _openai.AsyncOpenAI(api_key=api_key, base_url=BASE_URL, http_client=http_client,
                                 max_retries=max_retries)
    client.prefixrt_engine = eng
    return client


__all__ = ["OpenAI", "AsyncOpenAI"]
