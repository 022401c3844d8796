"""GPU smoke test: `make gpu-smoke` (python -m bench.gpu_smoke [--layers 24 --seq 1024 --batch 16]).

One verl FSDP2 training step (the trainer's PolicyEngine: forward, PPO loss, backward, optimizer step) on a
random-init Qwen2-shaped model of ~0.5B parameters (Qwen2.5-0.5B's shape) in bf16, on CUDA. Self-contained:
no Redis, Postgres or downloads. Prints one JSON object: tokens/s and MFU (verl's FlopsCounter estimate
against the GPU's peak bf16 FLOPS). Exits 2 without CUDA. For several GPUs:
`torchrun --nproc_per_node=N -m bench.gpu_smoke`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def build_model(folder: Path, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int,
                vocab: int) -> Path:
    import shutil

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from harness.tiny_model import build_number_model

    tiny = build_number_model(folder.parent / "tokenizer")  # a small local tokenizer; only its files are used
    folder.mkdir(parents=True, exist_ok=True)
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copyfile(f, folder / f.name)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=32768, tie_word_embeddings=True, torch_dtype="bfloat16")
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def batch(size: int, seq: int, vocab: int) -> dict:
    import numpy as np
    import torch

    prompt = seq // 4
    ids = torch.randint(0, vocab, (size, seq))
    attention = torch.ones(size, seq, dtype=torch.long)
    return {"prompts": ids[:, :prompt], "responses": ids[:, prompt:], "input_ids": ids, "attention_mask": attention,
            "position_ids": attention.cumsum(-1) - 1, "response_mask": attention[:, prompt:],
            "token_level_rewards": torch.zeros(size, seq - prompt),
            "uid": np.array([str(i // 4) for i in range(size)], dtype=object)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=4864)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 2
    from services.trainer.engine import PolicyEngine
    from shared.run_config import AlgorithmConfig

    with tempfile.TemporaryDirectory(prefix="gpu-smoke-") as tmp:
        model_dir = build_model(Path(tmp) / "model", args.layers, args.hidden, args.heads, args.kv_heads,
                                args.intermediate, args.vocab)
        engine = PolicyEngine(str(model_dir), AlgorithmConfig(lr=1e-6), device="cuda", dtype="bf16",
                              micro_batch_size=4, group_size=4)
        t = batch(args.batch, args.seq, args.vocab)
        old, _ = engine.log_probs(t)
        adv = torch.randn_like(old)
        weights = torch.ones_like(old)
        engine.update(t, old, adv, weights)  # warm-up
        torch.cuda.synchronize()
        times, mfu = [], []
        for _ in range(args.steps):
            start = time.perf_counter()
            metrics = engine.update(t, old, adv, weights)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            mfu.append(metrics.get("mfu", 0.0))
        step_s = sorted(times)[len(times) // 2]
        result = {
            "device": torch.cuda.get_device_name(), "params": engine.num_parameters, "dtype": "bf16",
            "batch": args.batch, "seq": args.seq, "step_s": step_s, "tokens_per_s": args.batch * args.seq / step_s,
            "mfu": sorted(mfu)[len(mfu) // 2], "loss": metrics.get("loss"), "grad_norm": metrics.get("grad_norm"),
        }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
