"""`prefixrt generate`: one-shot generation on an in-process engine; prints the text, then the request's cache
use on stderr (with --repeat, earlier runs warm the radix cache and the last one reports its reuse)."""

from __future__ import annotations

import argparse
import sys

from prefixrt.config.flags import add_engine_args, start_engine
from prefixrt.default_models import BASE_MODEL, CHAT_MODEL


def add_generate_args(g: argparse.ArgumentParser) -> None:
    g.add_argument("prompt")
    add_engine_args(g, default_model=None)  # None: the chat model with --chat, else the base model
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    g.add_argument("--stream", action="store_true")
    g.add_argument("--repeat", type=int, default=1, help="send the prompt this many times (shows cache reuse)")


def run_generate(args: argparse.Namespace) -> int:
    from prefixrt.engine.engine import Engine
    from prefixrt.errors import InvalidRequest

    if args.model is None:
        args.model = CHAT_MODEL if args.chat else BASE_MODEL
    eng = start_engine(args, Engine)
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
