"""transformers in-process (CPU or GPU) with batched generation.

Requests collected for `batch_wait_ms` are generated together. Logprobs are of the distribution each token was
sampled from (after temperature, top-k, top-p), the meaning every engine shares. A weight reload or a delta
waits for the batch in flight, so every result carries the version its batch started on (a partial rollout's
batch yields between decode chunks instead: each token carries its own version); a delta that does not verify
is undone. LoRA runs share one engine per base model: one batch mixes runs' named PEFT adapters, and a
run's new adapter version changes no other run's adapter or version.

More: docs/vllm.md#the-hf-engine
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import Histogram

from services.rollout_worker.engines.base import (
    Generation,
    InferenceEngine,
    SamplingParams,
    UnservedRequest,
    check_adapter_base,
)
from shared.platform.logs import get_logger
from shared.weights.delta import read_safetensors
from shared.weights.manifest import ADAPTER_CONFIG, ADAPTER_WEIGHTS

if TYPE_CHECKING:
    from shared.weights.delta import WeightUpdate
    from shared.weights.manifest import BaseModelRef

log = get_logger(__name__)
BATCH_SIZE = Histogram("hf_batch_size", "Requests per HF generate call", buckets=(1, 2, 4, 8, 16, 32, 64, 128))
BATCH_SECONDS = Histogram("hf_batch_seconds", "Duration of one HF generate call")


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    future: asyncio.Future
    adapter: str | None = None  # the LoRA run whose adapter serves this request


class HFEngine(InferenceEngine):
    supports_update = True

    def __init__(self, model_path: str, engine_cfg: Any, tokenizer: Any, *, batch_wait_ms: float = 5.0,
                 initial_version: int = 0):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model_path = model_path
        self.device = engine_cfg.device
        dtype = getattr(torch, engine_cfg.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(self.device).eval()
        self.tokenizer = tokenizer
        self.max_batch_size = engine_cfg.max_batch_size
        self.partial_chunk_tokens = engine_cfg.partial_chunk_tokens
        self.batch_wait_s = batch_wait_ms / 1000
        self.eos_ids = _eos_ids(tokenizer, self.model)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        self._version = initial_version
        self._adapters: dict[str, tuple[str, int]] = {}  # LoRA run -> (PEFT adapter name, version)
        self._adapter_configs: dict[str, str] = {}  # LoRA run -> its adapter_config.json as served
        self._adapter_params: dict[str, dict] = {}  # PEFT adapter name -> its parameters by saved name
        self._pending: list[_Request] = []
        self._wakeup = asyncio.Event()
        self._lock = asyncio.Lock()  # one generate batch or one weight swap at a time
        self._loop_task: asyncio.Task | None = None

    @property
    def version(self) -> int:
        return self._version

    def adapter_version(self, run_id: str) -> int:
        """The adapter version run `run_id`'s requests start on (0: none loaded yet, the base serves it)."""
        return self._adapters.get(run_id, ("", 0))[1]

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int,
                       adapter: str | None = None) -> Generation:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.create_task(self._batch_loop())
        future = asyncio.get_running_loop().create_future()
        self._pending.append(_Request(list(prompt_ids), sampling, max_tokens, future, adapter))
        self._wakeup.set()
        return await future

    async def _batch_loop(self) -> None:
        while True:
            await self._wakeup.wait()
            await asyncio.sleep(self.batch_wait_s)  # let concurrent requests join the batch
            batch = self._take_batch()
            if not self._pending:
                self._wakeup.clear()
            if batch:
                await self._run_batch(batch)

    def _take_batch(self) -> list[_Request]:
        # a request whose caller stopped waiting (a cancelled sample) is dropped before it costs a batch row
        self._pending = [r for r in self._pending if not r.future.done()]
        if not self._pending:
            return []
        key = self._pending[0].sampling
        # a seeded request is generated alone: a row's draws would otherwise depend on the rows beside it
        batch = [r for r in self._pending if r.sampling == key][: 1 if key.seed is not None else self.max_batch_size]
        taken = set(map(id, batch))
        self._pending = [r for r in self._pending if id(r) not in taken]
        return batch

    async def _run_batch(self, batch: list[_Request]) -> None:
        if batch[0].sampling.partial and not any(r.adapter for r in batch):
            return await self._run_partial(batch)
        async with self._lock:
            versions = [self.adapter_version(r.adapter) if r.adapter else self._version for r in batch]
            names = [self._adapters.get(r.adapter, ("__base__", 0))[0] for r in batch]
            try:
                results = await asyncio.to_thread(self._generate_batch, batch, names)
            except Exception as e:
                return self._fail(batch, e)
        for r, version, (ids, logprobs, finish, details) in zip(batch, versions, results, strict=True):
            self._resolve(r, ids, logprobs, finish, version, **details)

    async def _run_partial(self, batch: list[_Request]) -> None:
        """A partial rollout's batch: decode `partial_chunk_tokens` at a time, letting a weight swap waiting for
        the engine take it between chunks; the rest of each generation continues on the new weights (its text so
        far re-read by them: no KV cache crosses a swap), each token tagged with the version that produced it."""
        ids: list[list[int]] = [[] for _ in batch]
        logprobs: list[list[float]] = [[] for _ in batch]
        versions: list[list[int]] = [[] for _ in batch]
        finish = ["length"] * len(batch)
        live = list(range(len(batch)))
        while live:
            async with self._lock:
                version = self._version
                chunk = [_Request(batch[i].prompt_ids + ids[i], batch[i].sampling,
                                  min(self.partial_chunk_tokens, batch[i].max_tokens - len(ids[i])), batch[i].future)
                         for i in live]
                try:
                    results = await asyncio.to_thread(self._generate_batch, chunk)
                except Exception as e:
                    return self._fail(batch, e)
            still = []
            for i, (new, lps, why, _) in zip(live, results, strict=True):
                ids[i] += new
                logprobs[i] += lps
                versions[i] += [version] * len(new)
                if why == "length" and len(ids[i]) < batch[i].max_tokens:
                    still.append(i)
                else:
                    finish[i] = why
            live = still
            await asyncio.sleep(0)  # the lock is free: a swap waiting for it goes first
        for i, r in enumerate(batch):
            self._resolve(r, ids[i], logprobs[i], finish[i], versions[i][0] if versions[i] else self._version,
                          versions[i])

    @staticmethod
    def _fail(batch: list[_Request], error: Exception) -> None:
        for r in batch:
            if not r.future.done():
                r.future.set_exception(error)

    def _resolve(self, r: _Request, ids: list[int], logprobs: list[float], finish: str, version: int,
                 versions: list[int] | None = None, **details) -> None:
        if not r.future.done():
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            r.future.set_result(Generation(ids, logprobs, text, finish, version, versions, **details))

    def _generate_batch(self, batch: list[_Request], adapter_names: list[str] | None = None,
                        ) -> list[tuple[list[int], list[float], str, dict]]:
        """Per request: its tokens, their logprobs, the finish reason and the Generation fields the sampling asked
        for beyond those (top_logprobs, prompt_logprobs, prompt_top_logprobs)."""
        torch = self.torch
        start = time.perf_counter()
        width = max(len(r.prompt_ids) for r in batch)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):  # left padding: every prompt ends where generation starts
            input_ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            attention[i, width - len(r.prompt_ids):] = 1
        sampling = batch[0].sampling
        max_new = max(r.max_tokens for r in batch)
        per_row = {"adapter_names": adapter_names} if self._adapters and adapter_names else {}
        with torch.no_grad(), self._rng(sampling.seed):
            out = self.model.generate(**per_row,
                input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
                max_new_tokens=max_new, **self._sampling_kwargs(sampling),
                eos_token_id=self.eos_ids, pad_token_id=self.pad_id, output_scores=True,
                return_dict_in_generate=True, stop_strings=list(sampling.stop) or None,
                tokenizer=self.tokenizer if sampling.stop else None,
            )
        tokens = out.sequences[:, width:].cpu()
        scores = torch.stack(out.scores, dim=1).float().cpu()  # (batch, steps, vocab), after the warpers
        distributions = torch.log_softmax(scores, dim=-1)
        logprobs = distributions.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        results = []
        for i, r in enumerate(batch):
            ids, lps, finish = self._cut(tokens[i].tolist(), logprobs[i].tolist(), r.max_tokens, sampling.stop)
            details = {}
            if sampling.logprobs:
                details["top_logprobs"] = top_logprobs(distributions[i, :len(ids)], sampling.logprobs)
            if sampling.scores_prompt:
                details |= self._prompt_scores(r.prompt_ids, adapter_names[i] if per_row else None, sampling)
            results.append((ids, lps, finish, details))
        BATCH_SIZE.observe(len(batch))
        BATCH_SECONDS.observe(time.perf_counter() - start)
        return results

    @contextlib.contextmanager
    def _rng(self, seed: int | None):
        """generate's random state: torch's own, or (a seed) one of its own, torch's left as it was."""
        if seed is None:
            yield
            return
        with self.torch.random.fork_rng(devices=[self.device] if str(self.device).startswith("cuda") else []):
            self.torch.manual_seed(seed)
            yield

    def _prompt_scores(self, prompt_ids: list[int], adapter_name: str | None, sampling: SamplingParams) -> dict:
        """What the request asked of its prompt, from one forward pass of the prompt alone (HF's generate keeps
        no prompt logits) under the model served to it: logprobs (no temperature: a trainer's) of its own tokens,
        of their k likeliest and of the target ids; and k draws at the request's temperature per position."""
        torch = self.torch
        per_row = {"adapter_names": [adapter_name]} if adapter_name else {}
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([prompt_ids], device=self.device), **per_row).logits
        logits = logits[0, :-1].float().cpu()  # row i: the distribution over prompt token i + 1
        distributions = torch.log_softmax(logits, dim=-1)
        details = {}
        if sampling.prompt_logprobs is not None:
            own = distributions.gather(-1, torch.tensor(prompt_ids[1:]).unsqueeze(-1)).squeeze(-1).tolist()
            details["prompt_logprobs"] = [None, *own]
            if sampling.prompt_logprobs:
                details["prompt_top_logprobs"] = [None, *top_logprobs(distributions, sampling.prompt_logprobs)]
        if sampling.prompt_targets:
            details["prompt_target_logprobs"] = target_logprobs(distributions, sampling.prompt_targets)
        if sampling.prompt_alt_k:
            with self._rng(sampling.seed):
                details["prompt_alt_tokens"] = alt_draws(logits, sampling.prompt_alt_k, sampling.temperature)
        return details

    def _sampling_kwargs(self, s: SamplingParams) -> dict:
        if s.greedy:
            return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        return {"do_sample": True, "temperature": s.temperature, "top_p": s.top_p,
                "top_k": s.top_k if s.top_k > 0 else 0}

    def _cut(self, ids: list[int], logprobs: list[float], max_tokens: int,
             stop_strings: tuple[str, ...]) -> tuple[list[int], list[float], str]:
        """One sequence's own completion: through its first EOS, without padding, at most max_tokens."""
        for n, tok in enumerate(ids[:max_tokens]):
            if tok in self.eos_ids:
                return ids[: n + 1], logprobs[: n + 1], "stop"
        ids, logprobs = ids[:max_tokens], logprobs[:max_tokens]
        if stop_strings and self.pad_id not in self.eos_ids:
            # generate pads a row that a stop string ended; a pad token the model sampled is not such an end
            for n, tok in enumerate(ids):
                if tok == self.pad_id and any(s in self.tokenizer.decode(ids[:n]) for s in stop_strings):
                    return ids[:n], logprobs[:n], "stop"
        return ids, logprobs, "length"

    async def load_weights(self, folder: Path, version: int) -> None:
        state = await asyncio.to_thread(read_safetensors, Path(folder))
        async with self._lock:  # between batches: requests in flight finish on the old version
            await asyncio.to_thread(self._swap, state)
            self._version = version
        log.info("hf engine now serves version %d from %s", version, folder, extra={"policy_version": version})

    def _swap(self, state: dict) -> None:
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if unexpected:
            raise ValueError(f"checkpoint has tensors the model lacks: {unexpected[:5]}")
        untied = [k for k in missing if not k.endswith("lm_head.weight")]
        if untied:
            raise ValueError(f"checkpoint lacks tensors: {untied[:5]}")
        self.model.tie_weights()

    async def apply_update(self, update: WeightUpdate) -> None:
        params = self.model.state_dict()  # tensors sharing the parameters' storage
        if update.fits_in_place(params):  # CPU, same dtype: patch and check in place between two batches
            async with self._lock:
                await asyncio.to_thread(update.apply_in_place, params)
                self._version = update.version
        else:  # GPU or a wider dtype: rebuild the changed tensors (verified) while batches run, then copy in
            new = await asyncio.to_thread(update.apply, params)
            async with self._lock:
                await asyncio.to_thread(self._copy_in, params, new)
                self._version = update.version
        log.info("hf engine now serves version %d (%d tensors updated in place)", update.version,
                 len(update.names), extra={"policy_version": update.version})

    async def load_adapter(self, run_id: str, folder: Path, version: int, base_model: BaseModelRef) -> None:
        """Serve the PEFT adapter in `folder` to run `run_id` as `version` from its next request on; the other
        runs' adapters are untouched. ChecksumError (nothing changes) when it was trained on another base."""
        from safetensors.torch import load_file

        await check_adapter_base(self.model_path, run_id, version, base_model)
        old = self._adapters.get(run_id)
        config = (Path(folder) / ADAPTER_CONFIG).read_text()
        if old is not None and self._adapter_configs.get(run_id) == config:  # same shapes: copy the tensors in
            state = await asyncio.to_thread(load_file, str(Path(folder) / ADAPTER_WEIGHTS))
            async with self._lock:  # between batches
                await asyncio.to_thread(self._copy_adapter, old[0], state)
                self._adapters[run_id] = (old[0], version)
        else:
            name = f"run_{run_id.replace('-', '')}_v{version}"  # a new name: the old version serves until the swap
            async with self._lock:  # between batches
                await asyncio.to_thread(self._add_adapter, name, folder)
                self._adapters[run_id] = (name, version)
                if old is not None:
                    self._delete_adapter(old[0])
        self._adapter_configs[run_id] = config
        log.info("hf engine serves run %s its adapter v%d", run_id, version,
                 extra={"run_id": run_id, "policy_version": version})

    def _add_adapter(self, name: str, folder: Path) -> None:
        from peft import PeftModel

        if isinstance(self.model, PeftModel):
            self.model.load_adapter(str(folder), adapter_name=name, is_trainable=False)
        else:
            self.model = PeftModel.from_pretrained(self.model, str(folder), adapter_name=name).eval()

    def _delete_adapter(self, name: str) -> None:
        self.model.delete_adapter(name)
        self._adapter_params.pop(name, None)

    def _copy_adapter(self, name: str, state: dict) -> None:
        params = self._adapter_params.get(name)
        if params is None:
            params = self._adapter_params[name] = self._adapter_tensors(name)
        if set(state) != set(params):
            raise ValueError(f"adapter file has other tensors than adapter {name}: {sorted(set(state) ^ set(params))[:5]}")
        shapes = [n for n, t in state.items() if t.shape != params[n].shape]
        if shapes:
            raise ValueError(f"adapter tensors of other shapes than adapter {name}'s: {shapes[:5]}")
        self._copy_in(params, state)

    def _adapter_tensors(self, name: str) -> dict:
        """Adapter `name`'s parameters under PEFT's saved names, as tensors sharing the parameters' storage, so a
        new version is copied straight in (PEFT's set_peft_model_state_dict walks the whole model's state: ~40 ms
        a version on the bench's 114M model, against ~3 ms for the copies)."""
        from peft.utils import get_peft_model_state_dict

        views = get_peft_model_state_dict(self.model, adapter_name=name)
        storage = {p.data_ptr() for p in self.model.parameters()}
        stray = [n for n, t in views.items() if t.data_ptr() not in storage]
        if stray:  # a PEFT that returns copies would make in-place copies update nothing
            raise RuntimeError(f"PEFT's state dict of adapter {name} does not share the parameters' storage: {stray[:3]}")
        return views

    async def remove_adapter(self, run_id: str) -> None:
        self._adapter_configs.pop(run_id, None)
        async with self._lock:
            old = self._adapters.pop(run_id, None)
            if old is not None and len(self.model.peft_config) > 1:  # PEFT keeps at least one adapter
                self._delete_adapter(old[0])

    def served_adapter(self, run_id: str) -> dict:
        """The adapter tensors run `run_id` is served with, under PEFT's saved names (what its file holds)."""
        from peft.utils import get_peft_model_state_dict

        return get_peft_model_state_dict(self.model, adapter_name=self._adapters[run_id][0])

    def _copy_in(self, params: dict, new: dict) -> None:
        with self.torch.no_grad():
            for name, t in new.items():
                params[name].copy_(t)

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()


def top_logprobs(distributions, k: int) -> list[list[tuple[int, float]]]:
    """Per row of log-probabilities, its k likeliest tokens (id, logprob), likeliest first; tokens a warper ruled
    out (-inf) are left out, so a row may hold fewer than k."""
    values, ids = distributions.topk(min(k, distributions.shape[-1]), dim=-1)
    return [[(t, v) for t, v in zip(row_ids, row_values, strict=True) if v != float("-inf")]
            for row_ids, row_values in zip(ids.tolist(), values.tolist(), strict=True)]


def target_logprobs(distributions, targets: tuple[tuple[int, ...], ...]) -> list[list[float]]:
    """Per row of log-probabilities, those of the row's target ids; 0.0 where the id is -1 (none asked)."""
    import torch

    rows, vocab = distributions.shape
    if len(targets) != rows:
        raise UnservedRequest(f"target prompt logprobs have {len(targets)} rows for a prompt of {rows + 1} tokens; "
                              "give one row per prompt position after the first")
    ids = torch.tensor(targets, dtype=torch.long)
    if ids.numel() and int(ids.max()) >= vocab:
        raise UnservedRequest(f"target prompt logprobs name token id {int(ids.max())}, outside the model's vocabulary "
                              f"of {vocab}")
    values = distributions.gather(-1, ids.clamp(min=0))
    return values.masked_fill(ids < 0, 0.0).tolist()


def alt_draws(logits, k: int, temperature: float) -> list[list[tuple[int, float]]]:
    """Per row of logits, k draws with replacement at `temperature` and their logprobs under the distribution drawn
    from; temperature 0 draws the likeliest token k times, with its logprob under the model."""
    import torch

    if temperature == 0:
        distributions = torch.log_softmax(logits, dim=-1)
        ids = distributions.argmax(dim=-1, keepdim=True).expand(-1, k)
    else:
        distributions = torch.log_softmax(logits / temperature, dim=-1)
        ids = torch.multinomial(distributions.exp(), k, replacement=True)
    values = distributions.gather(-1, ids)
    return [list(zip(row_ids, row_values, strict=True)) for row_ids, row_values in zip(ids.tolist(), values.tolist(),
                                                                                       strict=True)]


def _eos_ids(tokenizer: Any, model: Any) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = list(ids) if isinstance(ids, list | tuple) else ([ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids
