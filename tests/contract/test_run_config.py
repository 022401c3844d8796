"""Run config validation: good configs pass, bad ones fail naming the field and the reason."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from shared.contracts.run_config import RunConfig
from shared.platform.settings import ServiceSettings

BASE = {
    "name": "demo", "model": "/models/tiny", "dataset": "arith",
    "agent": {"name": "math"}, "env": {"name": "math"}, "samples_per_task": 4,
}


def _cfg(**over):
    return {**BASE, **over}


def _error(data) -> str:
    with pytest.raises(ValidationError) as e:
        RunConfig.model_validate(data)
    return str(e.value)


def test_minimal_config_defaults():
    cfg = RunConfig.model_validate(BASE)
    assert cfg.kind == "train" and cfg.engine.type == "hf" and cfg.algorithm.adv_estimator == "grpo"
    assert cfg.tokenizer_path == "/models/tiny"


def test_user_import_path_that_resolves():
    cfg = RunConfig.model_validate(_cfg(env={"name": "shared.sdk.agent:BaseEnv"}))
    assert cfg.env.name == "shared.sdk.agent:BaseEnv"


@pytest.mark.parametrize("data, field, reason", [
    (_cfg(env={"name": "nosuchenv"}), "env", "unknown env 'nosuchenv'"),
    (_cfg(agent={"name": "my_pkg.nowhere:Agent"}), "agent", "cannot import module 'my_pkg.nowhere'"),
    (_cfg(agent={"name": "shared.sdk.agent:Missing"}), "agent", "has no attribute 'Missing'"),
    (_cfg(algorithm={"adv_estimator": "ppo2"}), "algorithm.adv_estimator", "unknown advantage estimator"),
    (_cfg(algorithm={"policy_loss": "clipz"}), "algorithm.policy_loss", "unknown policy loss"),
    (_cfg(samples_per_task=0), "samples_per_task", "greater than or equal to 1"),
    (_cfg(max_staleness=-1), "max_staleness", "greater than or equal to 0"),
    (_cfg(engine={"type": "tgi"}), "engine.type", "'hf', 'vllm' or 'openai'"),
    (_cfg(sampling={"top_p": 1.5}), "sampling.top_p", "less than or equal to 1"),
    (_cfg(lerning_rate=1e-3), "lerning_rate", "Extra inputs are not permitted"),
    ({k: v for k, v in BASE.items() if k != "dataset"}, "dataset", "Field required"),
])
def test_bad_values_name_the_field(data, field, reason):
    msg = _error(data)
    assert field in msg and reason in msg, msg


@pytest.mark.parametrize("data, reason", [
    (_cfg(samples_per_task=1), "needs samples_per_task >= 2"),
    (_cfg(engine={"type": "openai"}), "engine.base_url"),
    (_cfg(max_in_flight=2), "max_in_flight (2) must be >= samples_per_task (4)"),
    (_cfg(max_trajectory_tokens=10, max_prompt_tokens=100), "max_trajectory_tokens must be >= max_prompt_tokens"),
    (_cfg(max_context_tokens=600, max_prompt_tokens=100, max_response_tokens=512),
     "max_context_tokens (600) must be >= max_prompt_tokens + max_response_tokens (100 + 512)"),
    (_cfg(max_context_tokens=4096, engine={"type": "vllm", "max_model_len": 2048}),
     "max_context_tokens (4096) is above engine.max_model_len (2048)"),
    (_cfg(algorithm={"mask_termination": ["context_exceded"]}),
     "unknown termination reason(s) 'context_exceded'; choose from env_done, max_steps"),
])
def test_cross_field_checks_say_how_to_fix(data, reason):
    assert reason in _error(data)


def test_context_window_and_masked_terminations():
    cfg = RunConfig.model_validate(BASE)
    assert cfg.algorithm.mask_termination == ["context_exceeded"] and cfg.context_room(10_000) is None
    assert RunConfig.model_validate(_cfg(max_context_tokens=2000)).context_room(1500) == 500
    vllm = RunConfig.model_validate(_cfg(engine={"type": "vllm", "max_model_len": 2048}))
    assert vllm.context_room(2048) == 0  # vLLM's window is the limit when max_context_tokens is unset
    assert RunConfig.model_validate(_cfg(algorithm={"mask_termination": []})).algorithm.mask_termination == []


def test_single_sample_allowed_for_eval_and_non_group_estimators():
    # training with the default group estimator (grpo) needs a group; evaluation and reinforce++ do not
    assert "needs samples_per_task >= 2" in _error(_cfg(samples_per_task=1))
    evaluation = RunConfig.model_validate(_cfg(samples_per_task=1, kind="eval"))
    assert (evaluation.kind, evaluation.samples_per_task, evaluation.algorithm.adv_estimator) == ("eval", 1, "grpo")
    single = RunConfig.model_validate(_cfg(samples_per_task=1, algorithm={"adv_estimator": "reinforce_plus_plus"}))
    assert (single.kind, single.samples_per_task, single.algorithm.adv_estimator) == (
        "train", 1, "reinforce_plus_plus")


def test_settings_from_environment(monkeypatch):
    monkeypatch.setenv("DATABASE_URL", "postgres://u@h:5432/db")
    monkeypatch.setenv("REDIS_URL", "redis://h:6380/2")
    s = ServiceSettings()
    assert s.database_url == "postgresql+psycopg://u@h:5432/db"
    assert s.redis_url == "redis://h:6380/2"
    monkeypatch.setenv("LOG_FORMAT", "xml")
    with pytest.raises(ValidationError, match="LOG_FORMAT must be json, text or auto"):
        ServiceSettings()


def test_sandbox_is_explicit_for_envs_that_run_model_code_and_checked_for_all():
    base = {"name": "r", "kind": "eval", "model": "m", "dataset": "d", "agent": {"name": "math"}}
    code = RunConfig(**base, env={"name": "code"})
    assert code.env.args["sandbox"] == "namespaces" and code.sandbox == "namespaces"  # a row cannot override it
    assert RunConfig(**base, env={"name": "math"}).sandbox is None
    assert RunConfig(**base, env={"name": "code", "args": {"sandbox": "none"}}).sandbox == "none"
    with pytest.raises(ValueError, match="env.args.sandbox: unknown sandbox mode 'off'"):
        RunConfig(**base, env={"name": "code", "args": {"sandbox": "off"}})
    with pytest.raises(ValueError, match="env.args.image: sandbox 'container'"):
        RunConfig(**base, env={"name": "code", "args": {"sandbox": "container"}})
    image = {"sandbox": "container", "image": "localhost/flywheel-sandbox-python:local"}
    assert RunConfig(**base, env={"name": "code", "args": image}).sandbox == "container"
