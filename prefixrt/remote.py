"""RemoteEngine: the Provider interface over a `prefixrt serve` server's native endpoints.

Same semantics as Engine: SamplingParams are validated locally first (InvalidRequest before any network
call), a 400 from the server raises InvalidRequest with its `param`, results are Completion / Chunk /
EngineStats objects, and closing a stream early aborts the request (the server sees the disconnect).
`tokenizer` is None: tokenization happens on the server.

Difference from Engine: `astream` submits on the first iteration (an async iterator cannot do I/O when it is
created), so a bad request raises there rather than at the call.

`api_key` (default: the PREFIXRT_API_KEY environment variable) is sent as `Authorization: Bearer <key>`.
Errors: 400/413 raise InvalidRequest, 401/403 PermissionError, 503 (engine dead, server shutting down)
EngineDeadError, anything else RuntimeError; an error event in a stream raises the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

from prefixrt.errors import EngineDeadError, InvalidRequest
from prefixrt.lowering.json_schema import to_json_schema
from prefixrt.outputs import Chunk, EngineStats, completion_from_dict
from prefixrt.params import SamplingParams


def _params_dict(params: SamplingParams | dict | None) -> dict[str, Any]:
    """Validated SamplingParams as JSON: only the fields that differ from the defaults."""
    p = SamplingParams.coerce(params)
    default = SamplingParams()
    out = {}
    for f in dataclasses.fields(p):
        v = getattr(p, f.name)
        if v != getattr(default, f.name):
            out[f.name] = v
    if isinstance(out.get("json_schema"), type):  # a pydantic model class: JSON carries its schema
        out["json_schema"] = to_json_schema(out["json_schema"])
    return out


def _is_batch(prompt) -> bool:
    if not isinstance(prompt, (list, tuple)) or not prompt:
        return False
    first = prompt[0]
    return isinstance(first, str) or (isinstance(first, (list, tuple)) and not isinstance(first, dict))


def _raise_for(resp: httpx.Response) -> None:
    if resp.status_code < 400:
        return
    try:
        err = resp.json().get("error", {})
    except (ValueError, AttributeError):
        err = {}
    _raise_error(resp.status_code, err if isinstance(err, dict) else {}, resp.text)


_CODE_STATUS = {"engine_dead": 503, "server_shutting_down": 503, "engine_timeout": 503}


def _raise_error(status: int | None, err: dict, text: str = "") -> None:
    message = err.get("message") or text or f"HTTP {status}"
    if status in (400, 413):
        raise InvalidRequest(message, param=err.get("param"))
    if status in (401, 403):
        raise PermissionError(f"{message} (HTTP {status})")
    if status == 503:
        raise EngineDeadError(message)
    raise RuntimeError(f"server error {status}: {message}")


def _sse_data(line: str) -> dict | None:
    """The JSON of one `data:` line; raises for an error event."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return None
    d = json.loads(data)
    if isinstance(d, dict) and isinstance(d.get("error"), dict):
        err = d["error"]
        _raise_error(_CODE_STATUS.get(err.get("code"), 500), err)
    return d


class RemoteEngine:
    """Provider for a prefixrt server at base_url (e.g. "http://127.0.0.1:30000")."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float | None = 600.0):
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        api_key = api_key if api_key is not None else os.environ.get("PREFIXRT_API_KEY")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = timeout
        self._client = httpx.Client(base_url=self.base_url, headers=self._headers, timeout=timeout)
        self._aclients: dict[int, httpx.AsyncClient] = {}  # one per event loop (pools are loop-bound)
        self._model: dict | None = None

    # ------------------------------------------------------------------ properties
    def _model_card(self) -> dict:
        if self._model is None:
            resp = self._client.get("/v1/models")
            _raise_for(resp)
            self._model = resp.json()["data"][0]
        return self._model

    @property
    def model_name(self) -> str:
        return self._model_card()["id"]

    @property
    def vocab_size(self) -> int | None:
        """The served model's vocabulary size (token ids are in [0, vocab_size))."""
        return self._model_card().get("vocab_size")

    @property
    def model_revision(self) -> str | None:
        """The served weights' revision (from /v1/models), so caches keyed by model string tell weights apart."""
        return self._model_card().get("revision")

    @property
    def tokenizer(self):
        return None

    def _aclient(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._aclients.get(id(loop))
        if client is None:
            # No cap on connections: every concurrent stream needs its own (httpx's default is 100).
            client = httpx.AsyncClient(base_url=self.base_url, headers=self._headers, timeout=self._timeout,
                                       limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
            self._aclients = {id(loop): client}  # drop clients of loops that are gone
        return client

    # ------------------------------------------------------------------ generation
    def _body(self, prompt, params) -> dict:
        body: dict[str, Any] = {"sampling_params": _params_dict(params)}
        body["prompts" if _is_batch(prompt) else "prompt"] = list(prompt) if _is_batch(prompt) else prompt
        return body

    def generate(self, prompt, params: SamplingParams | dict | None = None):
        """One prompt -> Completion; a list of prompts -> list[Completion] (submitted together)."""
        resp = self._client.post("/generate", json=self._body(prompt, params))
        _raise_for(resp)
        data = resp.json()
        return [completion_from_dict(d) for d in data] if isinstance(data, list) else completion_from_dict(data)

    async def agenerate(self, prompt, params: SamplingParams | dict | None = None):
        resp = await self._aclient().post("/generate", json=self._body(prompt, params))
        _raise_for(resp)
        data = resp.json()
        return [completion_from_dict(d) for d in data] if isinstance(data, list) else completion_from_dict(data)

    def stream(self, prompt, params: SamplingParams | dict | None = None) -> Iterator[Chunk]:
        """Submit now (errors raise here), then iterate Chunks. Closing the iterator early aborts."""
        body = {**self._body(prompt, params), "stream": True}
        if "prompts" in body:
            raise InvalidRequest("stream takes a single prompt", param="prompt")
        resp = self._client.send(self._client.build_request("POST", "/generate", json=body), stream=True)
        if resp.status_code >= 400:
            resp.read()
            resp.close()
            _raise_for(resp)
        return self._iter_chunks(resp)

    @staticmethod
    def _iter_chunks(resp: httpx.Response) -> Iterator[Chunk]:
        try:
            for line in resp.iter_lines():
                d = _sse_data(line)
                if d is not None:
                    yield Chunk(**d)
        finally:
            resp.close()

    async def astream(self, prompt, params: SamplingParams | dict | None = None) -> AsyncIterator[Chunk]:
        body = {**self._body(prompt, params), "stream": True}
        if "prompts" in body:
            raise InvalidRequest("stream takes a single prompt", param="prompt")
        client = self._aclient()
        resp = await client.send(client.build_request("POST", "/generate", json=body), stream=True)
        try:
            if resp.status_code >= 400:
                await resp.aread()
                _raise_for(resp)
            async for line in resp.aiter_lines():
                d = _sse_data(line)
                if d is not None:
                    yield Chunk(**d)
        finally:
            await resp.aclose()

    # ------------------------------------------------------------------ cache and control
    def cache_prefix(self, prompt, cache_salt: str | None = None, lora: str | None = None) -> int:
        body = {"prompt": prompt, "cache_salt": cache_salt, **({"lora": lora} if lora is not None else {})}
        resp = self._client.post("/cache_prefix", json=body)
        _raise_for(resp)
        return int(resp.json()["cached_tokens"])

    def lora_adapters(self) -> list[str]:
        """The LoRA adapters the server serves (its /v1/models entries whose parent is another model), asked now."""
        resp = self._client.get("/v1/models")
        _raise_for(resp)
        return sorted(card["id"] for card in resp.json()["data"] if card.get("parent"))

    def abort(self, request_id: str) -> None:
        _raise_for(self._client.post("/abort", json={"request_id": request_id}))

    def stats(self) -> EngineStats:
        resp = self._client.get("/stats")
        _raise_for(resp)
        names = {f.name for f in dataclasses.fields(EngineStats)}
        return EngineStats(**{k: v for k, v in resp.json().items() if k in names})

    def flush_cache(self) -> None:
        _raise_for(self._client.post("/flush_cache"))

    def health(self) -> bool:
        try:
            return self._client.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    def close(self) -> None:
        self._client.close()
        self._aclients.clear()

    shutdown = close

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
