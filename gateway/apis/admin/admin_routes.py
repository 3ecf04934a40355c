"""The admin API (admin keys only): LoRA adapters loaded and unloaded while serving, answered as vLLM's server
answers."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from gateway.apis.admin.admin_wire import LoadAdapterRequest, UnloadAdapterRequest
from gateway.errors import InvalidRequest
from gateway.web.requests import parse, state_of


async def load_adapter(request: Request) -> Response:
    body = await parse(request, LoadAdapterRequest)
    if body.load_inplace:
        raise InvalidRequest("load_inplace is not supported here: unload the adapter, then load it", "load_inplace")
    await state_of(request).adapters.load(body.lora_name, body.lora_path, body.base)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_adapter(request: Request) -> Response:
    body = await parse(request, UnloadAdapterRequest)
    await state_of(request).adapters.unload(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
