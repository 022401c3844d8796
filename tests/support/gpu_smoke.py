"""GPU smoke and tuning: `make gpu-smoke` (python -m tests.support.gpu_smoke [--variants a,b] [--layers 24 ...]).

verl FSDP2 training steps (the trainer's PolicyEngine: forward, PPO loss, backward, optimizer step) on a
random-init Qwen2-shaped model of ~0.5B parameters (Qwen2.5-0.5B's shape) in bf16, on CUDA, one engine per
variant (micro-batching, padding removal, attention kernel, fused log-prob backend, LoRA), each timed on two
batches of the same size (16 x 1024 by default):
- `full`: every sequence the full length (no padding anywhere: the pure kernel speed);
- `rl`: response lengths spread as RL rollouts do (mean ~30% of the maximum, tests/support/trainer_batches.py's
  `spread_batch` of tests/support/trainer_batches.py), where padding removal pays.
First, with `--diff`, the weight-delta diff of two versions of the model on the GPU vs the CPU kernel.
Self-contained: no Redis, Postgres or downloads. Prints one JSON object per variant as it finishes and the whole
result last (also written to `--out`); tokens/s counts real tokens; MFU is verl's FlopsCounter estimate against
the GPU's peak bf16 FLOPS. Exits 2 without CUDA. For several GPUs: `torchrun --nproc_per_node=N -m tests.support.gpu_smoke`.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

# name -> PolicyEngine options. The first is the trainer's GPU default; the rest are what was tried.
VARIANTS: dict[str, dict] = {
    "padded_mb4": {"micro_batch_size": 4},
    "padded_mb16": {"micro_batch_size": 16},
    "packed_16k": {"micro_batch_size": 16, "remove_padding": True, "micro_batch_tokens": 16384},
    "packed_4k": {"micro_batch_size": 16, "remove_padding": True, "micro_batch_tokens": 4096},
    "padded_mb16_triton": {"micro_batch_size": 16, "fused_backend": "triton"},
    "padded_mb16_keep_gathered": {"micro_batch_size": 16, "engine_options": {"reshard_after_forward": False}},
    "packed_16k_flex": {"micro_batch_size": 16, "remove_padding": True, "micro_batch_tokens": 16384,
                        "attn_implementation": "flex_attention"},
    "padded_mb16_compiled": {"micro_batch_size": 16, "compile_layers": True},
    "packed_16k_flex_compiled": {"micro_batch_size": 16, "remove_padding": True, "micro_batch_tokens": 16384,
                                 "attn_implementation": "flex_attention", "compile_layers": True},
    "lora_r32_mb16": {"micro_batch_size": 16,
                      "lora": {"lora_rank": 32, "lora_alpha": 64, "target_modules": "all-linear"}},
    # the vocabulary math of verl's chunked kernel in Triton over bf16 logits (services/trainer/logprob_kernel.py),
    # then also liger-kernel's fused RMSNorm, SwiGLU and RoPE (verl's use_liger)
    "padded_mb16_chunked_triton": {"micro_batch_size": 16, "fused_backend": "chunked_triton"},
    "padded_mb16_chunked_triton_liger": {"micro_batch_size": 16, "fused_backend": "chunked_triton", "use_liger": True},
    "packed_16k_flex_chunked_triton_liger": {"micro_batch_size": 16, "remove_padding": True,
                                             "micro_batch_tokens": 16384, "attn_implementation": "flex_attention",
                                             "fused_backend": "chunked_triton", "use_liger": True},
    "padded_mb16_liger": {"micro_batch_size": 16, "fused_backend": "liger"},
}


def build_model(folder: Path, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int,
                vocab: int, device: str = "cuda") -> Path:
    import shutil

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.support.tiny_model import build_number_model

    tiny = build_number_model(folder.parent / "tokenizer")  # a small local tokenizer; only its files are used
    folder.mkdir(parents=True, exist_ok=True)
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copyfile(f, folder / f.name)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=32768, tie_word_embeddings=True, torch_dtype="bfloat16")
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def batch(size: int, seq: int, vocab: int) -> dict:
    """`size` sequences of exactly `seq` tokens (a quarter prompt), no padding."""
    import numpy as np
    import torch

    prompt = seq // 4
    ids = torch.randint(0, vocab, (size, seq))
    attention = torch.ones(size, seq, dtype=torch.long)
    return {"prompts": ids[:, :prompt], "responses": ids[:, prompt:], "input_ids": ids, "attention_mask": attention,
            "position_ids": attention.cumsum(-1) - 1, "response_mask": attention[:, prompt:],
            "token_level_rewards": torch.zeros(size, seq - prompt),
            "uid": np.array([str(i // 4) for i in range(size)], dtype=object)}


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_steps(engine, t: dict, steps: int) -> dict:
    import torch

    old, _ = engine.log_probs(t)
    adv = torch.randn_like(old)
    weights = torch.ones_like(old)
    engine.update(t, old, adv, weights)  # warm-up
    _sync()
    times, mfu = [], []
    for _ in range(steps):
        start = time.perf_counter()
        metrics = engine.update(t, old, adv, weights)
        _sync()
        times.append(time.perf_counter() - start)
        mfu.append(metrics.get("mfu", 0.0))
    step_s = sorted(times)[len(times) // 2]
    tokens = int(t["attention_mask"].sum())
    return {"step_s": round(step_s, 4), "tokens_per_s": round(tokens / step_s), "mfu": sorted(mfu)[len(mfu) // 2],
            "real_tokens": tokens, "loss": metrics.get("loss"), "grad_norm": metrics.get("grad_norm")}


def profile_step(engine, t: dict, top: int = 12) -> dict:
    """One update under torch.profiler: the step's wall time, how much of it the GPU spent in kernels, and the
    ops that took the most GPU and CPU time (where a step that is not compute-bound loses its time)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    old, _ = engine.log_probs(t)
    adv, weights = torch.randn_like(old), torch.ones_like(old)
    engine.update(t, old, adv, weights)
    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        engine.update(t, old, adv, weights)
        _sync()
        wall = time.perf_counter() - start
    # verl's record_function ranges (mini_batch0, micro_batch0) show on the GPU too: kernels only
    events = [e for e in prof.key_averages() if not getattr(e, "is_user_annotation", False)
              and not e.key.startswith(("mini_batch", "micro_batch"))]
    kernels_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")

    def rows(key: str) -> list:
        ranked = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:top]
        return [[e.key[:80], e.count, round(getattr(e, key) / 1e3, 2)] for e in ranked]

    return {"wall_s": round(wall, 4), "gpu_kernel_s": round(kernels_us / 1e6, 4),
            "gpu_busy_fraction": round(kernels_us / 1e6 / wall, 3),
            "top_gpu_ms": rows("self_device_time_total"), "top_cpu_ms": rows("self_cpu_time_total")}


def run_variant(name: str, options: dict, model_dir: Path, batches: dict, steps: int, device: str = "cuda",
                profile: bool = False) -> dict:
    import torch

    from services.trainer.engine import PolicyEngine
    from shared.contracts.run_config import AlgorithmConfig

    cuda = device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    engine = PolicyEngine(str(model_dir), AlgorithmConfig(lr=1e-6), device=device, dtype="bf16" if cuda else "fp32",
                          group_size=4, **options)
    out = {"variant": name, "options": options, "build_s": round(time.perf_counter() - start, 1),
           "trainable_params": sum(p.numel() for p in engine.actor.engine.module.parameters() if p.requires_grad)}
    for label, t in batches.items():
        out[label] = time_steps(engine, t, steps)
    if profile:
        out["profile_full"] = profile_step(engine, batches["full"])
    del engine
    gc.collect()
    if cuda:
        out["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        torch.cuda.empty_cache()
    return out


def diff_on_gpu_vs_cpu(model_dir: Path, changed: float = 0.05, repeats: int = 3) -> dict:
    """The publisher's diff of two bf16 versions of the model (`changed` of the elements moved): shared.weights.delta'
    CPU path (numba kernel over the host copies, threads) vs `changes_on_device` next to the weights on the GPU
    (changes copied to the host); both give the same bits."""
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from shared.weights.delta import delta_parts
    from shared.weights.kernels import changes_on_device

    base = {k: v.cuda() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    g = torch.Generator(device="cuda").manual_seed(0)
    new = {}
    for k, v in base.items():
        moved = torch.rand(v.shape, generator=g, device="cuda") < changed
        new[k] = torch.where(moved, v + torch.finfo(torch.bfloat16).eps * v.abs().clamp(min=1e-3), v)
    torch.cuda.synchronize()
    gpu_s, cpu_s = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        on_gpu = {k: changes_on_device(base[k], new[k]) for k in new}
        torch.cuda.synchronize()
        gpu_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        host_base = {k: v.cpu() for k, v in base.items()}
        host_new = {k: v.cpu() for k, v in new.items()}
        on_cpu = delta_parts(host_base, host_new)
        cpu_s.append(time.perf_counter() - start)
    same = all(np.array_equal(on_gpu[k][0], on_cpu[f"idx/{k}"]) and np.array_equal(on_gpu[k][1], on_cpu[f"val/{k}"])
               for k in new if on_gpu[k] is not None and f"idx/{k}" in on_cpu)
    n_bytes = sum(v.numel() * 2 for v in new.values())
    return {"diff_bytes": n_bytes, "changed_fraction": changed, "diff_gpu_s": sorted(gpu_s)[repeats // 2],
            "diff_cpu_s": sorted(cpu_s)[repeats // 2], "diff_cpu_includes": "device-to-host copy of both versions",
            "diff_same_bits": same}


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
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}")
    parser.add_argument("--profile", default="", help="comma-separated variants to profile one full-batch step of")
    parser.add_argument("--budget-s", type=float, default=0, help="start no variant after this many seconds")
    parser.add_argument("--diff", action="store_true", help="also time the weight-delta diff, GPU vs CPU")
    parser.add_argument("--out", type=Path, default=None, help="also write the result here (JSON)")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 2
    from tests.support.trainer_batches import spread_batch

    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": "bf16",
                    "batch": args.batch, "seq": args.seq, "variants": []}
    with tempfile.TemporaryDirectory(prefix="gpu-smoke-") as tmp:
        model_dir = build_model(Path(tmp) / "model", args.layers, args.hidden, args.heads, args.kv_heads,
                                args.intermediate, args.vocab)
        prompt = args.seq // 4
        batches = {"full": batch(args.batch, args.seq, args.vocab),
                   "rl": spread_batch(args.batch, prompt, args.seq - prompt, args.vocab)}
        if args.diff:  # first: cheap, and no variant's failure can lose it
            try:
                result["diff"] = diff_on_gpu_vs_cpu(model_dir)
            except Exception as exc:
                result["diff"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            print(json.dumps(result["diff"]), flush=True)
            gc.collect()
            torch.cuda.empty_cache()
        started = time.monotonic()
        for name in [v for v in args.variants.split(",") if v]:
            if args.budget_s and time.monotonic() - started > args.budget_s:
                result["variants"].append({"variant": name, "skipped": f"past --budget-s {args.budget_s}"})
                continue
            try:
                out = run_variant(name, VARIANTS[name], model_dir, batches, args.steps,
                                  profile=name in args.profile.split(","))
            except Exception as exc:  # one variant's failure (a kernel missing here) must not lose the others
                out = {"variant": name, "error": f"{type(exc).__name__}: {exc}"[:500]}
                gc.collect()
                torch.cuda.empty_cache()
            result["variants"].append(out)
            print(json.dumps(out), flush=True)
            _write(args.out, result)
    _write(args.out, result)
    print(json.dumps(result))
    return 0


def _write(path: Path | None, result: dict) -> None:
    if path is not None:
        path.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
