"""The admin API's LoRA adapter bodies, as vLLM's server takes them, with `base` added: the model to load into."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class LoadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # vLLM's other fields (is_3d_lora_weight) change nothing here

    lora_name: str = Field(min_length=1, description="The name the adapter is served under")
    lora_path: str = Field(min_length=1, description="Its PEFT directory, on the gateway's file system")
    base: str | None = Field(None, description="The base model to load it into; unset: the one model serving adapters")
    load_inplace: bool = Field(False, description="Replace a loaded adapter of this name (not supported: unload first)")


class UnloadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1, description="The adapter to unload")
