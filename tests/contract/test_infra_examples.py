"""Every checked-in run config under examples/ validates, so users start from configs that work.

    pytest -q tests/contract/test_infra_examples.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from shared.contracts.registry import REGISTRIES
from shared.contracts.run_config import RunConfig

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def test_there_are_examples():
    names = {p.name for p in EXAMPLES}
    assert {"eval_math_hf.yaml", "train_countdown_grpo.yaml", "train_frozenlake_ppo.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_validates(path: Path):
    config = RunConfig.model_validate(yaml.safe_load(path.read_text()))
    for kind in ("agent", "env"):  # built-in names, so the examples run on any install
        assert getattr(config, kind).name in REGISTRIES[kind], f"{path.name}: {kind} is not a registered name"
    assert config.model.startswith(".data/models/"), f"{path.name}: keep the model path a local placeholder"
