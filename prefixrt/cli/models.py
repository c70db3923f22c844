"""`prefixrt models`: the model registry (built-in models and config-only benchmark shapes), as a table or JSON."""

from __future__ import annotations

import argparse
import json


def add_models_args(m: argparse.ArgumentParser) -> None:
    m.add_argument("--json", action="store_true")


def run_models(args: argparse.Namespace) -> int:
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
