"""Stream `weights`: weight server -> rollout workers. Sent only after the checkpoint is durable."""

from __future__ import annotations

from pydantic import Field

from shared.contracts.messages.codec import Message


class WeightsPublished(Message):
    TYPE = "weights_published"
    SCHEMA_VERSION = 1

    run_id: str
    version: int = Field(ge=0, description="policy version: number of optimizer steps behind these weights")
    uri: str = Field(description="HTTP base of the checkpoint folder on the weight server")
    path: str | None = Field(None, description="the same folder on a shared volume, when co-located")
    sha256: str = Field(description="sha256 of the checkpoint's MANIFEST.json (which lists each file's sha256)")
    bytes: int = Field(ge=0, description="total size of the checkpoint files")
    created_at: float
