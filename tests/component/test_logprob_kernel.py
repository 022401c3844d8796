"""services/trainer/logprob_kernel.py: the Triton log-prob and entropy kernels equal verl's chunk math (fp32, and
bf16 logits within bf16 rounding), gradients included. Run in Triton's interpreter on CPU (TRITON_INTERPRET=1 must
be set before triton is imported, so in a fresh process); tests/gpu and bench/gpu_check.py run them on CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[2]

CHECK = r"""
import json, torch
from verl.utils.experimental import torch_functional as verl_chunks
reference_fwd, reference_bwd = verl_chunks._fused_linear_for_ppo_fwd, verl_chunks._fused_linear_for_ppo_bwd
from services.trainer import logprob_kernel
logprob_kernel.use(True)
assert verl_chunks._fused_linear_for_ppo_fwd is logprob_kernel._chunk_fwd  # what verl's kernel now calls
torch.manual_seed(0)
rows, hidden, vocab, temperature = 37, 16, 5000, 0.7  # vocab: not a multiple of the kernel's block
h, w = torch.randn(rows, hidden), torch.randn(vocab, hidden) * 0.5
ids = torch.randint(0, vocab, (rows,))
rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())
out = {}
lp, ent = logprob_kernel._chunk_fwd(h, w, ids, temperature)
ref_lp, ref_ent = reference_fwd(h, w, ids, temperature)
out["fwd"] = [rel(lp, ref_lp), rel(ent, ref_ent)]
for name, dl, de in (("both", torch.randn(rows), torch.randn(rows)), ("logprob", torch.randn(rows), None),
                     ("entropy", None, torch.randn(rows))):
    got, want = logprob_kernel._chunk_bwd(dl, de, h, w, ids, temperature), reference_bwd(dl, de, h, w, ids, temperature)
    out[name] = [rel(got[0], want[0]), rel(got[1], want[1])]
# bf16 logits, as on the GPU: against the fp32 reference of the same (rounded) inputs
hb, wb = h.bfloat16(), w.bfloat16()
lp_b, ent_b = logprob_kernel._chunk_fwd(hb, wb, ids, temperature)
ref_lp_b, ref_ent_b = reference_fwd(hb.float(), wb.float(), ids, temperature)
out["bf16_fwd"] = [rel(lp_b, ref_lp_b), rel(ent_b, ref_ent_b)]
got = logprob_kernel._chunk_bwd(torch.randn(rows), None, hb, wb, ids, temperature)
out["bf16_dtype"] = str(got[0].dtype)
logprob_kernel.use(False)
out["off"] = verl_chunks._fused_linear_for_ppo_fwd(h, w, ids, temperature)[0].equal(ref_lp)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def errors() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", CHECK], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_log_probs_and_entropy_equal_verls_chunk_math(errors):
    assert max(errors["fwd"]) < 1e-5, errors


@pytest.mark.parametrize("upstream", ["both", "logprob", "entropy"])
def test_gradients_equal_verls_for_each_upstream_gradient(errors, upstream):
    assert max(errors[upstream]) < 1e-5, errors


def test_bf16_logits_stay_within_bf16_rounding_and_gradients_keep_the_dtype(errors):
    assert max(errors["bf16_fwd"]) < 1e-2, errors
    assert errors["bf16_dtype"] == "torch.bfloat16"


def test_switched_off_verls_own_functions_serve_again(errors):
    assert errors["off"] is True
