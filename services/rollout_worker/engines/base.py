"""The inference engine interface: token ids in, token ids + logprobs out, every result tagged with the
policy version of the weights that produced it."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from shared.weights import WeightUpdate


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
    # log p(token) under the distribution it was sampled from (after temperature, top-k, top-p), aligned with ids
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" | "length"
    weight_version: int
    info: dict = field(default_factory=dict)


def behaviour_logprobs(ids: list[int], logprobs: list | None, source: str) -> list[float]:
    """The engine's logprobs of `ids`, checked: one finite number per token, or InferenceError. A missing
    logprob is never filled in: a made-up behaviour logprob would bias the trainer's importance weights."""
    values = list(logprobs or [])
    if len(values) != len(ids) or not all(isinstance(v, int | float) and math.isfinite(v) for v in values):
        shown = sum(isinstance(v, int | float) for v in values)
        raise InferenceError(f"{source} returned {len(ids)} tokens but {shown} usable logprobs; behaviour "
                             "logprobs are required for every generated token")
    return [float(v) for v in values]


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

    #: True when `apply_update` is implemented (hf, vllm); the others always reload the full snapshot.
    supports_update: ClassVar[bool] = False

    async def apply_update(self, update: WeightUpdate) -> None:
        """Update the named tensors in place to `update.version` (the engine must be serving
        `update.base.version`) and serve it from the next request on. Every result is checked against the
        manifest (`update.apply` / `update.apply_in_place`): on ChecksumError nothing has changed and the old
        version keeps serving."""
        raise NotImplementedError(f"{type(self).__name__} reloads full checkpoints only")

    async def close(self) -> None:
        return None
