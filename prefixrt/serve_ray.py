"""prefixrt.serve_ray: prefixrt engines as Ray Serve replicas, routed by the cache-aware policy.

Two deployments:
- `EngineReplica` (num_replicas N): one prefixrt Engine and its `prefixrt serve` app (server/app.py), called
  in-process (no socket); `handle(method, path, body, headers, routing_ids=..., pin=...)` streams back a head
  `{"status", "headers", "replica"}` and then the reply's bytes, so SSE passes through event by event.
- `OpenAIIngress`: Serve's HTTP entry. It keys each generation request by its prompt's token ids (the same
  routing/prompt.RoutingKeys as `prefixrt router`: chat template applied, then tokenized) and calls the replica
  handle with them as the `routing_ids` keyword.

The policy is Serve's custom request router of EngineReplica (`PrefixCacheRouter`, a
`ray.serve.request_router.RequestRouter`): choose_replicas reads `routing_ids` and puts the policy's choice in
the first rank (the other candidates after it, in case it is full). It commits the choice at once (Serve calls
its on_request_routed only under the strict max-ongoing-requests protocol) and undoes it if Serve asks again
for the same request; on_request_completed ends it. A Responses follow-up (previous_response_id) carries the
replica that stored that response as `pin` and goes there. The router lives in each handle, i.e. in every
ingress replica: with several ingress replicas each keeps its own approximate trees (as the HTTP router's
trees are approximate anyway).

Run: `python -m prefixrt.serve_ray --model NAME_OR_PATH --replicas 4 --port 8000` (a local Ray, or
`--address` of a running cluster), or `serve run prefixrt.serve_ray:app_builder model=... replicas=4`.
Ray is an optional extra: `pip install 'prefixrt[ray]'`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import OrderedDict
from typing import Any

try:
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
except ImportError as e:  # the optional extra
    raise ImportError(f"prefixrt.serve_ray needs Ray Serve ({e}); install it with: pip install 'prefixrt[ray]'") from e

from prefixrt.routing.policy import CacheAwarePolicy
from prefixrt.routing.prompt import ROUTES, RoutingKeys

FORWARD_HEADERS = ("authorization", "content-type", "accept")
PASS_HEADERS = ("content-type", "content-encoding", "x-should-retry", "cache-control")
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]+)"')


class PrefixCacheRouter(RequestRouter):
    """Ray Serve request router over CacheAwarePolicy (policy keyword arguments via request_router_kwargs)."""

    def initialize_state(self, **policy_kwargs: Any) -> None:
        self.policy = CacheAwarePolicy(**policy_kwargs)
        self._committed: dict[str, ReplicaID] = {}  # internal request id -> the replica it was routed to

    def _sync_replicas(self, candidates: list[RunningReplica]) -> None:
        live = set(self.curr_replicas)
        for r in list(self.policy.replicas):
            if r not in live:
                self.policy.remove_replica(r)
        for r in candidates:
            self.policy.add_replica(r.replica_id)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            return [candidate_replicas]
        self._sync_replicas(candidate_replicas)
        by_id = {r.replica_id: r for r in candidate_replicas}
        rid = pending_request.metadata.internal_request_id
        earlier = self._committed.pop(rid, None)
        if earlier is not None:  # Serve asks again (the chosen replica was full): undo the first choice
            self.policy.finished(earlier)
        ids = list(pending_request.kwargs.get("routing_ids") or [])
        pin = pending_request.kwargs.get("pin")
        pinned = [r for r in by_id if pin is not None and r.unique_id == pin]
        decision = self.policy.choose(ids, candidates=pinned or list(by_id))
        self.policy.routed(decision.replica, ids)
        self._committed[rid] = decision.replica
        first = by_id[decision.replica]
        return [[first], [r for r in candidate_replicas if r is not first]]

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        replica = self._committed.pop(internal_request_id, None)
        if replica is not None:
            self.policy.finished(replica)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.remove_replica(replica_id)


@serve.deployment(ray_actor_options={"num_cpus": 0})
class EngineReplica:
    """One prefixrt Engine behind its own OpenAI app, called in-process."""

    def __init__(self, model: str, engine_kwargs: dict | None = None, served_model_name: str | None = None):
        import httpx

        from prefixrt.engine.engine import Engine
        from prefixrt.server.app import create_app
        from prefixrt.server.inprocess import AsyncASGIStreamTransport

        self.engine = Engine(model, **(engine_kwargs or {}))
        self.app = create_app(self.engine, served_model_name=served_model_name)
        self.client = httpx.AsyncClient(transport=AsyncASGIStreamTransport(self.app), base_url="http://replica",
                                        timeout=None)
        self.replica = serve.get_replica_context().replica_id.unique_id

    async def handle(self, method: str, path: str, body: bytes, headers: dict, routing_ids=None, pin=None):
        """Stream `{"status", "headers", "replica"}`, then the reply body's chunks (bytes)."""
        request = self.client.build_request(method, path, content=body, headers=headers)
        reply = await self.client.send(request, stream=True)
        try:
            yield {"status": reply.status_code, "replica": self.replica,
                   "headers": {k: v for k, v in reply.headers.items() if k.lower() in PASS_HEADERS}}
            async for chunk in reply.aiter_raw():
                yield chunk
        finally:
            await reply.aclose()

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


@serve.deployment(ray_actor_options={"num_cpus": 0})
class OpenAIIngress:
    """The HTTP entry: routing keys from request bodies, then the replica handle (routed by PrefixCacheRouter)."""

    def __init__(self, replicas, model: str, max_tracked_responses: int = 65536):
        from prefixrt.hub.registry import load_tokenizer, resolve_model

        self.replicas = replicas
        resolved = resolve_model(model)
        self.keys = RoutingKeys(load_tokenizer(resolved), base_models=(model, resolved.name))
        self.responses: OrderedDict[str, str] = OrderedDict()  # response id -> replica unique id
        self.max_tracked_responses = max_tracked_responses

    def _remember(self, response_id: str, replica: str) -> None:
        self.responses[response_id] = replica
        self.responses.move_to_end(response_id)
        while len(self.responses) > self.max_tracked_responses:
            self.responses.popitem(last=False)

    async def __call__(self, request):
        import asyncio

        from starlette.responses import JSONResponse, StreamingResponse

        path, body = request.url.path, await request.body()
        ids, pin = [], None
        if request.method == "POST" and path in ROUTES:
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None
            if path == "/v1/responses" and isinstance(parsed, dict) and parsed.get("previous_response_id"):
                pin = self.responses.get(str(parsed["previous_response_id"]))
            ids = [] if pin else await asyncio.to_thread(self.keys.of, path, parsed)
        elif path.startswith("/v1/responses/"):
            pin = self.responses.get(path.rsplit("/", 1)[1])
            if pin is None:
                return JSONResponse({"error": {"message": "no replica stored this response", "type":
                                               "invalid_request_error", "param": None, "code": "not_found"}},
                                    status_code=404)
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARD_HEADERS}
        gen = self.replicas.options(stream=True).handle.remote(request.method, path, body, headers,
                                                               routing_ids=ids, pin=pin)
        head = await gen.__anext__()

        async def rest():
            seen, scan = b"", path == "/v1/responses"
            async for chunk in gen:
                if scan and len(seen) < 8192:
                    seen += chunk
                    m = _RESPONSE_ID.search(seen)
                    if m:
                        self._remember(m.group(1).decode(), head["replica"])
                        scan = False
                yield chunk

        return StreamingResponse(rest(), status_code=head["status"],
                                 headers={**head["headers"], "x-prefixrt-replica": head["replica"]})


def build_app(model: str, replicas: int = 2, engine_kwargs: dict | None = None,
              served_model_name: str | None = None, policy_kwargs: dict | None = None):
    """The bound Serve application: OpenAIIngress over `replicas` EngineReplicas routed by PrefixCacheRouter."""
    router = RequestRouterConfig(request_router_class=PrefixCacheRouter,
                                 request_router_kwargs=dict(policy_kwargs or {}))
    engines = EngineReplica.options(num_replicas=replicas, request_router_config=router,
                                    max_ongoing_requests=1024)
    return OpenAIIngress.options(max_ongoing_requests=4096).bind(
        engines.bind(model, engine_kwargs, served_model_name), model)


def app_builder(args: dict):
    """For `serve run prefixrt.serve_ray:app_builder model=NAME replicas=N [device=cpu kv_cache_tokens=...]`."""
    args = dict(args)
    model = args.pop("model")
    replicas = int(args.pop("replicas", 2))
    engine_kwargs = {k: (int(v) if str(v).isdigit() else v) for k, v in args.items()}
    return build_app(model, replicas, engine_kwargs)


def main(argv: list[str] | None = None) -> int:
    import time

    import ray

    p = argparse.ArgumentParser(prog="python -m prefixrt.serve_ray", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--address", default="local", help="a Ray cluster's address (default: start a local Ray)")
    p.add_argument("--device", default="auto")
    p.add_argument("--kv-cache-tokens", type=int, default=None)
    p.add_argument("--served-model-name", default=None)
    args = p.parse_args(argv)
    ray.init(address=args.address, include_dashboard=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    engine_kwargs = {"device": args.device, "kv_cache_tokens": args.kv_cache_tokens}
    serve.run(build_app(args.model, args.replicas, engine_kwargs, args.served_model_name), name="prefixrt",
              route_prefix="/")
    print(f"[prefixrt] Ray Serve: {args.replicas} replicas of {args.model} on http://{args.host}:{args.port}/v1",
          file=sys.stderr, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
