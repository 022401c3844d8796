"""Agent-gateway overhead: a model call through the gateway (openai SDK -> HTTP -> token bookkeeping -> engine)
against the same engine called directly, per call: added latency (p50, p99) and added CPU.

    python -m bench.gateway_overhead [--calls 200] [--hf-calls 30]

Two engines: `instant` (returns fixed ids at once: the gateway's own cost, unmasked by generation time) and
`hf` (the tiny model, 8 new tokens: the overhead in proportion to a real, if tiny, generation). Client and
gateway share one process and event loop, so the CPU figure covers both sides of the HTTP call. Writes the
`overhead` section of bench/results/agent_program.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

RESULTS = Path(__file__).resolve().parent / "results" / "agent_program.json"
MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 12 + 30?"}]


class InstantEngine:
    version = 0

    def __init__(self, eos: int):
        self.eos = eos

    async def generate(self, prompt_ids, sampling, max_tokens):
        from services.rollout_worker.engines.base import Generation

        return Generation([17, 18, 19, self.eos], [-0.1] * 4, "abc", "stop", 0)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def measure(engine, tokenizer, calls: int) -> dict:
    import openai

    from services.rollout_worker.assembly import ChatTokenizer
    from services.rollout_worker.engines.base import SamplingParams
    from services.rollout_worker.gateway import Gateway
    from shared.contracts.run_config import RunConfig

    chat = ChatTokenizer(tokenizer)
    cfg = RunConfig.model_validate(dict(name="bench", kind="eval", model="m", dataset="d", max_response_tokens=8,
                                        agent_program={"name": "external"}))
    ctx = SimpleNamespace(config=cfg, chat=chat, engine=engine, sampling=lambda greedy: SamplingParams(0.0))
    gateway = Gateway("127.0.0.1", 0)
    await gateway.start()
    prompt = chat.encode(chat.render(MESSAGES, add_generation_prompt=True))
    direct, direct_cpu, via, via_cpu = [], [], [], []
    try:
        for _ in range(3):  # warm-up (model, connections)
            await engine.generate(prompt, SamplingParams(0.0), 8)
        for _ in range(calls):
            c0, t0 = time.process_time(), time.perf_counter()
            await engine.generate(prompt, SamplingParams(0.0), 8)
            direct.append(time.perf_counter() - t0)
            direct_cpu.append(time.process_time() - c0)
        session = gateway.open(ctx, True, time.monotonic() + 3600)
        client = openai.AsyncOpenAI(base_url=gateway.base_url(session), api_key="x", max_retries=0)
        await client.chat.completions.create(model="agent", messages=MESSAGES)
        for _ in range(calls):  # a fresh conversation each call, like the first call of an episode
            c0, t0 = time.process_time(), time.perf_counter()
            await client.chat.completions.create(model="agent", messages=MESSAGES)
            via.append(time.perf_counter() - t0)
            via_cpu.append(time.process_time() - c0)
        await client.close()
    finally:
        await gateway.close()
    ms = 1000.0
    return {
        "calls": calls,
        "direct_p50_ms": round(pct(direct, 0.5) * ms, 3), "direct_p99_ms": round(pct(direct, 0.99) * ms, 3),
        "gateway_p50_ms": round(pct(via, 0.5) * ms, 3), "gateway_p99_ms": round(pct(via, 0.99) * ms, 3),
        "added_p50_ms": round((pct(via, 0.5) - pct(direct, 0.5)) * ms, 3),
        "added_p99_ms": round((pct(via, 0.99) - pct(direct, 0.99)) * ms, 3),
        "direct_cpu_ms_per_call": round(statistics.mean(direct_cpu) * ms, 3),
        "gateway_cpu_ms_per_call": round(statistics.mean(via_cpu) * ms, 3),
        "added_cpu_ms_per_call": round((statistics.mean(via_cpu) - statistics.mean(direct_cpu)) * ms, 3),
    }


async def main(calls: int, hf_calls: int) -> dict:
    from transformers import AutoTokenizer

    from services.rollout_worker.engines import build_engine
    from shared.contracts.run_config import EngineConfig
    from tests.support.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(Path(tmp) / "model")
        tokenizer = AutoTokenizer.from_pretrained(path)
        out = {"instant": await measure(InstantEngine(tokenizer.eos_token_id), tokenizer, calls)}
        if hf_calls:
            hf = build_engine("hf", str(path), EngineConfig(), tokenizer, batch_wait_ms=0.0)
            out["hf"] = await measure(hf, tokenizer, hf_calls)
            await hf.close()
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--hf-calls", type=int, default=30)
    args = parser.parse_args()
    overhead = asyncio.run(main(args.calls, args.hf_calls))
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results["overhead"] = overhead
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(overhead, indent=1))
