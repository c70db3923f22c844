"""`prefixrt serve`: build the engine (printing progress), serve it with uvicorn, shut down cleanly.

The engine runs in its own process (ProcessEngine) unless --engine-in-process keeps it on a thread of the
server process (sharing the GIL with the HTTP event loop).

uvicorn installs the SIGINT/SIGTERM handlers: on a signal it stops accepting connections, lets running
requests finish (up to --graceful-timeout seconds; streams still open after that are cut, which aborts
them), and returns; the engine is shut down after it.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Any

ENGINE_FLAGS = ("load_format", "device", "dtype", "attention_backend", "kv_cache_tokens", "mem_fraction",
                "page_size", "schedule_policy", "chunked_prefill_tokens", "max_running_requests", "seed", "debug")


CHAT_MODEL = "smollm2-135m-instruct"  # the embedded instruct model: the default wherever a chat is expected
BASE_MODEL = "gemma-3-270m"  # the embedded base model: the default for plain-text completion


def add_engine_args(p: argparse.ArgumentParser, default_model: str | None = CHAT_MODEL) -> None:
    """Engine construction flags (docs/api.md's Engine arguments), shared by `serve` and `generate`."""
    p.add_argument("--model", default=default_model,
                   help=f"registry name or local HF folder (default: {default_model or 'see the command'})")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    p.add_argument("--attention-backend", choices=["auto", "triton", "torch"], default="auto")
    p.add_argument("--kv-cache-tokens", type=int, default=None)
    p.add_argument("--mem-fraction", type=float, default=0.85)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--no-radix-cache", action="store_true", help="disable cross-request prefix reuse")
    p.add_argument("--schedule-policy", choices=["lpm", "dfs", "fcfs"], default="lpm")
    p.add_argument("--chunked-prefill-tokens", type=int, default=8192)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--debug", action="store_true", help="check KV accounting whenever the scheduler is idle (slow)")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw = {name: getattr(args, name) for name in ENGINE_FLAGS}
    kw["radix_cache"] = not args.no_radix_cache
    return kw


def build_engine(args: argparse.Namespace, own_process: bool = False):
    """An Engine, or with own_process a ProcessEngine (the engine in a child process), printing progress."""
    t0 = time.monotonic()

    def progress(msg: str) -> None:
        print(f"[prefixrt {time.monotonic() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    if own_process:
        from prefixrt.engine.process import ProcessEngine as make
    else:
        from prefixrt.engine.engine import Engine as make
    where = "in its own process" if own_process else "in this process"
    progress(f"starting engine for {args.model!r} ({where})")
    eng = make(args.model, progress=progress, **engine_kwargs(args))
    progress(f"engine ready: {eng.model_name} on {eng.device}, context {eng.max_context} tokens")
    return eng


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from prefixrt.server.app import create_app

    try:
        eng = build_engine(args, own_process=not args.engine_in_process)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"prefixrt serve: {e}", file=sys.stderr)
        return 2
    try:
        app = create_app(eng, served_model_name=args.served_model_name)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=args.graceful_timeout)
        server = uvicorn.Server(config)
        # uvicorn catches SIGINT/SIGTERM, drains, then re-raises the signal to the handler that was installed
        # before it: make that a no-op so the engine below is shut down and the exit status is 0.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        print(f"[prefixrt] serving {app.state.model_name} on http://{args.host}:{args.port} "
              f"(OpenAI base_url http://{args.host}:{args.port}/v1)", file=sys.stderr, flush=True)
        server.run()
    finally:
        print("[prefixrt] shutting down the engine", file=sys.stderr, flush=True)
        eng.shutdown()
    return 0


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--served-model-name", default=None, help="the model id reported by /v1/models")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--graceful-timeout", type=float, default=10.0,
                   help="seconds to let running requests finish on SIGINT/SIGTERM")
    p.add_argument("--engine-in-process", action="store_true",
                   help="run the engine on a thread of the server process instead of its own process")
