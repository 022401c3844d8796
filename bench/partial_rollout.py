"""Partial rollouts against a long tail: how long a new policy version waits to be served, and what the
generations cost, with and without `partial_rollout`.

    make bench-partial    # python -m bench.partial_rollout [--seconds 40 --slots 16 --every 2.0]

One in-process HF engine (a tiny random Qwen2 on CPU) serves `--slots` generations at a time, each
`max_tokens` drawn from a lognormal with mean `--mean-tokens` cut at 8x the mean (the long tail), the model
never stopping early (its EOS is out of reach), while a new version is loaded every `--every` seconds
(alternating two checkpoints). Without partial rollouts a swap waits for the batch in flight, whose longest
generation sets its length; with them it waits for one decode chunk (`--chunk`), and the rest of each
generation continues on the new weights (its text so far re-read by them). Per mode, in
bench/results/partial_rollout.json: publish -> serving wait (mean, p50, p90, max), the time between versions
served, generated tokens/s, how many generations hold tokens of two versions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "partial_rollout.json"


async def run_mode(models: list[Path], args, partial: bool) -> dict:
    from transformers import AutoTokenizer

    from services.rollout_worker.engines import SamplingParams, build_engine
    from shared.contracts.run_config import EngineConfig

    tokenizer = AutoTokenizer.from_pretrained(models[0])
    engine = build_engine("hf", str(models[0]), EngineConfig(max_batch_size=args.slots,
                                                            partial_chunk_tokens=args.chunk), tokenizer,
                          batch_wait_ms=5)
    engine.eos_ids = [-1]  # never stop early: every generation runs to its drawn length
    rng = random.Random(args.seed)
    sigma = args.sigma
    mu = __import__("math").log(args.mean_tokens) - sigma ** 2 / 2
    sampling = SamplingParams(partial=partial)
    stop = asyncio.Event()
    tokens, spanning, generations = 0, 0, 0

    async def slot() -> None:
        nonlocal tokens, spanning, generations
        while not stop.is_set():
            n = max(1, min(int(rng.lognormvariate(mu, sigma)), 8 * args.mean_tokens))
            gen = await engine.generate([5, 6, 7, 8], sampling, n)
            tokens, generations = tokens + len(gen.ids), generations + 1
            spanning += len(set(gen.versions or [])) > 1

    waits, served_at = [], []
    started = time.perf_counter()
    slots = [asyncio.create_task(slot()) for _ in range(args.slots)]
    version = 0
    while time.perf_counter() - started < args.seconds:
        await asyncio.sleep(args.every)
        version += 1
        t0 = time.perf_counter()
        await engine.load_weights(models[version % 2], version)
        waits.append(time.perf_counter() - t0)
        served_at.append(time.perf_counter())
    stop.set()
    await asyncio.gather(*slots)
    wall = time.perf_counter() - started
    await engine.close()
    gaps = [b - a for a, b in zip(served_at, served_at[1:], strict=False)]
    return {
        "partial_rollout": partial, "versions": version, "wall_s": round(wall, 1),
        "publish_to_serving_s": {"mean": round(statistics.mean(waits), 3), "p50": round(statistics.median(waits), 3),
                                 "p90": round(statistics.quantiles(waits, n=10)[8], 3), "max": round(max(waits), 3)},
        "time_per_version_s": round(statistics.mean(gaps), 3) if gaps else None,
        "generated_tokens_per_s": round(tokens / wall),
        "generations": generations, "generations_spanning_two_versions": spanning,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=40, help="per mode")
    ap.add_argument("--slots", type=int, default=16, help="generations in flight")
    ap.add_argument("--every", type=float, default=2.0, help="seconds between two new versions")
    ap.add_argument("--mean-tokens", type=int, default=48)
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal shape of the generation lengths")
    ap.add_argument("--chunk", type=int, default=16, help="partial rollouts: tokens decoded between two swaps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()

    import tempfile

    import torch

    from tests.support.tiny_model import build_tiny_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        models = [build_tiny_model(Path(tmp) / f"v{i}", hidden_size=64, seed=i) for i in range(2)]
        before = os.getloadavg()
        modes = [asyncio.run(run_mode(models, args, partial)) for partial in (False, True)]
    without, with_ = modes
    result = {
        "command": "python -m bench.partial_rollout " + " ".join(sys.argv[1:]),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "modes": modes,
        "publish_to_serving_speedup": round(without["publish_to_serving_s"]["mean"]
                                            / max(with_["publish_to_serving_s"]["mean"], 1e-9), 1),
        "throughput_ratio": round(with_["generated_tokens_per_s"] / max(without["generated_tokens_per_s"], 1), 2),
        "cpu_count": os.cpu_count(), "loadavg_before_after": [round(before[0], 2), round(os.getloadavg()[0], 2)],
        "notes": "One CPU thread, a tiny random model: the seconds are this machine's; the ratios are the point. "
                 "Partial rollouts re-read each generation's text so far under the new weights after a swap (no KV "
                 "cache crosses one), which is what they cost here.",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
