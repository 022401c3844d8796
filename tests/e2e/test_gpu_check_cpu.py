"""`python -m bench.gpu_check --device cpu`: the GPU check's code on tiny shapes, so that a lent GPU's minutes are
never spent on a bug in it. Real services (the local stack on this module's Redis and Postgres), real verl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


@pytest.fixture(scope="module")
def result(isolated_urls, tmp_path_factory) -> dict:
    redis_url, database_url = isolated_urls
    out = tmp_path_factory.mktemp("gpu-check") / "gpu_check.json"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--out", str(out)], cwd=REPO,
                          env={**os.environ, "REDIS_URL": redis_url, "DATABASE_URL": database_url},
                          capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_every_part_ran_and_the_chunked_log_probs_equal_the_eager_ones(result):
    assert result["passed"] and not result["failures"]
    assert {"logprob", "lora", "stack"} <= set(result)
    torch_check = result["logprob"]["checks"]["torch"]
    assert torch_check["equal_to_eager"] and torch_check["max_abs_diff"] < 1e-4
    assert "skipped" in result["logprob"]["checks"]["chunked_triton"]  # CUDA only here; its own test checks it on CPU
    ran = [v for v in result["logprob"]["variants"] if "full" in v]
    assert {v["variant"] for v in ran} == {"padded_mb16"}  # the others use Triton kernels: CUDA only here
    assert all(v["full"]["tokens_per_s"] > 0 and v["full"]["grad_norm"] > 0 for v in ran)
    assert result["best_mfu"] is not None


def test_a_lora_step_and_the_hf_engine_serving_its_next_adapter_version(result):
    lora = result["lora"]
    assert lora["trainable_params"] > 0 and lora["step"]["grad_norm"] > 0
    assert lora["served_version"] == 2 and lora["adapter_swap_same_shape_s"] > 0
    assert lora["generate_64x_tokens_per_s"] > 0


def test_the_services_train_and_serve_each_published_version(result):
    stack = result["stack"]
    assert stack["recall"]["versions_hot_reloaded"] >= 1
    big = stack["big"]
    assert big["status"] in ("completed", "stopped") and big["policy_version"] >= 2, big
    assert big["rollout_tokens"] > 0 and big["trainer_tokens_per_s"] > 0
    versions = big["versions"]
    assert [v["version"] for v in versions][:2] == [1, 2]
    # every version was seen served by the rollout worker; after the first full one, a delta is smaller
    assert all(v["publish_to_serving_s"] is not None for v in versions)
    assert versions[1]["bytes"] < versions[0]["bytes"]
