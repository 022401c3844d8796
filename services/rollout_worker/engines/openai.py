"""Any OpenAI-compatible completions server (vLLM, the mock LLM), token ids in and out.

Protocol (ports.md): POST {base_url}/completions {"model", "prompt": [ids], "max_tokens", "temperature",
"top_p", "logprobs": 1, "return_token_ids": true, "stop"?} -> choices[0].text / .token_ids /
.logprobs.token_logprobs / .finish_reason, optional top-level "weight_version".

Transient failures (connection errors, 429, 5xx, timeouts) are retried with backoff `max_retries` times,
then raised as InferenceError. Hot reload uses vLLM's dev-mode routes (pause -> collective_rpc
reload_weights -> reset_prefix_cache -> update_weight_version -> resume) on the server root; the checkpoint
folder must be visible to the server at the same path (shared volume).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import aiohttp

from services.rollout_worker.engines.base import Generation, InferenceEngine, InferenceError, SamplingParams
from shared.logs import get_logger

log = get_logger(__name__)
RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}


class OpenAIEngine(InferenceEngine):
    def __init__(self, model_path: str, engine_cfg: Any, tokenizer: Any, *, initial_version: int = 0, **_: Any):
        if not engine_cfg.base_url:
            raise ValueError("engine.base_url is required for the openai engine")
        self.model = model_path
        self.base_url = engine_cfg.base_url.rstrip("/")
        self.server_root = self.base_url.removesuffix("/v1")
        key = os.environ.get(engine_cfg.api_key_env) if engine_cfg.api_key_env else None
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.timeout = aiohttp.ClientTimeout(total=engine_cfg.request_timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self.max_retries = engine_cfg.max_retries
        self.tokenizer = tokenizer
        self._version = initial_version

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

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int) -> Generation:
        body = {"model": self.model, "prompt": list(prompt_ids), "max_tokens": max_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p, "logprobs": 1,
                "return_token_ids": True}
        if sampling.top_k > 0:
            body["top_k"] = sampling.top_k
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        version = self._version
        data = await self._post_with_retries(f"{self.base_url}/completions", body)
        choice = data["choices"][0]
        ids = list(choice.get("token_ids") or [])
        if not ids and choice.get("text"):  # a server without token ids: the only place we re-tokenize
            ids = self.tokenizer(choice["text"], add_special_tokens=False)["input_ids"]
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or [0.0] * len(ids)
        finish = "length" if choice.get("finish_reason") == "length" else "stop"
        return Generation(ids, [float(x or 0.0) for x in logprobs], choice.get("text", ""), finish,
                          int(data.get("weight_version", version)))

    async def _post_with_retries(self, url: str, body: dict) -> dict:
        error: Exception | None = None
        for attempt in range(self.max_retries + 1):
            try:
                async with self.session.post(url, json=body) as resp:
                    if resp.status in RETRYABLE_STATUS:
                        error = InferenceError(f"{url}: HTTP {resp.status}")
                    elif resp.status >= 400:  # 4xx other than 408/429: our request is wrong, do not retry
                        raise InferenceError(f"{url}: {resp.status} {(await resp.text())[:300]}")
                    else:
                        return await resp.json(content_type=None)
            except (aiohttp.ClientError, TimeoutError) as e:
                error = e
            await asyncio.sleep(min(0.2 * 2**attempt, 5.0))
        raise InferenceError(f"{url}: failed after {self.max_retries + 1} attempts: {error!r}")

    async def load_weights(self, folder: Path, version: int) -> None:
        root = self.server_root
        await self._call("POST", f"{root}/pause", params={"mode": "wait"})
        try:
            await self._call("POST", f"{root}/collective_rpc",
                             json={"method": "reload_weights", "kwargs": {"weights_path": str(folder)}})
            await self._call("POST", f"{root}/reset_prefix_cache")
            await self._call("POST", f"{root}/update_weight_version", json={"version": version})
        finally:
            await self._call("POST", f"{root}/resume")
        self._version = version

    async def _call(self, method: str, url: str, **kwargs: Any) -> None:
        async with self.session.request(method, url, **kwargs) as resp:
            if resp.status >= 400:
                raise InferenceError(f"{method} {url}: HTTP {resp.status} {(await resp.text())[:300]}")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
