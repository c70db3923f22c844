"""The `prefixrt` command: serve, router, generate, chat, models, bench (`python -m prefixrt.cli ...` runs it too).

One module per command that is not a server: generate.py, chat.py, models.py here, bench in prefixrt/bench/cli.py;
`serve` and `router` take their flags from server/launch.py and routing/launch.py. The parser builds only the
flags of the command it is given, so `prefixrt generate`, `chat`, `models` and `bench` never import the server.
"""

from __future__ import annotations

import argparse
import sys

# name -> the one-line help of `prefixrt --help`
COMMANDS = {
    "serve": "OpenAI-compatible HTTP server",
    "generate": "one-shot generation; prints the text and cache stats",
    "chat": "interactive chat in the terminal (local engine or --url)",
    "router": "cache-aware HTTP router over `prefixrt serve` workers",
    "models": "list the built-in model registry",
    "bench": "benchmarks (see `prefixrt bench --help`)",
}


def _add_args(command: str, p: argparse.ArgumentParser) -> None:
    """The flags of one command, importing only that command's module."""
    if command == "serve":
        from prefixrt.server.launch import add_serve_args as add
    elif command == "generate":
        from prefixrt.cli.generate import add_generate_args as add
    elif command == "chat":
        from prefixrt.cli.chat import add_chat_args as add
    elif command == "router":
        from prefixrt.routing.launch import add_router_args as add
    elif command == "models":
        from prefixrt.cli.models import add_models_args as add
    else:  # bench parses its own arguments (prefixrt/bench/cli.py)
        return
    add(p)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The `prefixrt` parser: every command with its one-line help; the flags of `only` (None: of every command)."""
    parser = argparse.ArgumentParser(prog="prefixrt", description="prefix-sharing LLM runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, add_help=name != "bench")
        if only is None or only == name:
            _add_args(name, p)
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


def _check(args: argparse.Namespace) -> None:
    """The mistakes that can be named before a model loads (ValueError / OSError with one line)."""
    if args.command == "serve":
        from prefixrt.server.launch import check_role_args, check_serve_args

        check_serve_args(args)  # port free and in range, before the model loads
        check_role_args(args)
    if hasattr(args, "device"):
        from prefixrt.config.flags import check_engine_args

        check_engine_args(args)


def _run(args: argparse.Namespace) -> int:
    if args.command == "serve":
        from prefixrt.server.launch import serve as run
    elif args.command == "generate":
        from prefixrt.cli.generate import run_generate as run
    elif args.command == "chat":
        from prefixrt.cli.chat import run_chat as run
    elif args.command == "router":
        from prefixrt.routing.launch import run_router as run
    else:
        from prefixrt.cli.models import run_models as run
    return run(args)


def _bench(argv: list[str]) -> int:
    try:
        from prefixrt.bench.cli import main as bench_main
    except ImportError as e:
        print(f"prefixrt bench is not available in this installation ({e}).", file=sys.stderr)
        return 2
    return bench_main(argv) or 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":  # bench owns its own arguments
        return _bench(argv[1:])
    # Only the named command's flags: its module alone is imported (`prefixrt --help` lists the commands).
    args = build_parser(only=argv[0] if argv else "").parse_args(argv)
    from prefixrt.errors import InvalidRequest

    try:
        _check(args)
        return _run(args)
    except (InvalidRequest, ValueError, FileNotFoundError, ImportError, OSError) as e:
        if getattr(args, "debug", False):
            raise
        print(_one_line_error(args.command, e), file=sys.stderr)
        return 2
