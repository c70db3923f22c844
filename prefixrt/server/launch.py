"""`prefixrt serve`: build the engine (printing progress), serve it with uvicorn, shut down cleanly.

The engine runs in its own process (ProcessEngine) unless --engine-in-process keeps it on a thread of the
server process (sharing the GIL with the HTTP event loop).

SIGTERM/SIGINT drains (lifecycle.py): new requests get 503 while the listening socket stays open, in-flight
requests get up to --drain-timeout seconds to finish, the rest are aborted with a clean error, then uvicorn
stops and the engine is shut down; exit status 0. A second signal stops at once. If the engine process dies,
in-flight requests get an error naming the cause and the server exits with status 1 within seconds (fail
fast, so a supervisor restarts it).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from prefixrt.config.flags import add_engine_args, add_flags, engine_kwargs, progress_printer, start_engine
from prefixrt.server.settings import DisaggSettings, ServerSettings


def check_serve_args(args: argparse.Namespace) -> None:
    """Fail in a second, not after loading the model: the port must be in range and free on the host."""
    import socket
    if getattr(args, "node_rank", 0) > 0:  # a tensor-parallel node other than 0 serves no HTTP
        return
    if args.host not in LOOPBACK_HOSTS and not args.api_key:
        print(f"[prefixrt] WARNING: serving on {args.host} (not a loopback address) without an API key: anyone "
              "who can reach it can use it. Set --api-key (or PREFIXRT_API_KEY) and --admin-api-key.",
              file=sys.stderr, flush=True)

    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be between 0 (any free port) and 65535, got {args.port}")
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((args.host, args.port))
        except OSError as e:
            raise OSError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}"
                          f"{' (the port is in use; pick another with --port)' if e.errno == 98 else ''}") from None
    import importlib.util

    for module in ("uvicorn", "fastapi"):
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"No module named {module!r}", name=module)


def start_engine_process(args: argparse.Namespace):
    """start_engine for a ProcessEngine that starts now and is waited for later: returns `ready()` (and
    `ready.cancel()`), see ProcessEngine.start. `prefixrt serve` imports its HTTP stack in between."""
    from prefixrt.engine.process.client import ProcessEngine

    progress = progress_printer()
    progress(f"starting engine for {args.model!r} (in its own process)")
    starting = ProcessEngine.start(args.model, progress=progress, **engine_kwargs(args))

    def ready():
        eng = starting()
        progress(f"engine ready: {eng.model_name} on {eng.device}, context {eng.max_context} tokens")
        return eng

    ready.cancel = starting.cancel
    return ready


def build_engine(args: argparse.Namespace):
    """An Engine in this process (--engine-in-process), printing progress. (The default, the engine in its own
    process, starts through start_engine_process.)"""
    from prefixrt.engine.engine import Engine

    return start_engine(args, Engine)


def build_role_engine(args: argparse.Namespace):
    """--role prefill|decode (disagg/roles.py): the engine in this process, joined to its peers through a
    torch.distributed rendezvous at --disagg-addr. Returns (engine, the PrefillWorker or None)."""
    from prefixrt.disagg.roles import start_role

    t0 = time.monotonic()

    def progress(msg: str) -> None:
        print(f"[prefixrt {time.monotonic() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    return start_role(args.role, args.model, engine_kwargs(args), addr=args.disagg_addr,
                      prefill_workers=args.disagg_prefill_workers, rank=args.disagg_rank,
                      backend=args.disagg_backend, timeout_s=args.disagg_timeout,
                      debug_delay_s=args.disagg_debug_delay_s, progress=progress)


def check_role_args(args: argparse.Namespace) -> None:
    role = getattr(args, "role", "standalone")
    if role == "standalone":
        return
    if not args.disagg_addr:
        raise ValueError(f"--role {role} needs --disagg-addr HOST:PORT (the decode server hosts the rendezvous)")
    if args.disagg_prefill_workers < 1:
        raise ValueError("--disagg-prefill-workers must be >= 1")
    if role == "prefill" and not 1 <= args.disagg_rank <= args.disagg_prefill_workers:
        raise ValueError(f"--role prefill needs --disagg-rank between 1 and --disagg-prefill-workers "
                         f"({args.disagg_prefill_workers}), got {args.disagg_rank}")
    if not args.radix_cache:
        raise ValueError(f"--role {role} needs the radix cache (K/V is sent from and received into it)")


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
UVICORN_GRACE_S = 5.0  # after a drain: how long uvicorn waits for connections to close


def _make_server(config, lifecycle):
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn, with SIGINT/SIGTERM starting a drain (Lifecycle.drain) instead of closing the socket."""

        async def startup(self, sockets=None) -> None:
            self._loop = asyncio.get_running_loop()
            lifecycle.bind_loop(self._loop)
            await super().startup(sockets=sockets)

        def handle_exit(self, sig, frame) -> None:
            loop = getattr(self, "_loop", None)
            if lifecycle.draining or self.should_exit or loop is None:  # a second signal: stop now
                self.force_exit = self.should_exit = True
                return
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(lifecycle.drain()))

    server = DrainingServer(config)

    def request_exit(code: int) -> None:
        server.should_exit = True

    lifecycle.request_exit = request_exit
    return server


def fast_io() -> tuple[str, str]:
    """uvicorn's event loop and HTTP parser: uvloop and httptools where installed (they come with
    uvicorn[standard]; optional), else asyncio and h11."""
    import importlib.util

    loop_impl = "uvloop" if sys.platform != "win32" and importlib.util.find_spec("uvloop") else "asyncio"
    return loop_impl, "httptools" if importlib.util.find_spec("httptools") else "h11"


def serve(args: argparse.Namespace) -> int:
    from prefixrt.hub.generation import generation_defaults

    if getattr(args, "node_rank", 0) > 0:  # a tensor-parallel node other than 0: its ranks only, no HTTP
        from prefixrt.config.engine_config import EngineConfig
        from prefixrt.parallel.tp_worker import run_node

        config = EngineConfig(model=args.model, **engine_kwargs(args))
        print(f"[prefixrt] node {config.node_rank}: running tensor-parallel ranks of {args.model!r}, rendezvous "
              f"at {config.dist_init_addr}", file=sys.stderr, flush=True)
        return run_node(config)
    defaults = generation_defaults(args.model, args.generation_config)  # a bad folder fails before the engine starts
    # The engine process starts first: the HTTP stack's imports (seconds) run while it builds.
    starting = start_engine_process(args) if args.role == "standalone" and not args.engine_in_process else None
    try:
        import uvicorn

        from prefixrt.server.app import create_app
        from prefixrt.server.body import OFFLOAD_BYTES, BodyParser
        from prefixrt.server.lifecycle import Lifecycle
    except BaseException:
        if starting is not None:
            starting.cancel()
        raise
    worker = None
    try:
        if starting is not None:
            eng = starting()
        elif args.role == "standalone":
            eng = build_engine(args)
        else:
            eng, worker = build_role_engine(args)
    except RuntimeError as e:  # the engine failed to start (e.g. its process died); other mistakes reach cli.main
        print(f"prefixrt serve: {e}", file=sys.stderr)
        return 2
    lifecycle = Lifecycle(drain_timeout=args.drain_timeout)
    if hasattr(eng, "progress"):
        eng.progress.stall_timeout_s = args.engine_stall_timeout
    if hasattr(eng, "heartbeat_timeout_s"):
        eng.heartbeat_timeout_s = min(eng.heartbeat_timeout_s, args.engine_stall_timeout)
    if hasattr(eng, "on_death"):
        eng.on_death = lifecycle.engine_died
    try:
        print(f"[prefixrt] sampling defaults for requests that leave them out: "
              f"{' '.join(f'{k}={v:g}' for k, v in defaults.items()) or 'the engine defaults (temperature 1.0)'} "
              f"(--generation-config {args.generation_config})", file=sys.stderr, flush=True)
        app = create_app(eng, served_model_name=args.served_model_name, any_model_name=args.any_model_name,
                         generation_defaults=defaults, api_key=args.api_key,
                         admin_api_key=args.admin_api_key, max_request_bytes=args.max_request_bytes,
                         lifecycle=lifecycle, reasoning_parser=args.reasoning_parser,
                         otlp_traces_endpoint=args.otlp_traces_endpoint)
        app.state.body_parser = BodyParser(OFFLOAD_BYTES)  # large JSON bodies decoded in a parser process
        loop_impl, http_impl = fast_io()
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=UVICORN_GRACE_S, loop=loop_impl, http=http_impl)
        server = _make_server(config, lifecycle)
        print(f"[prefixrt] serving {app.state.model_name} on http://{args.host}:{args.port} "
              f"(OpenAI base_url http://{args.host}:{args.port}/v1)"
              f"{'; API key required' if args.api_key else ''}; event loop {loop_impl}, HTTP parser {http_impl}",
              file=sys.stderr, flush=True)
        server.run()
    finally:
        print("[prefixrt] shutting down the engine", file=sys.stderr, flush=True)
        if worker is not None:
            worker.close()
        eng.shutdown()
    if lifecycle.engine_death is not None:
        print(f"[prefixrt] exiting with status 1: {lifecycle.engine_death}", file=sys.stderr, flush=True)
        return 1
    return lifecycle.exit_code


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """`prefixrt serve`'s flags: the engine's, the server's and disaggregation's, each generated from its settings'
    declarations (config/engine_config.py, server/settings.py)."""
    add_engine_args(p)
    add_flags(p, ServerSettings)
    add_flags(p.add_argument_group("prefill/decode disaggregation (docs/serving.md)"), DisaggSettings)
