"""Any OpenAI-compatible completions server (vLLM, the mock LLM), token ids in and out.

A reply without a logprob for every token is an InferenceError (never filled in); transient failures are
retried with backoff `max_retries` times. Hot reload and deltas use vLLM's dev-mode routes and the worker
extension: new requests wait at a gate, ours in flight finish on their version. A server is reloaded by the
one worker that uses it. LoRA runs load each adapter version under its own name (`<run>-v<n>`), so a result's
version is exact without pausing anything.

More: docs/vllm.md#the-openai-engine
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

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
from shared.platform.retry import RetryPolicy

if TYPE_CHECKING:
    from shared.weights.delta import WeightUpdate
    from shared.weights.manifest import BaseModelRef

log = get_logger(__name__)
RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}


class ServerBusy(Exception):
    """The server answered with a RETRYABLE_STATUS."""


TRANSIENT = (aiohttp.ClientError, TimeoutError, ServerBusy)


class OpenAIEngine(InferenceEngine):
    supports_update = True  # needs a vLLM server with FlywheelWorkerExtension, as load_weights does

    def __init__(self, model_path: str, engine_cfg: Any, tokenizer: Any, *, initial_version: int = 0,
                 scratch_dir: str | Path | None = None, **_: Any):
        if not engine_cfg.base_url:
            raise ValueError("engine.base_url is required for the openai engine")
        self.model = model_path
        self.base_url = engine_cfg.base_url.rstrip("/")
        self.server_root = self.base_url.removesuffix("/v1")
        key = os.environ.get(engine_cfg.api_key_env) if engine_cfg.api_key_env else None
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.timeout = aiohttp.ClientTimeout(total=engine_cfg.request_timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self.retry = RetryPolicy(TRANSIENT, attempts=engine_cfg.max_retries + 1, first_wait_s=0.2, max_wait_s=5.0,
                                 what="inference request")
        self.tokenizer = tokenizer
        self._version = initial_version
        self._gate = ReloadGate()
        self._served = ServedTensors(model_path, scratch_dir)  # model_path: the server's --model folder
        self._adapters: dict[str, tuple[str, int]] = {}  # LoRA run -> (the adapter's name on the server, version)
        self._zero: str | None = None  # the name runs without an adapter are served under, once any is loaded
        self._using: Counter[str] = Counter()  # adapter name -> our requests in flight with it
        self._retired: set[str] = set()  # names to unload once unused

    @property
    def version(self) -> int:
        return self._version

    @property
    def session(self) -> aiohttp.ClientSession:
        # aiohttp, not httpx: httpx's pool scans every pooled connection per request, which at 128+ requests
        # in flight took 72% of the worker's CPU in bench-rollout. Created lazily: it binds the running loop.
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=self.headers, timeout=self.timeout,
                                                  connector=aiohttp.TCPConnector(limit=1024))
        return self._session

    def adapter_version(self, run_id: str) -> int:
        """The adapter version run `run_id`'s requests start on (0: none loaded yet, the base serves it)."""
        return self._adapters.get(run_id, ("", 0))[1]

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int,
                       adapter: str | None = None) -> Generation:
        if sampling.logprobs or sampling.scores_prompt:
            # the completions API names top tokens by their text, which does not map back to ids losslessly
            raise UnservedRequest("engine type openai returns each generated token's own logprob only; top-k and "
                                  "prompt logprobs are served by engine types hf and vllm, target prompt logprobs "
                                  "and prompt alt tokens by engine type hf")
        name = None
        if adapter is not None:  # a LoRA run: the name pins the adapter version, whatever loads meanwhile
            name, version = self._adapters.get(adapter, (self._zero, 0))
        body = {"model": name or self.model, "prompt": list(prompt_ids), "max_tokens": max_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p, "logprobs": 1,
                "return_token_ids": True}
        if sampling.top_k > 0:
            body["top_k"] = sampling.top_k
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        if name is not None:
            self._using[name] += 1
        try:
            async with self._gate.request():
                if adapter is None:
                    version = self._version  # no reload starts while this request runs
                data = await self._post_with_retries(f"{self.base_url}/completions", body)
        finally:
            if name is not None:
                self._using[name] -= 1
                await self._unload_retired()
        choice = data["choices"][0]
        ids = list(choice.get("token_ids") or [])
        if not ids and choice.get("text"):  # a server without token ids: the only place we re-tokenize
            ids = self.tokenizer(choice["text"], add_special_tokens=False)["input_ids"]
        logprobs = behaviour_logprobs(ids, (choice.get("logprobs") or {}).get("token_logprobs"), self.base_url)
        finish = "length" if choice.get("finish_reason") == "length" else "stop"
        if adapter is None:
            version = int(data.get("weight_version", version))
        return Generation(ids, logprobs, choice.get("text", ""), finish, version)

    async def _post_with_retries(self, url: str, body: dict) -> dict:
        async def post() -> dict:
            async with self.session.post(url, json=body) as resp:  # the session's timeout bounds each attempt
                if resp.status in RETRYABLE_STATUS:
                    raise ServerBusy(f"{url}: HTTP {resp.status}")
                if resp.status >= 400:  # 4xx other than 408/429: our request is wrong, do not retry
                    raise InferenceError(f"{url}: {resp.status} {(await resp.text())[:300]}")
                return await resp.json(content_type=None)

        try:
            return await self.retry.call_async(post)
        except TRANSIENT as e:
            raise InferenceError(f"{url}: failed after {self.retry.attempts} attempts: {e!r}") from e

    async def load_weights(self, folder: Path, version: int) -> None:
        await self._swap("flywheel_reload", {"weights_path": str(folder)}, version)
        self._served.reloaded(folder)
        log.info("server %s now serves version %d from %s", self.server_root, version, folder,
                 extra={"policy_version": version})

    async def apply_update(self, update: WeightUpdate) -> None:
        async def packed() -> dict:
            reply = await self._call("POST", f"{self.server_root}/collective_rpc",
                                     json={"method": "flywheel_packed_modules"})
            results = (reply or {}).get("results") or [None]
            if not isinstance(results[0], dict):
                raise InferenceError(f"{self.server_root}: flywheel_packed_modules answered {reply!r}")
            return results[0]

        async def load(path: str) -> None:
            await self._swap("flywheel_load_tensors", {"path": path}, update.version)

        loaded = await self._served.apply(update, packed, load)
        log.info("server %s now serves version %d (%d tensors changed, %d loaded)", self.server_root,
                 update.version, len(update.names), loaded, extra={"policy_version": update.version})

    async def load_adapter(self, run_id: str, folder: Path, version: int, base_model: BaseModelRef) -> None:
        """Serve the PEFT adapter in `folder` to run `run_id` as `version` from its next request on; the other
        runs' adapters are untouched. ChecksumError (nothing changes) when it was trained on another base."""
        await check_adapter_base(self.model, run_id, version, base_model)
        name = f"{run_id}-v{version}"
        await self._load_lora(name, folder)
        if self._zero is None:
            parent = self._served.scratch_dir  # where the server reads our files from
            await self._load_lora("zero", await asyncio.to_thread(zero_adapter, Path(folder), parent))
            self._zero = "zero"
        old = self._adapters.get(run_id)
        self._adapters[run_id] = (name, version)
        if old is not None:
            self._retired.add(old[0])
            await self._unload_retired()
        log.info("server %s serves run %s its adapter v%d", self.server_root, run_id, version,
                 extra={"run_id": run_id, "policy_version": version})

    async def remove_adapter(self, run_id: str) -> None:
        old = self._adapters.pop(run_id, None)
        if old is not None:
            self._retired.add(old[0])
            await self._unload_retired()

    async def _load_lora(self, name: str, folder: Path) -> None:
        try:  # in place: a restarted worker loads the names it loaded before (same name, same files)
            await self._call("POST", f"{self.base_url}/load_lora_adapter",
                             json={"lora_name": name, "lora_path": str(folder), "load_inplace": True})
        except (InferenceError, *TRANSIENT) as e:
            raise InferenceError(
                f"{self.server_root} did not load LoRA adapter {name} from {folder}: {e}. LoRA runs need the server "
                "started with --enable-lora and --max-lora-rank >= the run's rank, VLLM_ALLOW_RUNTIME_LORA_UPDATING=True "
                "in its environment, and the adapter folder at the same path") from e

    async def _unload_retired(self) -> None:
        for name in [n for n in self._retired if not self._using[n]]:
            if name not in self._retired:  # another call unloads it
                continue
            self._retired.discard(name)
            self._using.pop(name, None)
            try:
                await self._call("POST", f"{self.base_url}/unload_lora_adapter", json={"lora_name": name})
            except (InferenceError, *TRANSIENT) as e:  # it only holds a slot of the server's adapter cache
                log.warning("server %s did not unload LoRA adapter %s: %s", self.server_root, name, e)

    async def _swap(self, method: str, kwargs: dict, version: int) -> None:
        """Run the worker extension's `method` on the server with generation paused, then serve `version`."""
        root = self.server_root
        async with self._gate.reload():  # our requests in flight finish on the version they started on
            await self._call("POST", f"{root}/pause", params={"mode": "wait"})
            try:
                reply = await self._call("POST", f"{root}/collective_rpc", json={"method": method, "kwargs": kwargs})
                if (error := reload_failure((reply or {}).get("results"))) is not None:
                    raise InferenceError(f"{root}: {method} {kwargs} for version {version} failed: {error}")
                await self._call("POST", f"{root}/reset_prefix_cache")
                await self._call("POST", f"{root}/update_weight_version", json={"new_version": str(version)})
                self._version = version  # before resume: nothing generated on these weights is labelled older
            finally:
                await self._call("POST", f"{root}/resume")

    async def _call(self, method: str, url: str, **kwargs: Any) -> Any:
        async with self.session.request(method, url, **kwargs) as resp:
            if resp.status >= 400:
                raise InferenceError(f"{method} {url}: HTTP {resp.status} {(await resp.text())[:300]}")
            text = await resp.text()
            with contextlib.suppress(ValueError):
                return json.loads(text)
            return None  # routes that answer with an empty body

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
