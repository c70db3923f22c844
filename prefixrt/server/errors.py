"""OpenAI-shaped errors: the body every failed request gets, and how a request the engine ended without an
answer (finish_reason "abort") becomes one.

Body: `{"error": {"message", "type", "param", "code"}}`. Bad input is a 4xx; `x-should-retry: false` marks errors
a retry cannot fix (OpenAI clients honour it). A request the engine aborted is never reported as a success:
"abort" is not an OpenAI finish reason. What the client gets instead depends on why it was aborted
(`RequestFailed.for_abort`):

| cause | status | code |
|---|---|---|
| the engine process died | 503 | `engine_dead` |
| the server was shutting down and the drain timeout ran out | 503 | `server_shutting_down` |
| the engine stopped answering or making progress (`/health` is 503 too) | 503 | `engine_unresponsive` |
| an internal error in the engine (the request's `error`) | 500 | `internal_error` |
| aborted through `POST /abort` | 500 | `request_aborted` |

A `model` the server does not serve is a 404 `model_not_found` naming the served names (`check_model`).

Streams report the same error as an SSE event `data: {"error": {...}}`, then `data: [DONE]`.
"""

from __future__ import annotations

from prefixrt.errors import ENGINE_UNRESPONSIVE
from prefixrt.server.sse import JSON, sse


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                   retry: bool = False, headers: dict | None = None) -> JSON:
    h = dict(headers or {})
    if not retry:
        h["x-should-retry"] = "false"
    return JSON(error_body(message, type_, param, code), status_code=status, headers=h)


class RequestFailed(Exception):
    """A request that cannot be answered; rendered as an OpenAI error (non-streaming) or an error event."""

    def __init__(self, status: int, message: str, type_: str = "server_error", code: str | None = None,
                 param: str | None = None, retry: bool = False):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param, self.retry = (
            status, message, type_, code, param, retry)

    def response(self) -> JSON:
        return error_response(self.status, self.message, self.type, self.param, self.code, retry=self.retry)

    def event(self) -> str:
        return sse(error_body(self.message, self.type, self.param, self.code))

    @classmethod
    def for_abort(cls, lifecycle, error: str | None) -> RequestFailed:
        """The error for a request the engine finished with finish_reason "abort" (see the module table)."""
        if lifecycle is not None and lifecycle.engine_death is not None:
            return cls(503, f"{lifecycle.engine_death}; the server is exiting", code="engine_dead", retry=True)
        if lifecycle is not None and lifecycle.drain_expired:
            return cls(503, "the server is shutting down: the request did not finish within the "
                            f"{lifecycle.drain_timeout:g} s drain timeout", code="server_shutting_down", retry=True)
        if error and error.startswith(ENGINE_UNRESPONSIVE):
            return cls(503, f"the request was failed: {error}", code="engine_unresponsive", retry=True)
        if error:
            return cls(500, f"the request failed in the engine: {error}", code="internal_error", retry=True)
        return cls(500, "the request was aborted (POST /abort)", code="request_aborted")


def check_model(state, model: str | None) -> str | None:
    """The LoRA adapter `model` names (one of `state.lora_names`: server/lora_routes.py), None for the base model;
    404 model_not_found unless it is one of those, one of the app's served names (`state.model_names`), the local
    folder the model was loaded from (`state.model_path`: what /get_model_info reports as `model_path`, which
    SGLang's clients send back as `model`), omitted, or the app serves any name (`state.any_model_name`:
    `--any-model-name`, the in-process shim)."""
    if model is not None and model in getattr(state, "lora_names", ()):
        return model
    if model is None or state.any_model_name or model in (*state.model_names, getattr(state, "model_path", None)):
        return None
    raise model_not_found(state, model)


def model_not_found(state, model: str) -> RequestFailed:
    names = ", ".join(repr(n) for n in [*state.model_names, *sorted(getattr(state, "lora_names", ()))])
    return RequestFailed(404, f"The model {model!r} does not exist on this server; it serves {names} "
                              "(prefixrt serve --served-model-name sets the names, --any-model-name serves any)",
                         type_="invalid_request_error", code="model_not_found", param="model")
