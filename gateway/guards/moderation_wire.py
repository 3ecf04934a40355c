"""OpenAI's moderations API as the guards call an upstream of it: the request sent and the part of the answer read."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ModerationRequest(BaseModel):
    input: str
    model: str | None = None


class ModerationResult(BaseModel):
    model_config = ConfigDict(extra="ignore")  # category_scores, category_applied_input_types, ...

    flagged: bool
    categories: dict[str, bool | None] = {}


class ModerationResponse(BaseModel):
    model_config = ConfigDict(extra="ignore")  # id, model

    results: list[ModerationResult]
