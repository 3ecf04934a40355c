"""The models API's routes."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import ModelNotFound
from gateway.protocol.openai import ModelCard, ModelList
from gateway.web.answers import json_response
from gateway.web.requests import access, state_of


def _cards(request: Request) -> list[ModelCard]:
    """The names the key may use (those that reach a model it may: `ModelRegistry.listing`)."""
    return state_of(request).models.listing(access(request)).data


async def list_models(request: Request) -> Response:
    return json_response(ModelList(data=_cards(request)))


async def retrieve_model(request: Request) -> Response:
    """One of `list_models`' cards by its id (which may hold slashes: org/name); 404 model_not_found
    for a model the key may not use, as for one that does not exist."""
    name = request.path_params["model"]
    if not name:  # /v1/models/: no id, as an unknown path
        raise HTTPException(status_code=404)
    card = next((card for card in _cards(request) if card.id == name), None)
    if card is None:
        raise ModelNotFound(f"The model '{name}' does not exist or you do not have access to it.", "model")
    return json_response(card)

