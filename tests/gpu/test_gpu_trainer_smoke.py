"""verl training step on CUDA through the trainer's PolicyEngine (bench/gpu_smoke.py, a smaller model)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
REPO = Path(__file__).resolve().parents[2]


def test_gpu_smoke_trains_one_step_in_bf16():
    out = subprocess.run([sys.executable, "-m", "bench.gpu_smoke", "--layers", "2", "--hidden", "256",
                          "--intermediate", "512", "--heads", "4", "--kv-heads", "2", "--vocab", "1024",
                          "--batch", "8", "--seq", "256", "--steps", "2"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["tokens_per_s"] > 0 and result["grad_norm"] > 0
