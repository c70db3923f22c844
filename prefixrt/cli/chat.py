"""`prefixrt chat`: an interactive chat in the terminal, in-process or against a running `prefixrt serve`.

Each turn sends the whole conversation (as chat messages) to a Provider and streams the reply; after it, one
status line shows how many prompt tokens the radix cache supplied — from the second turn on, the earlier
turns come from the cache, which is the point of prefixrt made visible. Commands: /reset (new conversation),
/stats (engine counters), /exit (or Ctrl-D).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from prefixrt.config.flags import add_engine_args, start_engine

PROMPT = ">>> "
HELP = "commands: /reset (new conversation), /stats, /exit (or Ctrl-D)"


def add_chat_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--url", default=None, help="chat with a running `prefixrt serve` instead of a local engine")
    p.add_argument("--api-key", default=None, help="the server's API key (with --url)")
    p.add_argument("--system", default=None, help="a system message that starts the conversation")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)


def _provider(args: argparse.Namespace):
    if args.url:
        from prefixrt.remote import RemoteEngine

        return RemoteEngine(args.url, api_key=args.api_key)
    from prefixrt.engine.engine import Engine

    return start_engine(args, Engine)


def chat_loop(provider, params: dict[str, Any], system: str | None, stdin: TextIO, stdout: TextIO) -> int:
    """Read user turns from stdin until EOF or /exit; stream each reply to stdout. Returns an exit code."""
    from prefixrt.errors import InvalidRequest

    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    print(f"prefixrt chat with {provider.model_name} — {HELP}", file=stdout, flush=True)
    while True:
        print(PROMPT, end="", file=stdout, flush=True)
        line = stdin.readline()
        if not line:  # EOF
            print(file=stdout)
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit", "/bye"):
            return 0
        if text == "/reset":
            messages = list(start)
            print("[new conversation]", file=stdout, flush=True)
            continue
        if text == "/stats":
            s = provider.stats()
            print(f"[cache_hit_rate={s.cache_hit_rate:.2f} prompt_tokens_total={s.prompt_tokens_total} "
                  f"cached_tokens_total={s.cached_tokens_total} kv {s.kv_total - s.kv_free}/{s.kv_total} used]",
                  file=stdout, flush=True)
            continue
        if text.startswith("/"):
            print(f"[unknown command {text.split()[0]}; {HELP}]", file=stdout, flush=True)
            continue
        messages.append({"role": "user", "content": text})
        reply, last = [], None
        try:
            for chunk in provider.stream(messages, params):
                print(chunk.text, end="", file=stdout, flush=True)
                reply.append(chunk.text)
                last = chunk
        except InvalidRequest as e:
            messages.pop()
            print(f"\n[error: {e}]", file=stdout, flush=True)
            continue
        except KeyboardInterrupt:  # stop this reply, keep the conversation
            print("\n[interrupted]", file=stdout, flush=True)
        messages.append({"role": "assistant", "content": "".join(reply)})
        if last is not None and last.error:
            print(f"\n[error: {last.error}]", file=stdout, flush=True)
        elif last is not None:
            print(f"\n[{last.prompt_tokens} prompt tokens, {last.cached_tokens} cached, "
                  f"{last.completion_tokens} generated; finish_reason={last.finish_reason}]", file=stdout, flush=True)


def run_chat(args: argparse.Namespace) -> int:
    provider = _provider(args)
    try:
        params = {"max_new_tokens": args.max_tokens, "temperature": args.temperature}
        try:
            return chat_loop(provider, params, args.system, sys.stdin, sys.stdout)
        except KeyboardInterrupt:
            print(file=sys.stdout)
            return 0
    finally:
        close = getattr(provider, "shutdown", None) or getattr(provider, "close", None)
        if close is not None:
            close()
