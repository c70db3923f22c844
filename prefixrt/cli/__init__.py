"""The `prefixrt` command: serve, router, generate, chat, models, bench."""

from __future__ import annotations

import argparse
import json
import sys


def _generate(args: argparse.Namespace) -> int:
    from prefixrt.default_models import BASE_MODEL, CHAT_MODEL
    from prefixrt.errors import InvalidRequest
    from prefixrt.server.launch import build_engine

    if args.model is None:
        args.model = CHAT_MODEL if args.chat else BASE_MODEL
    eng = build_engine(args)
    try:
        params = {"max_new_tokens": args.max_tokens, "temperature": args.temperature}
        prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
        for _ in range(args.repeat - 1):  # earlier runs warm the radix cache; the last one reports its reuse
            c = eng.generate(prompt, params)
            print(f"[run: prompt_tokens={c.prompt_tokens} cached_tokens={c.cached_tokens}]", file=sys.stderr)
        try:
            if args.stream:
                last = None
                for ch in eng.stream(prompt, params):
                    print(ch.text, end="", flush=True)
                    last = ch
                print()
                usage = (last.prompt_tokens, last.cached_tokens, last.completion_tokens, last.finish_reason)
            else:
                c = eng.generate(prompt, params)
                print(c.text)
                usage = (c.prompt_tokens, c.cached_tokens, c.completion_tokens, c.finish_reason)
        except InvalidRequest as e:
            print(f"prefixrt generate: {e}", file=sys.stderr)
            return 2
        s = eng.stats()
        print(f"[prompt_tokens={usage[0]} cached_tokens={usage[1]} completion_tokens={usage[2]} "
              f"finish_reason={usage[3]} | kv {s.kv_total - s.kv_free}/{s.kv_total} used, "
              f"cache_hit_rate={s.cache_hit_rate:.2f}]", file=sys.stderr)
    finally:
        eng.shutdown()
    return 0


def _models(args: argparse.Namespace) -> int:
    from prefixrt.hub.registry import list_models

    rows = list_models()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        state = ("cached" if r.get("cached") else "available") if r["available"] \
            else f"unavailable: {r['unavailable_reason']}"
        print(f"{r['name']:<24} {r['kind']:<9} {str(r.get('params') or ''):<8} {state:<12} {r.get('description', '')}")
    return 0


def _bench(argv: list[str]) -> int:
    try:
        from prefixrt.bench.cli import main as bench_main
    except ImportError as e:
        print(f"prefixrt bench is not available in this installation ({e}).", file=sys.stderr)
        return 2
    return bench_main(argv) or 0


def build_parser() -> argparse.ArgumentParser:
    from prefixrt.server.launch import add_engine_args, add_serve_args

    parser = argparse.ArgumentParser(prog="prefixrt", description="prefix-sharing LLM runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_args(sub.add_parser("serve", help="OpenAI-compatible HTTP server"))
    g = sub.add_parser("generate", help="one-shot generation; prints the text and cache stats")
    g.add_argument("prompt")
    add_engine_args(g, default_model=None)  # None: the chat model with --chat, else the base model
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    g.add_argument("--stream", action="store_true")
    g.add_argument("--repeat", type=int, default=1, help="send the prompt this many times (shows cache reuse)")
    c = sub.add_parser("chat", help="interactive chat in the terminal (local engine or --url)")
    from prefixrt.chat_cli import add_chat_args

    add_chat_args(c)
    from prefixrt.routing.launch import add_router_args

    add_router_args(sub.add_parser("router", help="cache-aware HTTP router over `prefixrt serve` workers"))
    m = sub.add_parser("models", help="list the built-in model registry")
    m.add_argument("--json", action="store_true")
    sub.add_parser("bench", help="benchmarks (see `prefixrt bench --help`)", add_help=False)
    return parser


# Extras a command needs, and the pip line that installs each (named in the one-line error).
_EXTRAS = {"uvicorn": "server", "fastapi": "server", "prometheus_client": "server", "httpx": "server",
           "openai": "openai", "gguf": "gemma", "llguidance": "grammar", "xgrammar": "grammar"}


def _one_line_error(command: str, e: BaseException) -> str:
    """A user's mistake (or a missing extra) as one line: what is wrong and what to do."""
    if isinstance(e, ImportError) and not isinstance(e, ModuleNotFoundError) or (
            isinstance(e, ModuleNotFoundError) and e.name not in _EXTRAS):
        return f"prefixrt {command}: {e}"
    if isinstance(e, ModuleNotFoundError):
        return (f"prefixrt {command}: the Python package {e.name!r} is missing; install it with: "
                f"pip install 'prefixrt[{_EXTRAS[e.name]}]'")
    msg = str(e).replace("load_format='dummy'", "--load-format dummy")
    return f"prefixrt {command}: {msg}"


def _run(args: argparse.Namespace) -> int:
    if args.command == "serve":
        from prefixrt.server.launch import serve

        return serve(args)
    if args.command == "generate":
        return _generate(args)
    if args.command == "chat":
        from prefixrt.chat_cli import run_chat

        return run_chat(args)
    if args.command == "router":
        from prefixrt.routing.launch import run_router

        return run_router(args)
    return _models(args)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":  # bench owns its own arguments
        return _bench(argv[1:])
    args = build_parser().parse_args(argv)
    from prefixrt.errors import InvalidRequest

    try:
        if args.command == "serve":
            from prefixrt.server.launch import check_serve_args

            check_serve_args(args)  # port free and in range, before the model loads
            from prefixrt.server.launch import check_role_args

            check_role_args(args)
        from prefixrt.server.launch import check_engine_args

        if hasattr(args, "device"):
            check_engine_args(args)
        return _run(args)
    except (InvalidRequest, ValueError, FileNotFoundError, ImportError, OSError) as e:
        if getattr(args, "debug", False):
            raise
        print(_one_line_error(args.command, e), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
