"""create_router_app: the `prefixrt router` HTTP front-end, one routing policy over `prefixrt serve` workers.

Each generation request (ROUTES) is keyed by its prompt's token ids (prompt.RoutingKeys), placed by the policy
(policy.py: choose, then routed; finished when the reply ends, however it ends) and proxied to the chosen
worker as it is: the worker's status, headers that matter (content-type, x-should-retry) and body bytes are
passed through unchanged and unbuffered (plus `x-prefixrt-worker`, the worker's URL), so SSE streams arrive event by event and worker errors reach the
client exactly as the worker wrote them. A client that disconnects closes the upstream stream, which the
worker sees as a disconnect (it aborts the request).

Workers: a background task probes `GET /health` of every worker every `health_interval_s`; a worker that
fails PROBE_FAILURES probes in a row (unhealthy or unreachable) gets no requests until it answers 200 again, and a worker's `/stats` kv_total, read when
it comes up, sizes its approximate tree. A request whose worker cannot be reached (connect error) is retried
once on the policy's next choice, the failed worker marked unhealthy; once bytes have been sent nothing is
retried. No healthy worker: 503.

Responses: `previous_response_id` and `GET`/`DELETE /v1/responses/{id}` go to the worker that stored that
response (each worker keeps its own store); the router learns the id from the reply (the JSON body or the
stream's response.created event) and keeps the last `max_tracked_responses`.

Sessions: requests with one `prompt_cache_key` (OpenAI's session key) go to the worker the key's first request
went to, while it is healthy (else the policy chooses again and the key follows); the last
`max_tracked_responses` keys are kept.

Other routes: `GET /v1/models[/{id}]` from any healthy worker; `GET /health` 200 while one worker is healthy
(with each worker's state), else 503; `GET /router/stats`: the policy's per-worker load, routed count and tree
size, and hit/miss counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections import Counter, OrderedDict
from collections.abc import Sequence

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from prefixrt.routing.policy import NoReplicaError, RoutingPolicy
from prefixrt.routing.prompt import ROUTES, RoutingKeys

PASS_HEADERS = ("content-type", "content-encoding", "x-should-retry", "cache-control", "x-request-id")
FORWARD_HEADERS = ("authorization", "content-type", "accept", "x-request-id", "openai-organization")
WORKER_HEADER = "x-prefixrt-worker"  # added to every proxied reply: the worker that answered
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]+)"')
_ID_SCAN_BYTES = 8192
PROBE_FAILURES = 2  # the response id comes first in the JSON body and in response.created


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "server_error", "param": None, "code": code}},
                        status_code=status)


class WorkerPool:
    """The workers' URLs, their health as last probed, and the response ids each one stored."""

    def __init__(self, urls: Sequence[str], policy: RoutingPolicy, client: httpx.AsyncClient,
                 max_tracked_responses: int = 65536):
        self.urls = [u.rstrip("/") for u in urls]
        if not self.urls:
            raise ValueError("the router needs at least one --worker URL")
        self.policy = policy
        self.client = client
        self.sized: set[str] = set()
        self.responses: OrderedDict[str, str] = OrderedDict()  # response id -> worker url
        self.sessions: OrderedDict[str, str] = OrderedDict()  # prompt_cache_key -> worker url
        self.max_tracked_responses = max_tracked_responses
        self.last_error: dict[str, str] = {}
        self.failures: dict[str, int] = {}  # consecutive failed probes
        for u in self.urls:
            policy.add_replica(u)
            policy.set_healthy(u, False)  # in rotation from its first good probe on

    def healthy(self) -> list[str]:
        return [u for u in self.urls if self.policy.healthy[u]]

    async def probe(self, url: str) -> bool:
        try:
            r = await self.client.get(url + "/health", timeout=5.0)
            ok = r.status_code == 200
            error = None if ok else f"/health answered {r.status_code}"
        except httpx.HTTPError as e:
            ok, error = False, f"{type(e).__name__}: {e}"
        if error is None:
            self.last_error.pop(url, None)
            self.failures[url] = 0
        else:
            self.last_error[url] = error
            self.failures[url] = self.failures.get(url, 0) + 1
        # One slow probe on a loaded host is not a dead worker: out of rotation after PROBE_FAILURES in a row
        # (a refused connection while sending a request takes it out at once).
        self.policy.set_healthy(url, ok or 0 < self.failures[url] < PROBE_FAILURES and self.policy.healthy[url])
        if ok and url not in self.sized and hasattr(self.policy, "set_capacity"):
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                r = await self.client.get(url + "/stats", timeout=5.0)
                if r.status_code == 200:
                    self.policy.set_capacity(url, int(r.json()["kv_total"]))
            self.sized.add(url)
        return ok

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(u) for u in self.urls))

    def remember_session(self, key: str, url: str) -> None:
        self.sessions[key] = url
        self.sessions.move_to_end(key)
        while len(self.sessions) > self.max_tracked_responses:
            self.sessions.popitem(last=False)

    def remember(self, response_id: str, url: str) -> None:
        self.responses[response_id] = url
        self.responses.move_to_end(response_id)
        while len(self.responses) > self.max_tracked_responses:
            self.responses.popitem(last=False)


def create_router_app(worker_urls: Sequence[str], policy: RoutingPolicy, keys: RoutingKeys, *,
                      health_interval_s: float = 2.0, client: httpx.AsyncClient | None = None) -> FastAPI:
    """The router's ASGI app. `client` (tests) replaces the pooled httpx client it otherwise creates."""
    http = client or httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                                       limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
    pool = WorkerPool(worker_urls, policy, http)
    decisions: Counter[str] = Counter()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await pool.probe_all()

        async def keep_probing():
            while True:
                await asyncio.sleep(health_interval_s)
                await pool.probe_all()

        task = asyncio.create_task(keep_probing())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if client is None:
                await http.aclose()

    app = FastAPI(title="prefixrt router", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.pool = pool
    app.state.decisions = decisions

    async def send(url: str, request: Request, path: str, body: bytes) -> httpx.Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARD_HEADERS}
        upstream = http.build_request(request.method, url + path, content=body, headers=headers,
                                      params=request.query_params)
        return await http.send(upstream, stream=True)

    def relay(up: httpx.Response, url: str, on_close, learn_id: bool) -> StreamingResponse:
        async def body():
            head, scan = b"", learn_id
            try:
                async for chunk in up.aiter_raw():
                    if scan and len(head) < _ID_SCAN_BYTES:
                        head += chunk
                        m = _RESPONSE_ID.search(head)
                        if m:
                            pool.remember(m.group(1).decode(), url)
                            scan = False
                    yield chunk
            finally:
                await up.aclose()
                on_close()

        headers = {k: v for k, v in up.headers.items() if k.lower() in PASS_HEADERS}
        headers[WORKER_HEADER] = url
        return StreamingResponse(body(), status_code=up.status_code, headers=headers)

    async def route_generation(request: Request, path: str) -> Response:
        body = await request.body()
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        pinned = None
        if path == "/v1/responses" and isinstance(parsed, dict) and parsed.get("previous_response_id"):
            pinned = pool.responses.get(str(parsed["previous_response_id"]))
        session = parsed.get("prompt_cache_key") if isinstance(parsed, dict) else None
        session = session if isinstance(session, str) and session else None
        ids = await asyncio.to_thread(keys.of, path, parsed) if pinned is None else []
        tried: list[str] = []
        for _attempt in range(2):
            candidates = [u for u in pool.healthy() if u not in tried]
            if pinned is not None:
                candidates = [pinned] if pinned in candidates else []
            elif session is not None and pool.sessions.get(session) in candidates:
                candidates = [pool.sessions[session]]  # the session's worker holds its K/V
            try:
                decision = policy.choose(ids, candidates)
            except NoReplicaError:
                if pinned is not None:
                    return _error(503, "the worker that stored previous_response_id is not available",
                                  "worker_unavailable")
                return _error(503, "no healthy worker", "no_healthy_worker")
            url = decision.replica
            if session is not None:
                pool.remember_session(session, url)
            policy.routed(url, ids)
            decisions[decision.reason] += 1
            try:
                up = await send(url, request, path, body)
            except httpx.TransportError as e:  # nothing reached the worker: try another one
                policy.finished(url)
                policy.set_healthy(url, False)
                pool.last_error[url] = f"{type(e).__name__}: {e}"
                tried.append(url)
                continue
            return relay(up, url, lambda u=url: policy.finished(u), learn_id=path == "/v1/responses")
        return _error(503, f"workers unreachable: {', '.join(tried)}", "worker_unreachable")

    def endpoint(path: str):
        async def generate(request: Request) -> Response:
            return await route_generation(request, path)

        return generate

    for route in ROUTES:
        app.add_api_route(route, endpoint(route), methods=["POST"])

    async def forward_any(request: Request, path: str, urls: list[str]) -> Response:
        for url in urls:
            try:
                up = await send(url, request, path, await request.body())
            except httpx.TransportError:
                continue
            return relay(up, url, lambda: None, learn_id=False)
        return _error(503, "no healthy worker", "no_healthy_worker")

    @app.get("/v1/models")
    async def models(request: Request):
        return await forward_any(request, "/v1/models", pool.healthy())

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        return await forward_any(request, f"/v1/models/{model_id}", pool.healthy())

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    async def stored_response(request: Request, response_id: str):
        owner = pool.responses.get(response_id)
        if owner is None:
            return _error(404, f"response {response_id!r} is not stored on any worker", "not_found")
        if request.method == "DELETE":
            pool.responses.pop(response_id, None)
        return await forward_any(request, f"/v1/responses/{response_id}", [owner])

    @app.get("/health")
    async def health():
        workers = {u: ("ok" if policy.healthy[u] else pool.last_error.get(u, "unhealthy")) for u in pool.urls}
        ok = any(policy.healthy[u] for u in pool.urls)
        return JSONResponse({"status": "ok" if ok else "no healthy worker", "workers": workers},
                            status_code=200 if ok else 503)

    @app.get("/router/stats")
    async def stats():
        return JSONResponse({**policy.stats(), "decisions": dict(decisions)})

    return app
