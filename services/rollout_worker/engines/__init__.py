"""Inference engines by `engine.type` in the RunConfig: hf (transformers in-process), openai (any
OpenAI-compatible completions server), vllm (in-process vLLM, GPU). Implementations import lazily."""

from __future__ import annotations

import importlib
from typing import Any

from services.rollout_worker.engines.base import (
    AdapterView,
    Generation,
    InferenceEngine,
    InferenceError,
    SamplingParams,
    UnservedRequest,
)
from shared.platform import tracing
from shared.platform.service import wait_for

ENGINES = {
    "hf": "services.rollout_worker.engines.hf:HFEngine",
    "openai": "services.rollout_worker.engines.openai:OpenAIEngine",
    "vllm": "services.rollout_worker.engines.vllm:VLLMEngine",
}


async def traced_generate(engine: InferenceEngine, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int,
                          timeout_s: float, parent: str | None = None) -> Generation:
    """One generation within `timeout_s`, as a `generate` span (child of `parent`, a traceparent, or of the
    current span) that says the weight version which served it."""
    with tracing.span("generate", parent, prompt_tokens=len(prompt_ids)) as span:
        gen = await wait_for(engine.generate(prompt_ids, sampling, max_tokens), timeout_s)
        span.set_attributes({"tokens": len(gen.ids), "weight_version": gen.weight_version})
    return gen


def build_engine(engine_type: str, model_path: str, engine_cfg: Any, tokenizer: Any, **kwargs) -> InferenceEngine:
    """Construct the engine named by `engine_type`; ValueError naming the choices otherwise."""
    if engine_type not in ENGINES:
        raise ValueError(f"unknown engine type {engine_type!r}; choose one of {', '.join(ENGINES)}")
    module, _, cls = ENGINES[engine_type].partition(":")
    return getattr(importlib.import_module(module), cls)(model_path, engine_cfg, tokenizer, **kwargs)


__all__ = ["ENGINES", "AdapterView", "Generation", "InferenceEngine", "InferenceError", "SamplingParams", "UnservedRequest",
           "build_engine", "traced_generate"]
