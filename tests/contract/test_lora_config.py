"""`algorithm.lora`: absent means full weights; present, it is checked field by field with a reason."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from shared.contracts.run_config import RunConfig

BASE = {"name": "demo", "model": "/models/tiny", "dataset": "arith", "agent": {"name": "math"},
        "env": {"name": "math"}, "samples_per_task": 4}


def _lora(**lora) -> dict:
    return {**BASE, "algorithm": {"lora": lora}}


def _error(data) -> str:
    with pytest.raises(ValidationError) as e:
        RunConfig.model_validate(data)
    return str(e.value)


def test_absent_lora_trains_full_weights():
    assert RunConfig.model_validate(BASE).algorithm.lora is None


def test_lora_defaults_and_verl_fields():
    lora = RunConfig.model_validate(_lora(rank=8)).algorithm.lora
    assert (lora.alpha, lora.dropout, lora.target_modules) == (16, 0.0, "all-linear")
    cfg = RunConfig.model_validate(_lora(rank=4, alpha=8, dropout=0.05, target_modules=["q_proj", "v_proj"]))
    assert cfg.algorithm.lora.verl_fields() == {"lora_rank": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


@pytest.mark.parametrize("lora, where, words", [
    ({}, "algorithm.lora.rank", "Field required"),
    ({"rank": 0}, "algorithm.lora.rank", "greater than or equal to 1"),
    ({"rank": 512}, "algorithm.lora.rank", "less than or equal to 256"),
    ({"rank": 8, "alpha": 0}, "algorithm.lora.alpha", "greater than or equal to 1"),
    ({"rank": 8, "dropout": 1.0}, "algorithm.lora.dropout", "less than 1"),
    ({"rank": 8, "target_modules": []}, "algorithm.lora.target_modules", "name at least one module"),
    ({"rank": 8, "target_modules": "q_proj"}, "algorithm.lora.target_modules", "all-linear"),
    ({"rank": 8, "ranks": 4}, "algorithm.lora.ranks", "Extra inputs are not permitted"),
])
def test_bad_lora_fields_are_refused_with_the_field(lora, where, words):
    msg = _error(_lora(**lora))
    assert where in msg and words in msg, msg


def test_lora_engines():
    served = RunConfig.model_validate(_lora(rank=8) | {"engine": {"type": "openai", "base_url": "http://h:8000/v1"}})
    assert served.algorithm.lora.rank == 8  # a vLLM server's adapter routes (test_lora.py runs one)
    msg = _error(_lora(rank=128) | {"engine": {"type": "vllm", "max_lora_rank": 64}})
    assert "engine.max_lora_rank (64) is below algorithm.lora.rank (128)" in msg
    assert RunConfig.model_validate(_lora(rank=32) | {"engine": {"type": "vllm"}}).engine.max_loras == 4
