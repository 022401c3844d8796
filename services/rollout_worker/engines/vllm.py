"""In-process vLLM (GPU rollout image only). Written against vLLM 0.33's documented API (FACTS.md); it
cannot run on the CPU machines, so it is kept thin and the protocol is tested through the HF engine.

Hot reload: pause generation -> collective_rpc("reload_weights", weights_path=DIR) -> reset prefix cache ->
resume; requests in flight finish before the pause returns ("wait" mode).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from services.rollout_worker.engines.base import Generation, InferenceEngine, SamplingParams


class VLLMEngine(InferenceEngine):
    def __init__(self, model_path: str, engine_cfg: Any, tokenizer: Any, *, initial_version: int = 0, **_: Any):
        from vllm import AsyncEngineArgs, AsyncLLMEngine

        args = AsyncEngineArgs(model=model_path, tokenizer=model_path, dtype=engine_cfg.dtype,
                               gpu_memory_utilization=engine_cfg.gpu_memory_utilization,
                               tensor_parallel_size=engine_cfg.tensor_parallel_size)
        self.engine = AsyncLLMEngine.from_engine_args(args)
        self._version = initial_version

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int) -> Generation:
        from vllm import SamplingParams as VllmSampling

        params = VllmSampling(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                              max_tokens=max_tokens, stop=list(sampling.stop) or None, logprobs=0)
        version = self._version
        final = None
        async for out in self.engine.generate({"prompt_token_ids": list(prompt_ids)}, params, uuid.uuid4().hex):
            final = out
        completion = final.outputs[0]
        ids = list(completion.token_ids)
        logprobs = [entry[tok].logprob for tok, entry in zip(ids, completion.logprobs or [], strict=False)]
        finish = "length" if completion.finish_reason == "length" else "stop"
        return Generation(ids, logprobs or [0.0] * len(ids), completion.text, finish, version)

    async def load_weights(self, folder: Path, version: int) -> None:
        await self.engine.pause_generation(mode="wait")
        try:
            await self.engine.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
            await self.engine.reset_prefix_cache()
            self._version = version
        finally:
            await self.engine.resume_generation()

    async def close(self) -> None:
        self.engine.shutdown()
