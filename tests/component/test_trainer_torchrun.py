"""Data-parallel training under torchrun (2 CPU ranks, gloo): rank 0 drives, rank 1 follows, and one update
on the split batch gives the same weights as one update of a single process on the whole batch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from infra.local.ports import free_port
from tests.support.tiny_model import build_number_model

REPO = Path(__file__).resolve().parents[2]
SCRIPT = r'''
import sys, torch, numpy as np
from pathlib import Path
from services.trainer.engine import PolicyEngine, setup_distributed
from services.trainer.algorithm import compute_advantages
from shared.contracts.run_config import AlgorithmConfig

model_dir, out, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
setup_distributed("cpu")
import torch.distributed as dist
from services.trainer import ranks
algo = AlgorithmConfig(adv_estimator="grpo", lr=1e-2)
if mode == "dp" and dist.get_rank() > 0:
    ranks.follow()
    dist.destroy_process_group()
    sys.exit(0)
g = torch.Generator().manual_seed(0)
prompts, responses = torch.randint(4, 64, (8, 4), generator=g), torch.randint(4, 64, (8, 3), generator=g)
attention = torch.ones(8, 7, dtype=torch.long)
rewards = torch.zeros(8, 3)
rewards[:, 2] = torch.tensor([1.0, 0, 1, 0, 0, 1, 1, 1])
t = {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
     "attention_mask": attention, "position_ids": attention.cumsum(-1) - 1, "response_mask": attention[:, 4:],
     "token_level_rewards": rewards, "uid": np.array(["a"] * 4 + ["b"] * 4, dtype=object)}
kwargs = dict(micro_batch_size=4, group_size=4)
engine = ranks.ShardedEngine("run", model_dir, algo, **kwargs) if mode == "dp" else PolicyEngine(model_dir, algo, **kwargs)
old, _ = engine.log_probs(t)
torch.save(old, out / "old.pt")
adv, _ = compute_advantages(algo, t)
engine.update(t, old, adv, torch.ones_like(old))
engine.export_hf(out / "hf")
if mode == "dp":
    ranks.stop_followers()
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_two_rank_data_parallel_update_equals_single_process(tmp_path):
    model_dir = build_number_model(tmp_path / "m")
    script = tmp_path / "dp.py"
    script.write_text(SCRIPT)
    for mode in ("single", "dp"):
        (tmp_path / mode).mkdir()
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                    f"--master_port={free_port()}"] \
            if mode == "dp" else [sys.executable]
        code, output = _run_group([*launcher, str(script), str(model_dir), str(tmp_path / mode), mode], 240)
        assert code == 0, output[-6000:]
    torch.testing.assert_close(torch.load(tmp_path / "dp" / "old.pt"), torch.load(tmp_path / "single" / "old.pt"))
    single = load_file(tmp_path / "single" / "hf" / "model.safetensors")
    dp = load_file(tmp_path / "dp" / "hf" / "model.safetensors")
    original = load_file(model_dir / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(single[name], original[name])
    for key in single:
        torch.testing.assert_close(dp[key], single[key], atol=1e-5, rtol=1e-4)


def _run_group(args: list[str], timeout_s: float) -> tuple[int, str]:
    """Run in its own process group and kill the whole group on timeout: torchrun's ranks are its children,
    and killing only the launcher would leave them running."""
    proc = subprocess.Popen(args, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return -9, f"timed out after {timeout_s}s\n{out}"
    return proc.returncode, out


def _env() -> dict:
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(REPO)
    return env
