"""Writes components.json: the component schemas the server's responses are checked against, with every
schema they reference, cut from OpenAI's published OpenAPI document (github.com/openai/openai-openapi,
openapi.json). Run: python tests/server/openai_spec/extract.py PATH/TO/openapi.json COMMIT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOTS = [
    "CreateChatCompletionResponse", "CreateChatCompletionStreamResponse", "CreateCompletionResponse", "Model",
    "ListModelsResponse", "ErrorResponse", "Response", "ResponseStreamEvent",
]


def refs(node, out: set[str]) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
            out.add(ref.rsplit("/", 1)[1])
        for v in node.values():
            refs(v, out)
    elif isinstance(node, list):
        for v in node:
            refs(v, out)


def main(path: str, commit: str) -> None:
    spec = json.loads(Path(path).read_text())
    schemas = spec["components"]["schemas"]
    keep, todo = set(), list(ROOTS)
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep.add(name)
        found: set[str] = set()
        refs(schemas[name], found)
        todo.extend(found - keep)
    out = {
        "source": "https://github.com/openai/openai-openapi (openapi.json)",
        "commit": commit,
        "openapi": spec["openapi"],
        "info_version": spec["info"]["version"],
        "roots": ROOTS,
        "components": {"schemas": {k: schemas[k] for k in sorted(keep)}},
    }
    Path(__file__).with_name("components.json").write_text(json.dumps(out, indent=1, sort_keys=False) + "\n")
    print(f"{len(keep)} schemas")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
