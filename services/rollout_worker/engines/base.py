"""The inference engine interface: token ids in, token ids + logprobs out, every result tagged with the
policy version of the weights that produced it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path


class InferenceError(Exception):
    """Inference failed after the engine's retries: an infrastructure failure, not the policy's."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 disables
    stop: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Generation:
    ids: list[int]
    logprobs: list[float]  # log p(token) under the sampling temperature, aligned with ids
    text: str
    finish_reason: str  # "stop" | "length"
    weight_version: int
    info: dict = field(default_factory=dict)


class InferenceEngine(ABC):
    """One model served to many concurrent trajectories."""

    @property
    @abstractmethod
    def version(self) -> int:
        """Policy version of the weights new requests start on."""

    @abstractmethod
    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int) -> Generation: ...

    @abstractmethod
    async def load_weights(self, folder: Path, version: int) -> None:
        """Serve the HF checkpoint in `folder` as `version` from the next request on, without restarting."""

    async def close(self) -> None:
        return None
