"""The config of a Tinker training run: one LoRA training client of the Tinker API (docs/tinker.md), stored in
`runs.config` of a run of kind `tinker`. The API sends it in a `create` run command; the controller stores the run
`running` and never drives it (its work arrives as Tinker operations, not rollout tasks)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class TinkerRunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    kind: Literal["tinker"] = "tinker"
    name: str = Field(..., max_length=200)
    model_id: str = Field(..., description="the Tinker model id: <session id>:train:<model_seq_id>")
    session_id: str
    owner: str = Field(..., description="sha256 of the flywheel token whose tml- key made it")
    owner_name: str = Field(..., description="that token's name (API_TOKEN for the bootstrap token)")
    base_model: str = Field(..., description="the name the client gave, as get_server_capabilities offers it")
    model: str = Field(..., description="the folder or hub id of the base model")
    lora: dict[str, Any] = Field(..., description="the client's LoRA config: rank, seed, train_mlp/attn/unembed")
    optimizer: dict[str, Any] = Field(default_factory=lambda: {"type": "adamw"})
    user_metadata: dict[str, Any] = Field(default_factory=dict)
