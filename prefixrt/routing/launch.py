"""`prefixrt router --worker URL ... --model NAME_OR_PATH`: the cache-aware router as a command.

Loads only the model's tokenizer (routing keys are token ids: see prompt.py), builds the policy from the flags
and serves create_router_app with uvicorn. Workers are `prefixrt serve` servers of the same model; auth is
theirs (the router forwards the Authorization header).
"""

from __future__ import annotations

import argparse
import socket
import sys


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worker", action="append", required=True, metavar="URL",
                   help="a `prefixrt serve` base URL (repeat for each replica), e.g. http://127.0.0.1:30001")
    p.add_argument("--model", required=True,
                   help="the workers' model (registry name or local HF folder): its tokenizer makes the routing keys")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the names the workers serve the base model under (requests naming another model, or a "
                        "LoRA adapter, are keyed apart from the base model's)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--policy", choices=["cache_aware", "round_robin"], default="cache_aware")
    p.add_argument("--block-size", type=int, default=16, help="tokens per node of the approximate trees")
    p.add_argument("--cache-threshold", type=float, default=0.5,
                   help="route to the longest match when it covers at least this fraction of the prompt")
    p.add_argument("--balance-abs-threshold", type=int, default=16,
                   help="a worker is overloaded when its in-flight count exceeds the least-loaded one's by more "
                        "than this ...")
    p.add_argument("--balance-rel-threshold", type=float, default=1.5, help="... and by more than this factor")
    p.add_argument("--max-tree-tokens", type=int, default=1 << 20,
                   help="tokens per approximate tree before LRU pruning (a worker's /stats kv_total replaces it)")
    p.add_argument("--health-interval", type=float, default=2.0, help="seconds between worker health probes")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def check_router_args(args: argparse.Namespace) -> None:
    """Mistakes that can be named before the tokenizer loads; raises ValueError / OSError with one line."""
    for url in args.worker:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--worker {url!r}: give a base URL such as http://127.0.0.1:30001")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be between 0 and 65535, got {args.port}")
    with socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((args.host, args.port))
        except OSError as e:
            raise OSError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None


def build_policy(args: argparse.Namespace):
    from prefixrt.routing.policy import make_policy

    return make_policy(args.policy, block_size=args.block_size, cache_threshold=args.cache_threshold,
                       balance_abs_threshold=args.balance_abs_threshold,
                       balance_rel_threshold=args.balance_rel_threshold, max_tree_tokens=args.max_tree_tokens)


def run_router(args: argparse.Namespace) -> int:
    import uvicorn

    from prefixrt.hub.registry import load_tokenizer, resolve_model
    from prefixrt.routing.prompt import RoutingKeys
    from prefixrt.routing.proxy import create_router_app

    check_router_args(args)
    resolved = resolve_model(args.model)
    tokenizer = load_tokenizer(resolved)
    base_names = (args.model, resolved.name, *(args.served_model_name or ()))  # other `model`s: LoRA adapters
    app = create_router_app(args.worker, build_policy(args), RoutingKeys(tokenizer, base_models=base_names),
                            health_interval_s=args.health_interval)
    print(f"[prefixrt] routing ({args.policy}) over {len(args.worker)} workers on http://{args.host}:{args.port} "
          f"(OpenAI base_url http://{args.host}:{args.port}/v1)", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0
