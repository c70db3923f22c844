"""Make litellm (and DSPy's `dspy.LM("openai/<name>", api_base=...)`) send response schemas to `prefixrt serve`.

litellm forwards `response_format` with a JSON schema only for models its model map says support it, and DSPy
asks the same question (litellm's map on its litellm route, its own copy of that map on its native route) before
its JSONAdapter sends a schema: for a name neither knows, DSPy falls back to `json_object` or to no format at
all, and typed fields fail. `register` states, for each served name, that it is an OpenAI-compatible chat model
with response schemas: in litellm's model map (`litellm.register_model`) and, when DSPy is installed, in the
model map DSPy reads for `openai/<name>`. One line:

    prefixrt.adapters.litellm.register(base_url="http://127.0.0.1:30000")   # the server's names
    prefixrt.adapters.litellm.register("smollm2-135m-instruct")              # or the names themselves

Neither litellm nor DSPy is imported until `register` is called; each is skipped when not installed.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["register"]


def _served_names(base_url: str, api_key: str | None) -> list[str]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/")
    url = url if url.endswith("/v1") else url + "/v1"
    resp = httpx.get(url + "/models", headers=headers, timeout=30)
    resp.raise_for_status()
    return [m["id"] for m in resp.json()["data"]]


def _entry(context_length: int | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"litellm_provider": "openai", "mode": "chat", "supports_response_schema": True,
                             "supports_system_messages": True, "input_cost_per_token": 0.0,
                             "output_cost_per_token": 0.0}
    if context_length:
        entry.update(max_tokens=context_length, max_input_tokens=context_length, max_output_tokens=context_length)
    return entry


def register(*names: str, base_url: str | None = None, api_key: str | None = None,
             context_length: int | None = None) -> list[str]:
    """Register served model names with litellm's model map (and DSPy's, when installed) as OpenAI-compatible
    chat models that take response schemas. `names`: the names as clients write them after `openai/`; with
    `base_url` (a `prefixrt serve` address) the server's `/v1/models` names are added. Returns the names."""
    all_names = list(dict.fromkeys([*names, *(_served_names(base_url, api_key) if base_url else [])]))
    if not all_names:
        raise ValueError("register: give model names or base_url")
    entries = {}
    for name in all_names:
        entries[name] = entries[f"openai/{name}"] = _entry(context_length)
    found = False
    try:
        litellm = importlib.import_module("litellm")
    except ImportError:
        pass
    else:
        litellm.register_model(entries)
        found = True
    try:
        metadata = importlib.import_module("dspy.clients.model_metadata")
    except ImportError:
        pass
    else:
        # DSPy's native route reads its copy of the map (loaded once, then shared): `openai/<name>` entries there
        # describe the names for `dspy.LM("openai/<name>", api_base=...)`.
        data = metadata._load()
        for key, entry in entries.items():
            if "/" in key:
                data[key] = dict(entry)
        found = True
    if not found:
        raise ImportError("register: neither litellm nor dspy is installed")
    return all_names
