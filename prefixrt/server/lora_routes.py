"""LoRA adapters on the server: `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` (vLLM's names and
bodies: {"lora_name", "lora_path"}), and the adapters as models (`/v1/models` lists each with the base model as its
`parent`; `model=<adapter name>` on the OpenAI routes and the Messages API runs under it: errors.check_model).

The served adapter names are kept in `app.state.lora_names`, read from the engine at start and changed only by
these routes, so a request's model is resolved without a round trip to the engine process. Both routes are
administrative (admission.py ADMIN_ROUTES): they change what every tenant is served.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.responses import PlainTextResponse

from prefixrt.errors import InvalidRequest
from prefixrt.server.errors import RequestFailed

router = APIRouter()


class LoadLoraAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; accepted and ignored


def served_lora_names(engine) -> set[str]:
    """The adapters an engine serves now (none for an engine without LoRA)."""
    names = getattr(engine, "lora_adapters", None)
    return set(names()) if names is not None else set()


def adapter_card(base_card: dict, name: str) -> dict:
    """An adapter's entry in /v1/models: the base model's card under the adapter's name, its parent the base."""
    return {**base_card, "id": name, "root": name, "parent": base_card["id"]}


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request):
    state = request.app.state
    if body.lora_name in state.model_names:
        raise InvalidRequest(f"{body.lora_name!r} is the base model's name", param="lora_name")
    try:
        await run_in_threadpool(state.engine.load_lora_adapter, body.lora_name, body.lora_path)
    except (ValueError, OSError) as e:
        raise RequestFailed(400, str(e), type_="invalid_request_error", param="lora_path") from None
    state.lora_names.add(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request):
    state = request.app.state
    try:
        await run_in_threadpool(state.engine.unload_lora_adapter, body.lora_name)
    except KeyError:
        raise RequestFailed(404, f"no LoRA adapter named {body.lora_name!r} is loaded", type_="not_found_error",
                            param="lora_name", code="model_not_found") from None
    except ValueError as e:  # in use
        raise RequestFailed(409, str(e), type_="invalid_request_error", param="lora_name", code="lora_in_use") \
            from None
    state.lora_names.discard(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
