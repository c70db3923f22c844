"""JSON-schema values as users give them -> the schema itself: the one place a pydantic class becomes a schema.

`SamplingParams.json_schema` (and the frontend's `gen(json_schema=...)`) accept a dict (or a bool schema),
JSON text, or a pydantic BaseModel subclass. Whatever must hand a plain schema on calls `to_json_schema`:
the constraint compiler (its cache key and both backends), the engine-process pipe (classes are not sent
across it), RemoteEngine's JSON body and the frontend's OpenAI backend (response_format).
"""

from __future__ import annotations

import json
from typing import Any

from prefixrt.errors import InvalidRequest


def to_json_schema(spec: Any) -> dict | bool:
    """The schema `spec` stands for: a dict or bool as is, JSON text parsed, a pydantic model class's
    `model_json_schema()`. Raises InvalidRequest (param "json_schema") for anything else, for text that is
    not JSON, and for a class pydantic cannot describe. Never mutates `spec`."""
    if isinstance(spec, type):
        schema_fn = getattr(spec, "model_json_schema", None)
        if schema_fn is None:
            raise InvalidRequest(
                f"json_schema class {spec.__name__} is not a pydantic BaseModel subclass", param="json_schema"
            )
        try:
            return schema_fn()
        except Exception as e:  # pydantic raises several types for unschematizable fields
            raise InvalidRequest(f"cannot build a JSON schema from {spec.__name__}: {e}", param="json_schema") from e
    if isinstance(spec, (str, bytes)):
        try:
            spec = json.loads(spec)
        except ValueError as e:
            raise InvalidRequest(f"json_schema is not valid JSON: {e}", param="json_schema") from e
    if isinstance(spec, (bool, dict)):
        return spec
    raise InvalidRequest(
        f"json_schema must be a JSON object (dict), JSON text or a pydantic model class, not {type(spec).__name__}",
        param="json_schema",
    )
