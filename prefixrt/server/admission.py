"""Admission: the ASGI middleware every request passes before a route sees it.

In order, for every HTTP request but `GET /health` (always open; it reports the lifecycle itself):
1. Access control. With an API key configured (`--api-key` or PREFIXRT_API_KEY), every route needs
   `Authorization: Bearer <key>` (or `x-api-key: <key>`, as Anthropic's clients send it): a missing or wrong key
   is a 401. Administrative routes (ADMIN_ROUTES: they
   act on or reveal every tenant's state) need the admin key (`--admin-api-key` or PREFIXRT_ADMIN_API_KEY):
   the user key gets 403, and with an API key but no admin key they are off (403). The admin key also works
   on every user route. With no key at all, everything is open (local use, as vLLM and SGLang default to).
2. Lifecycle: while draining or after the engine died, new requests get 503 (error object, retryable).
3. Body size: a body above `max_body_bytes` is a 413, decided from Content-Length before reading or while
   reading a chunked body; nothing of it reaches a route.
Requests let through are counted in `lifecycle.in_flight` until their response is complete.
Refusals on the Anthropic routes (/v1/messages...) have Anthropic's error shape (anthropic_format.py).
"""

from __future__ import annotations

import hmac

from prefixrt.server import anthropic_format
from prefixrt.server.errors import error_response
from prefixrt.server.lifecycle import Lifecycle

ADMIN_ROUTES = ("/flush_cache", "/cache_prefix", "/stats", "/metrics", "/dashboard", "/get_server_info", "/server_info",
                "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
OPEN_ROUTES = ("/health",)
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


def is_admin_route(path: str) -> bool:
    return any(path == r or path.startswith(r + "/") for r in ADMIN_ROUTES)


def _bearer(scope) -> str | None:
    """The request's key: `Authorization: Bearer <key>`, else `x-api-key: <key>`."""
    api_key = None
    for k, v in scope.get("headers", []):
        if k == b"authorization":
            scheme, _, token = v.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer":
                return token.strip()
        elif k == b"x-api-key":
            api_key = v.decode("latin-1").strip()
    return api_key


ANTHROPIC_ROUTES = ("/v1/messages",)


def _refusal(scope, status: int, message: str, kind: str, code: str | None = None, headers: dict | None = None,
             retry: bool = False):
    """The error response of a refused request, in the shape of its route's API."""
    path = scope["path"]
    if any(path == r or path.startswith(r + "/") for r in ANTHROPIC_ROUTES):
        return anthropic_format.error_response(status, message, headers=headers, retry=retry)
    return error_response(status, message, kind, code=code, headers=headers, retry=retry)


def _same(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and hmac.compare_digest(a.encode(), b.encode())


class Admission:
    def __init__(self, app, lifecycle: Lifecycle, api_key: str | None = None, admin_api_key: str | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.app = app
        self.lifecycle = lifecycle
        self.api_key = api_key or None
        self.admin_api_key = admin_api_key or None
        self.max_body_bytes = max_body_bytes

    def _denied(self, scope):
        """(status, message) when the request's key does not open its route, else None."""
        if self.api_key is None and self.admin_api_key is None:
            return None
        key = _bearer(scope)
        is_admin = _same(key, self.admin_api_key)
        is_user = is_admin or _same(key, self.api_key)
        if not is_admin_route(scope["path"]):
            if self.api_key is None or is_user:
                return None
            return 401, ("missing API key: send `Authorization: Bearer <key>`" if key is None
                         else "invalid API key")
        if is_admin:
            return None
        if not is_user:
            return 401, ("missing API key: send `Authorization: Bearer <admin key>`" if key is None
                         else "invalid API key")
        if self.admin_api_key is None:
            return 403, ("administrative routes are off: start the server with --admin-api-key "
                         "(or PREFIXRT_ADMIN_API_KEY) to enable them")
        return 403, "this route needs the admin API key"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_ROUTES:
            return await self.app(scope, receive, send)
        denied = self._denied(scope)
        if denied is not None:
            status, message = denied
            kind = "authentication_error" if status == 401 else "permission_error"
            headers = {"www-authenticate": "Bearer"} if status == 401 else None
            code = "invalid_api_key" if status == 401 else "forbidden"
            return await _refusal(scope, status, message, kind, code=code, headers=headers)(scope, receive, send)
        refusal = self.lifecycle.refusal
        if refusal is not None:
            code = "engine_dead" if self.lifecycle.engine_death is not None else "server_shutting_down"
            return await _refusal(scope, 503, refusal, "server_error", code=code, retry=True)(scope, receive, send)
        lc = self.lifecycle
        lc.in_flight += 1
        try:
            if scope["method"] in ("POST", "PUT", "PATCH"):
                body = await self._read_body(scope, receive)
                if body is None:
                    limit = self.max_body_bytes
                    size = f"{limit / 2**20:g} MiB" if limit >= 2**20 else f"{limit} bytes"
                    return await _refusal(
                        scope, 413, f"request body is larger than this server's limit of {size} (--max-request-bytes)",
                        "invalid_request_error", code="request_too_large")(scope, receive, send)
                receive = _replay(body, receive)
            await self.app(scope, receive, send)
        finally:
            lc.in_flight -= 1

    async def _read_body(self, scope, receive) -> bytes | None:
        """The whole request body, or None when it is larger than the limit."""
        for k, v in scope.get("headers", []):
            if k == b"content-length":
                try:
                    if int(v) > self.max_body_bytes:
                        return None
                except ValueError:
                    pass
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: let the route see that
                return b"".join(parts)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)


def _replay(body: bytes, receive):
    """A receive() that hands the app the body already read, then passes through (disconnects)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
