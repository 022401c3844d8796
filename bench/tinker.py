"""`make bench-tinker` -> bench/results/tinker.json: the Tinker API through the real `tinker` SDK on the local stack
(weight server, rollout worker, trainer, controller, API), on bench/train.py's 114M-parameter tiny Qwen2.

1. training: N tenants (1, then 4), each a rank-8 LoRA training client with its own key, run `forward_backward`
   (cross_entropy) + `optim_step` on small batches (4 datums x 128 tokens) in a loop, all at once: per-step
   latency (median) and training tokens/s summed over tenants -> `aggregate_tokens_per_s_4_vs_1`. Beside it, one
   tenant with a 4x batch (16 datums): what one pass over the 4 tenants' batches would cost if tenants were
   batched together -> `one_pass_4x_batch_tokens_per_s`.
2. sampling: N tenants' samplers (their saved weights) draw 8 samples x 32 tokens each, all at once: sampled
   tokens/s summed over tenants.
The machine's load average is recorded before and after; figures are medians over the timed steps.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import tempfile
import threading
import time
from pathlib import Path

RESULTS = Path("bench/results/tinker.json")
HIDDEN, LAYERS, RANK = 1024, 12, 8
DATUMS, TOKENS, STEPS, WARMUP = 4, 128, 6, 2


def datums(seed: int, n: int):
    from tinker import types

    out = []
    for i in range(n):
        seq = [(seed * 7919 + i * 131 + j * 17) % 500 + 3 for j in range(TOKENS + 1)]
        out.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                               loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * TOKENS}))
    return out


def train_steps(client, batch, steps: int) -> list[float]:
    from tinker import types

    times = []
    for _ in range(steps):
        started = time.monotonic()
        client.forward_backward(batch, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        times.append(time.monotonic() - started)
    return times


def at_once(fn, args: list[tuple]) -> tuple[list, float]:
    """fn(*a) for every a in args on threads of its own, started together; results and the wall time."""
    results: list = [None] * len(args)

    def run(i: int) -> None:
        results[i] = fn(*args[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(args))]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.monotonic() - started


def training(clients: list, batch_datums: int = DATUMS) -> dict:
    batches = [datums(i, batch_datums) for i in range(len(clients))]
    at_once(train_steps, [(c, b, WARMUP) for c, b in zip(clients, batches, strict=True)])
    times, wall = at_once(train_steps, [(c, b, STEPS) for c, b in zip(clients, batches, strict=True)])
    tokens = len(clients) * STEPS * batch_datums * TOKENS
    return {"tenants": len(clients), "datums_per_step": batch_datums, "tokens_per_datum": TOKENS,
            "step_s_median": round(statistics.median(t for ts in times for t in ts), 3),
            "tokens_per_s": round(tokens / wall, 1)}


def sampling(samplers: list) -> dict:
    from tinker import types

    prompt = types.ModelInput.from_ints(list(range(3, 35)))
    params = types.SamplingParams(max_tokens=32, temperature=1.0)

    def draw(sampler, rounds: int) -> int:
        return sum(sum(len(s.tokens) for s in sampler.sample(prompt, 8, params).result().sequences)
                   for _ in range(rounds))

    at_once(draw, [(s, 1) for s in samplers])
    counts, wall = at_once(draw, [(s, 3) for s in samplers])
    return {"tenants": len(samplers), "samples_per_request": 8, "max_tokens": 32,
            "tokens_per_s": round(sum(counts) / wall, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a smoke-sized model (256 x 2) instead of 114M")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")  # the SDK's telemetry batches are requests the figures would count
    import httpx
    import tinker

    from bench.train import build_model
    from infra.local.ports import free_port
    from infra.local.stack import LocalStack

    hidden, layers = (256, 2) if args.small else (HIDDEN, LAYERS)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-tinker-") as tmp:
        data_dir = Path(tmp)
        build_model(data_dir / "models" / "base", hidden=hidden, layers=layers)
        token = secrets.token_hex(16)
        with LocalStack(data_dir=data_dir, env={"API_TOKEN": token, "API_PORT": str(free_port())}) as stack:
            stack.start(services=["weight-server", "rollout-worker", "trainer", "controller", "api"])
            stack.wait_healthy(300)
            admin = httpx.Client(base_url=stack.api_url, headers={"Authorization": f"Bearer {token}"}, timeout=60)
            keys = ["tml-" + admin.post("/v1/tokens", json={"name": f"tenant-{i}", "scopes": ["read", "write"]}
                                        ).json()["token"] for i in range(4)]
            services = [tinker.ServiceClient(base_url=stack.api_url, api_key=k) for k in keys]
            clients = [s.create_lora_training_client(base_model="base", rank=RANK).result() for s in services]
            one = training(clients[:1])
            four = training(clients)
            fused = training(clients[:1], batch_datums=4 * DATUMS)
            samplers = [c.save_weights_and_get_sampling_client().result() for c in clients]
            sample_one = sampling(samplers[:1])
            sample_four = sampling(samplers)
            for s in services:
                s.close("success").result()
    ratio, fused_ratio = four["tokens_per_s"] / one["tokens_per_s"], fused["tokens_per_s"] / one["tokens_per_s"]
    result = {
        "model": f"tiny Qwen2 {hidden} x {layers}" + ("" if args.small else " (114M params)"), "lora_rank": RANK,
        "device": "cpu", "train_1": one, "train_4": four, "train_1_with_4x_batch": fused,
        "aggregate_tokens_per_s_4_vs_1": round(ratio, 2),
        "one_pass_4x_batch_tokens_per_s": fused["tokens_per_s"],
        "one_pass_4x_batch_vs_1": round(fused_ratio, 2),
        # the target is 4 tenants >= 1.5x one tenant's tokens/s; under it, the measured reason
        "reason": None if ratio >= 1.5 else (
            f"one pass over 4 tenants' rows (one tenant, a 4x batch) gives {fused_ratio:.2f}x one tenant's tokens/s "
            "here: the step is compute-bound at this batch, so no batching of tenants into one pass can reach 1.5x "
            "on this machine" if fused_ratio < 1.5 else
            "the trainer applies one model's operation at a time (its adapter, Adam state and gradients swapped in; "
            f"verl/PEFT train one adapter per pass): one pass over the 4 tenants' rows would give {fused_ratio:.2f}x"),
        "sample_1": sample_one, "sample_4": sample_four,
        "sample_aggregate_4_vs_1": round(sample_four["tokens_per_s"] / sample_one["tokens_per_s"], 2),
        "loadavg_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "cpus": os.cpu_count(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
