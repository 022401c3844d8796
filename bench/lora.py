"""`make bench-lora` -> bench/results/lora.json: what a LoRA run costs a rollout worker next to a full-weight run,
on a base whose weights dominate a process's memory (bench/train.py's 114M-parameter tiny Qwen2, bf16 engine).

1. sync: a real weight server (local stack); the rollout worker's reload path (RunRegistry + HF engine) in this
   process. A LoRA run's versions (rank 8 adapter on every linear layer, PEFT layout) and a full-weight run's
   versions (full snapshots) of the same model, each timed from the publisher's call until the worker serves it:
   `adapter_sync_s` vs `weight_sync_full_s`, `adapter_bytes` vs `full_bytes`.
2. memory and throughput, each configuration in a fresh process: the HF engine(s) a worker holds for one LoRA run,
   for N LoRA runs (one base, N adapters) and for N full-weight runs (N models): resident MB after loading and
   after generating. Generation throughput (one-token answers, 4 x 32 requests per round, as the demo's batches)
   with every request from one run vs spread over N runs' adapters in the same batches, 12 rounds of each
   alternated, in three processes (the same code varies ~10% from one process to the next): medians.

3. runs (`--part runs`, merged into the file's other results): N LoRA runs learning at once on the demo's stack
   (tests/support/demo.py: one rollout worker serving every run's adapter on one base, one trainer, the controller
   sharing rollout capacity), run k answering (digit + k) mod 10 (RecallEnv's `offset`), so an adapter served to
   the wrong run scores near 0: `final_reward` per run, trajectories per second over all runs, wall time, and
   the same for one run alone just before (`traj_per_s_one_run`).
4. trainer (`--part trainer`, also in the full bench), each configuration in a fresh process: the verl engines a
   trainer holds (services/trainer/lora_shared_engine.py) for one LoRA run, for N LoRA runs of one kind (one base,
   N adapters + optimizers) and for N full-weight runs, each run taking two real PPO updates: private resident
   MB (`trainer_private_mb_*`: resident less file-backed pages), engines held, and the median update time.
5. lag (`--part lag --variant NAME JSON --stacks S`): S stacks of part 3 one after another under the demo's LoRA
   config (its 100 versions unless --steps) with JSON's run-config overrides, stack j's runs seeded j (one seed a stack: its runs share the
   trainer's engine) and answering offsets 4j, 4j+1, ... mod 10: per run the final reward, each question's
   accuracy over its last versions and whether every question reached the demo's bar for a question
   (`question_accuracy_min`), a lagging question's accuracy at every version; -> `lag[NAME]`. `--part base`: the
   LoRA base's odds at version 0 and the accuracy an adapter can reach at most, per temperature -> `lag["base"]`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

RESULTS = Path("bench/results/lora.json")
HIDDEN, LAYERS, RANK, N_RUNS, VERSIONS = 1024, 12, 8, 4, 9


def log(msg: str) -> None:
    print(msg, flush=True)


def save(parts: dict) -> None:
    """Write `parts` into the results file, keeping the parts this call did not measure (`runs` and `trainer`
    have targets of their own)."""
    result = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result | parts, indent=1))


def insert_run(database_url: str, model: Path, lora: bool) -> str:
    from sqlalchemy import create_engine, text

    from tests.support.demo import LORA, demo_config

    config = demo_config(model, steps=3, tasks=1, n=2, lr=5e-6, max_staleness=0, lora=LORA if lora else None)
    config["engine"] |= {"dtype": "bfloat16", "weights_dtype": "bfloat16"}
    run_id = str(uuid.uuid4())
    with create_engine(database_url).begin() as c:
        c.execute(text("INSERT INTO runs (id, name, kind, status, config, policy_version, summary) "
                       "VALUES (:id, 'bench-lora', 'train', 'running', CAST(:cfg AS jsonb), 0, '{}')"),
                  {"id": run_id, "cfg": json.dumps(config | {"schema_version": 1})})
    return run_id


async def sync(work: Path, model: Path, redis_url: str, database_url: str) -> dict:
    import redis
    from safetensors.torch import load_file, save_file
    from sqlalchemy import create_engine

    from infra.local.stack import LocalStack
    from services.rollout_worker.run_engines import RunRegistry
    from services.trainer.publisher import WeightPublisher
    from shared.contracts.messages import decode
    from shared.contracts.streams import WEIGHTS
    from shared.weights.manifest import BaseModelRef, base_model_digest
    from tests.support.tiny_model import random_lora_adapter

    lora_run, full_run = insert_run(database_url, model, True), insert_run(database_url, model, False)
    env = {"REDIS_URL": redis_url, "DATABASE_URL": database_url, "LOG_LEVEL": "WARNING", "SNAPSHOT_EVERY": "1"}
    out: dict = {"adapter_s": [], "full_s": [], "adapter_bytes": 0, "full_bytes": 0, "adapter_stages": []}
    with LocalStack(data_dir=work / "stack", env=env) as stack:
        stack.start(services=["weight-server"])
        stack.wait_healthy(120)
        db = create_engine(database_url)
        worker = RunRegistry(db, work / "cache", 1.0)
        stream = redis.Redis.from_url(redis_url)
        last = [stream.xinfo_stream(WEIGHTS)["last-generated-id"].decode() if stream.exists(WEIGHTS) else "0-0"]

        async def deliver() -> None:
            entries = stream.xrange(WEIGHTS, f"({last[0]}", "+")
            last[0] = entries[-1][0].decode()
            for _, fields in entries:
                await worker.on_weights(decode(fields))

        try:
            ctx = {run: await worker.get(run) for run in (lora_run, full_run)}
            publisher = WeightPublisher(stack.weight_server_url, stack.data_dir / "weights")  # co-located
            base = BaseModelRef(name=str(model), sha256=base_model_digest(str(model)))
            state = load_file(str(model / "model.safetensors"))
            peft_model = None
            for v in range(1, VERSIONS + 1):
                folder = work / f"adapter-v{v}"
                peft_model = random_lora_adapter(model, folder, v, rank=RANK, peft_model=peft_model)
                out["adapter_bytes"] = sum(p.stat().st_size for p in folder.iterdir())
                shutil.copytree(folder, work / f"keep-v{v}")  # publishing consumes the folder; part 2 reads these
                started = time.perf_counter()
                publisher.publish(lora_run, v, folder, {}, base_model=base)
                published = time.perf_counter()
                await deliver()
                out["adapter_s"].append(time.perf_counter() - started)
                out["adapter_stages"].append(publisher.last_timings | {"worker_s": time.perf_counter() - published})
                assert ctx[lora_run].engine.version == v

                folder = work / f"full-v{v}"
                folder.mkdir()
                for p in model.iterdir():
                    if p.is_file() and p.suffix != ".safetensors":
                        (folder / p.name).write_bytes(p.read_bytes())
                state = {k: t.clone() for k, t in state.items()}
                next(iter(state.values())).view(-1)[v] += 1.0  # another version of the weights
                save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
                out["full_bytes"] = (folder / "model.safetensors").stat().st_size
                started = time.perf_counter()
                publisher.publish(full_run, v, folder, {})
                await deliver()
                out["full_s"].append(time.perf_counter() - started)
                assert ctx[full_run].engine.version == v and publisher.last_kind == "full"
                log(f"v{v}: adapter {out['adapter_s'][-1]:.3f}s, full {out['full_s'][-1]:.3f}s")
        finally:
            await worker.close()
            db.dispose()
    return {"adapter_bytes": out["adapter_bytes"], "full_bytes": out["full_bytes"],
            "adapter_sync_s": round(statistics.median(out["adapter_s"]), 4),
            "adapter_sync_first_s": round(out["adapter_s"][0], 4),
            # medians: the publisher's stages (plan request, hashing, writing, the weight server's publish request)
            # and the worker's (reading the announcement, fetching, checking the base, loading the adapter)
            "adapter_sync_stages_s": {k: round(statistics.median(st[k] for st in out["adapter_stages"]), 4)
                                      for k in out["adapter_stages"][0]},
            "weight_sync_full_s": round(statistics.median(out["full_s"]), 4),
            "adapter_sync_samples_s": [round(x, 4) for x in out["adapter_s"]],
            "weight_sync_full_samples_s": [round(x, 4) for x in out["full_s"]]}


async def engines(model: Path, adapters: list[Path], mode: str, runs: int) -> dict:
    """One configuration in this (fresh) process: RSS after loading, generation throughput, RSS after."""
    import asyncio

    import psutil
    from transformers import AutoTokenizer

    from services.rollout_worker.engines import AdapterView, SamplingParams, build_engine
    from shared.contracts.run_config import EngineConfig
    from shared.weights.manifest import BaseModelRef, base_model_digest

    rss = lambda: psutil.Process().memory_info().rss / 2**20  # noqa: E731
    before = rss()
    tokenizer = AutoTokenizer.from_pretrained(model)
    cfg = EngineConfig(dtype="bfloat16", max_batch_size=128)
    base_ref = BaseModelRef(name=str(model), sha256=base_model_digest(str(model)))
    if mode == "full":
        served = [build_engine("hf", str(model), cfg, tokenizer) for _ in range(runs)]
    else:
        base = build_engine("hf", str(model), cfg, tokenizer)
        served = [AdapterView(base, f"run{i}") for i in range(runs)]
        for i, view in enumerate(served):
            await view.load_adapter(adapters[i], 1, base_ref)
    loaded = rss()
    prompt = tokenizer("What is 12 + 30?").input_ids
    sampling = SamplingParams(temperature=1.0)

    async def round_of(engines_used: list) -> None:
        await asyncio.gather(*(engines_used[i % len(engines_used)].generate(prompt, sampling, 1) for i in range(128)))

    out = {"rss_mb_loaded": round(loaded - before, 1)}
    if mode == "lora":
        await round_of(served)  # warm-up
        times: dict[str, list[float]] = {"one_run": [], "n_runs": []}
        for _ in range(12):  # alternated, so drift on a shared machine hits both alike
            for name, used in (("one_run", served[:1]), ("n_runs", served)):
                started = time.perf_counter()
                await round_of(used)
                times[name].append(time.perf_counter() - started)
        out |= {f"gen_per_s_{name}": round(128 / statistics.median(t), 1) for name, t in times.items()}
    else:
        await round_of(served[:1])
    out["rss_mb_after_generating"] = round(rss() - before, 1)
    for e in {id(getattr(s, "base", s)): getattr(s, "base", s) for s in served}.values():
        await e.close()
    return out


def trainer_engines(model: Path, mode: str, runs: int) -> dict:
    """Part 4 in this (fresh) process: `runs` trainer runs (LoRA or full) opened as the trainer opens them, two
    PPO updates each, round robin: private resident MB, engines held, update seconds."""
    import ctypes

    import psutil
    import verl.workers.engine_workers  # noqa: F401  (its import, ~300 MB, is not an engine's)

    from bench.train import _ppo_step
    from services.trainer.lora_shared_engine import engines_held, open_engine
    from shared.contracts.run_config import AlgorithmConfig

    def rss() -> float:
        """Private resident MB: less the file pages of the mmapped checkpoint, after handing freed heap back to
        the OS (without both, loading the same engine varied by ~300 MB from run to run)."""
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        info = psutil.Process().memory_info()
        return (info.rss - info.shared) / 2**20

    before = rss()
    lora = {"rank": RANK, "alpha": 2 * RANK, "target_modules": "all-linear"} if mode == "lora" else None
    algo = AlgorithmConfig(adv_estimator="grpo", lr=1e-4, lora=lora)
    steps = [_ppo_step(open_engine(f"run{i}", str(model), algo, group_size=4, micro_batch_size=8))
             for i in range(runs)]
    loaded, times = rss(), []
    for _ in range(2):
        for step in steps:
            started = time.perf_counter()
            step()
            times.append(time.perf_counter() - started)
    return {"private_mb_loaded": round(loaded - before, 1), "private_mb_after_updates": round(rss() - before, 1),
            "engines_held": engines_held(), "update_s": round(statistics.median(times), 3),
            "update_samples_s": [round(t, 3) for t in times]}


def trainer_figures(model: Path) -> dict:
    one, n_lora, n_full = (child(model.parent, model, mode, runs, trainer=True)
                           for mode, runs in (("lora", 1), ("lora", N_RUNS), ("full", N_RUNS)))
    return {"trainer_private_mb_one_run": one["private_mb_after_updates"],
            "trainer_private_mb_n_runs": n_lora["private_mb_after_updates"],
            "trainer_private_mb_n_full_runs": n_full["private_mb_after_updates"],
            "n_runs_vs_one_run_memory": round(n_lora["private_mb_after_updates"] / one["private_mb_after_updates"], 3),
            "detail": {"lora_one_run": one, "lora_n_runs": n_lora, "full_n_runs": n_full}}


def child(work: Path, model: Path, mode: str, runs: int, trainer: bool = False) -> dict:
    adapters = [work / f"keep-v{i + 1}" for i in range(N_RUNS)]
    flag = "--trainer-engines" if trainer else "--engines"
    proc = subprocess.run([sys.executable, "-m", "bench.lora", flag, mode, str(runs), str(model),
                           *map(str, adapters)], capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("@@")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{mode} x{runs} failed: {proc.stderr[-2000:]}")
    return json.loads(lines[-1][2:])


def learning_runs(n: int, steps: int, timeout_s: float, overrides: dict | None = None, seed: int = 0,
                  first_offset: int = 0) -> dict:
    """Part 3: n LoRA runs of the demo's task at once, run k rewarded for (digit + first_offset + k) mod 10, each
    under the demo's LoRA config with `overrides` merged in (nested dicts key by key) and `seed`: one seed per
    stack, so the runs share the trainer's engine as runs of one kind do."""
    from tests.support.demo import (
        BAR,
        FINAL_VERSIONS,
        LORA,
        LORA_INIT_STD,
        LORA_LR,
        LORA_TEMPERATURE,
        SAMPLES,
        SERVICES,
        TASKS,
        answers_by_version,
        demo_config,
        recall_stack,
        summarize,
        train_runs,
    )
    from tests.support.recall import WORDS

    work = Path(tempfile.mkdtemp(prefix="flywheel-bench-lora-runs-"))
    started, load = time.monotonic(), os.getloadavg()[0]
    try:
        with recall_stack(work, SERVICES, log=log, init_std=LORA_INIT_STD) as (_, api, model_dir):
            configs = []
            for k in range(n):
                offset = (first_offset + k) % 10
                cfg = demo_config(model_dir, steps, TASKS, SAMPLES, LORA_LR, 1, lora=LORA, temperature=LORA_TEMPERATURE)
                cfg = merged(cfg, overrides or {})
                configs.append(cfg | {"name": f"lora-offset-{offset}", "seed": seed,
                                      "env": {**cfg["env"], "args": {"offset": offset}}})
            log(f"{n} LoRA runs of {steps} versions, seed {seed}, run k answering (digit + {first_offset} + k) mod 10"
                f"{f', with {overrides}' if overrides else ''}")
            run_ids, wall_s = train_runs(api, configs, steps, started + timeout_s, log)
            out = {}
            for cfg, run_id in zip(configs, run_ids, strict=True):
                rows = answers_by_version(api, run_id)
                s = summarize(rows)
                # each question over the last FINAL_VERSIONS versions it was asked at (the run's last versions
                # can miss one: a version's samples are a batch's 8 questions, fewer where stale ones were dropped)
                accuracy = {q: round(statistics.mean(list(accuracy_by_version(rows, q).values())[-FINAL_VERSIONS:]), 3)
                            for q in WORDS}
                out[f"offset_{cfg['env']['args']['offset']}"] = {
                    "seed": seed, "final_reward": round(s["final_reward"] or 0, 3),
                    "initial_reward": round(s["initial_reward"] or 0, 3),
                    "min_question_accuracy": min(accuracy.values(), default=0),
                    # the demo's own bar for a question, for every question
                    "learned_every_question": min(accuracy.values()) >= BAR["question_accuracy_min"],
                    "question_accuracy": accuracy, "versions_served": s["versions_served"],
                    # where a question lags: its accuracy at each version served (0: no sample drew its digit)
                    "lagging": {q: accuracy_by_version(rows, q) for q, a in accuracy.items()
                                if a < BAR["question_accuracy_min"]}}
            count = api.post("/v1/sql", json={"query": "SELECT count(*) FROM trajectories WHERE run_id IN (" +
                                              ", ".join(f"'{r}'" for r in run_ids) + ")"}).json()["rows"][0][0]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    finals = [r["final_reward"] for r in out.values()]
    return {"n_runs": n, "versions": steps, "per_run": out, "every_run_final_reward_min": min(finals),
            "trajectories": count, "traj_per_s_n_runs": round(count / wall_s, 1), "wall_s": round(wall_s, 1),
            "passed": min(finals) >= 0.8, "cores": os.cpu_count(),
            "load_avg_1m": [round(load, 2), round(os.getloadavg()[0], 2)]}  # at the start and the end


def merged(base: dict, overrides: dict) -> dict:
    """`base` with `overrides` in, nested dicts merged key by key."""
    return base | {k: merged(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
                   for k, v in overrides.items()}


def accuracy_by_version(rows: list[dict], question: str) -> dict[int, float]:
    """One question's accuracy at each version its samples were drawn at (answers_by_version's rows)."""
    by: dict[int, list[float]] = {}
    for r in rows:
        if r["question"] == question:
            got = by.setdefault(r["version"], [0.0, 0.0])
            got[0], got[1] = got[0] + r["reward"], got[1] + r["num"]
    return {v: round(right / num, 3) for v, (right, num) in sorted(by.items())}


def lag(variant: str, overrides: dict, stacks: int, runs: int, steps: int, first_stack: int = 0) -> dict:
    """`--part lag`: `stacks` stacks one after another, each `runs` LoRA runs at once under `overrides`, stack j's
    runs seeded j and answering offsets 4j.. (mod 10): how many runs learned every question (the demo's bar for a
    question, BAR["question_accuracy_min"], over the last versions). Saved under `lag` by variant after each stack;
    `first_stack` > 0 goes on from the variant's saved stacks."""
    saved = json.loads(RESULTS.read_text()).get("lag", {}).get(variant, {}) if RESULTS.exists() else {}
    per_stack = saved.get("stacks", [])[:first_stack] if first_stack else []
    started = time.monotonic() - (saved.get("wall_s", 0) if first_stack else 0)
    for j in range(first_stack, first_stack + stacks):
        per_stack.append(learning_runs(runs, steps, 3600, overrides, seed=j, first_offset=runs * j))
        per_run = [r for s in per_stack for r in s["per_run"].values()]
        result = {"variant": variant, "overrides": overrides, "versions": steps, "runs": len(per_run),
                  "learned_every_question": sum(r["learned_every_question"] for r in per_run),
                  "min_question_accuracy": sorted(r["min_question_accuracy"] for r in per_run),
                  "final_reward": sorted(r["final_reward"] for r in per_run),
                  "wall_s": round(time.monotonic() - started, 1), "cores": os.cpu_count(),
                  "load_avg_1m": [s["load_avg_1m"] for s in per_stack],
                  "stacks": [{k: v for k, v in s.items() if k != "cores"} for s in per_stack]}
        old = json.loads(RESULTS.read_text()).get("lag", {}) if RESULTS.exists() else {}
        save({"lag": old | {variant: result}})
        log(f"{variant}: {result['learned_every_question']} of {result['runs']} runs learned every question")
    return result


def base_odds(temperatures: tuple[float, ...] = (1.0, 1.25, 1.5)) -> dict:
    """`--part base`: the demo's LoRA base (build_number_model at LORA_INIT_STD) at each sampling temperature: per
    offset the question whose right digit is least likely at version 0 (and the chance a group of SAMPLES draws
    it never), and the best p(digit) any final hidden state can give (what an adapter that leaves the final norm
    and the tied embeddings frozen can reach at most), found by gradient ascent on the normed hidden state."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.support.demo import LORA_INIT_STD, SAMPLES, prompt_ids
    from tests.support.recall import ANSWERS, WORDS
    from tests.support.tiny_model import build_number_model

    work = Path(tempfile.mkdtemp(prefix="flywheel-bench-lora-base-"))
    try:
        folder = build_number_model(work / "model", init_std=LORA_INIT_STD)
        tokenizer, model = AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder).eval()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    digits = [tokenizer.convert_tokens_to_ids(str(k)) for k in range(10)]
    with torch.no_grad():
        logits = torch.stack([model(torch.tensor([prompt_ids(tokenizer, w)])).logits[0, -1] for w in WORDS])
    embeddings, norm = model.get_output_embeddings().weight.detach(), model.model.norm.weight.detach()
    out = {}
    for t in temperatures:
        p = torch.softmax(logits / t, -1)
        least = {}
        for offset in range(10):
            right = {w: float(p[i, digits[(int(ANSWERS[w]) + offset) % 10]]) for i, w in enumerate(WORDS)}
            w = min(right, key=right.get)
            least[offset] = {"question": w, "p": round(right[w], 5), "p_no_right_in_group": round((1 - right[w]) ** SAMPLES, 3)}
        best = []
        for d in digits:
            torch.manual_seed(d)
            x = torch.randn(embeddings.shape[1], requires_grad=True)
            opt = torch.optim.Adam([x], lr=0.05)
            for _ in range(400):
                logp = torch.log_softmax(embeddings @ (norm * x / x.pow(2).mean().sqrt()) / t, -1)[d]
                opt.zero_grad()
                (-logp).backward()
                opt.step()
            best.append(round(float(logp.exp()), 3))
        out[str(t)] = {"least_likely_right_digit_by_offset": least, "best_p_by_digit": best,
                       "accuracy_ceiling_mean": round(sum(best) / len(best), 3)}
    return out


def main() -> None:
    import asyncio

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="+", help=argparse.SUPPRESS)  # the child process of part 2
    parser.add_argument("--small", action="store_true", help="a smoke-sized model (hidden 256, 2 layers)")
    parser.add_argument("--trainer-engines", nargs="+", help=argparse.SUPPRESS)  # the child process of part 4
    parser.add_argument("--part", choices=("all", "runs", "trainer", "lag", "base"), default="all",
                        help="runs: only part 3 (N LoRA runs learning at once); trainer: only part 4 (the "
                        "trainer's memory); lag: seeded stacks of part 3 under --variant's config, each variant "
                        "under `lag` by name; base: the LoRA base's odds and ceiling per temperature, under "
                        "`lag`; each merged into the results file")
    parser.add_argument("--variant", nargs=2, metavar=("NAME", "JSON"), default=("defaults", "{}"),
                        help='--part lag: a name and the run-config overrides, e.g. t1.5 \'{"sampling": '
                        '{"temperature": 1.5}}\'')
    parser.add_argument("--stacks", type=int, default=2, help="--part lag: stacks one after another")
    parser.add_argument("--first-stack", type=int, default=0,
                        help="--part lag: go on from the variant's saved stacks with stack (seed) FIRST_STACK")
    parser.add_argument("--runs", type=int, default=N_RUNS)
    parser.add_argument("--steps", type=int, help="versions per run (default: 80; --part lag: the demo's STEPS, 100)")
    args = parser.parse_args()
    if args.engines:
        mode, runs, model, *adapters = args.engines
        print("@@" + json.dumps(asyncio.run(engines(Path(model), list(map(Path, adapters)), mode, int(runs)))))
        return
    if args.trainer_engines:
        mode, runs, model, *_ = args.trainer_engines
        print("@@" + json.dumps(trainer_engines(Path(model), mode, int(runs))))
        return
    if args.part == "base":
        odds = base_odds()
        old = json.loads(RESULTS.read_text()).get("lag", {}) if RESULTS.exists() else {}
        save({"lag": old | {"base": odds}})
        print(json.dumps(odds, indent=1))
        return
    if args.steps is None:
        from tests.support.demo import STEPS

        args.steps = STEPS if args.part == "lag" else 80
    if args.part == "lag":
        result = lag(args.variant[0], json.loads(args.variant[1]), args.stacks, args.runs, args.steps,
                     args.first_stack)
        print(json.dumps({k: v for k, v in result.items() if k != "stacks"}, indent=1))
        return
    if args.part == "runs":
        one = learning_runs(1, args.steps, timeout_s=3600)  # the same stack and task with one run, just before
        runs = learning_runs(args.runs, args.steps, timeout_s=3600)
        runs |= {"traj_per_s_one_run": one["traj_per_s_n_runs"], "one_run": one,
                 "n_runs_vs_one_run_throughput": round(runs["traj_per_s_n_runs"] / one["traj_per_s_n_runs"], 3)}
        save({"runs": runs})
        print(json.dumps(runs, indent=1))
        sys.exit(0 if runs["passed"] and one["passed"] else 1)

    from bench.train import build_model, private_backends

    hidden, layers = (256, 2) if args.small else (HIDDEN, LAYERS)
    work = Path(tempfile.mkdtemp(prefix="flywheel-bench-lora-"))
    model = build_model(work / "model", hidden=hidden, layers=layers)
    if args.part == "trainer":
        try:
            trainer = trainer_figures(model) | {"model": {"hidden": hidden, "layers": layers}}
        finally:
            shutil.rmtree(work, ignore_errors=True)
        save({"trainer": trainer})
        print(json.dumps(trainer, indent=1))
        return
    redis_url, database_url, cleanup = private_backends()
    try:
        result: dict = {"model": {"hidden": hidden, "layers": layers, "lora_rank": RANK, "n_runs": N_RUNS},
                        "cores": os.cpu_count()}
        result["sync"] = asyncio.run(sync(work, model, redis_url, database_url))
        s = result["sync"]
        s["adapter_sync_vs_full"] = round(s["adapter_sync_s"] / s["weight_sync_full_s"], 4)
        one, n_full = child(work, model, "lora", 1), child(work, model, "full", N_RUNS)
        # throughput varies ~10% from one process to the next with the same code: three processes, medians
        n_lora_procs = [child(work, model, "lora", N_RUNS) for _ in range(3)]
        n_lora = n_lora_procs[0]
        per_process = [round(p["gen_per_s_n_runs"] / p["gen_per_s_one_run"], 3) for p in n_lora_procs]
        result["worker"] = {
            "worker_rss_mb_one_run": one["rss_mb_after_generating"],
            "worker_rss_mb_n_runs": n_lora["rss_mb_after_generating"],
            "worker_rss_mb_n_full_runs": n_full["rss_mb_after_generating"],
            "n_runs_vs_one_run_memory": round(n_lora["rss_mb_after_generating"] / one["rss_mb_after_generating"], 3),
            "worker_rss_mb_loaded_one_run": one["rss_mb_loaded"], "worker_rss_mb_loaded_n_runs": n_lora["rss_mb_loaded"],
            "worker_rss_mb_loaded_n_full_runs": n_full["rss_mb_loaded"],
            "gen_per_s_one_run": statistics.median(p["gen_per_s_one_run"] for p in n_lora_procs),
            "gen_per_s_n_runs": statistics.median(p["gen_per_s_n_runs"] for p in n_lora_procs),
            "n_runs_vs_one_run_throughput": statistics.median(per_process),
            "n_runs_vs_one_run_throughput_per_process": per_process,
            "detail": {"lora_one_run": one, "lora_n_runs": n_lora_procs, "full_n_runs": n_full}}
        result["trainer"] = trainer_figures(model)
    finally:
        cleanup()
    save(result)  # part 3 (`make bench-lora-runs`) stays as it was
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
