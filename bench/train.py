"""Trainer benchmarks: `make bench-train` (python -m bench.train [--parts engine,async,weight_sync,step])
-> bench/results/train.json; each part runs alone (`--parts async`) and replaces only its own keys.

1. weight_sync_delta_s / weight_sync_full_s: a >= 200 MB bf16 checkpoint updated by real verl optimizer steps,
   the trainer's publish call (export included) -> every real rollout worker (HF engine) serving the new version,
   read from its /metrics; deltas (only changed elements, applied in place) vs full snapshots. raw_copy_s:
   copying the full checkpoint on the same disk (with fsync). `--parts weight_sync [--small]` runs it alone.
2. sync_step_s vs async_step_s: seconds per policy version of real training runs through the controller,
   rollout worker, env worker, trainer (verl) and weight server, max_staleness 0 vs 2, inference by the mock
   LLM (hot-reloaded per version) with its latency set so a batch's rollout takes about a trainer cycle.
3. engine_step_s vs torch_step_s: one verl FSDP2 engine update vs plain torch forward + backward + AdamW step
   of the same loss on the same batch and model.
4. step_tokens_per_s_padded vs step_tokens_per_s_packed: one policy update on an RL-shaped batch (spread
   response lengths), padded micro-batches vs padding removal + token-budget micro-batches (bench/train_step.py).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from bench.train_step import bench_step

if TYPE_CHECKING:
    import torch

RESULTS = Path("bench/results/train.json")


def log(msg: str) -> None:
    print(msg, flush=True)


# -- 1. weight sync -------------------------------------------------------------------------------------------
def build_model(folder: Path, hidden: int, layers: int) -> Path:
    """The tests' tiny Qwen2 (byte-level BPE, 512 tokens), `hidden` wide and `layers` deep."""
    from tests.support.tiny_model import build_tiny_model

    return build_tiny_model(folder, hidden_size=hidden, num_layers=layers, intermediate_size=2 * hidden)


def weight_sync(work: Path, redis_url: str, database_url: str, workers: int = 2, small: bool = False) -> dict:
    """A >= 200 MB bf16 checkpoint (114M params; `small`: a smoke-sized one) trained by real verl optimizer
    steps at lr 5e-6, published after each step to a real weight server (co-located volume, a snapshot every
    SNAPSHOT_EVERY versions, deltas between) -> 2 real rollout workers (HF engine, bf16) serving it."""
    hidden, layers = (256, 2) if small else (1024, 12)
    r = bench_weight_sync(work / "sync", redis_url, database_url, workers, hidden, layers)
    delta, full, raw = r["delta_s"], r["full_s"], r["raw_copy_s"]
    stages = {k: round(statistics.median(v), 4) for k, v in r["delta_stages"].items()}
    cpu = {k: round(statistics.median(v), 3) for k, v in r["delta_cpu"].items()}
    totals = [sum(group) for group in zip(*r["delta_cpu"].values(), strict=True)]
    return {
        "full_bytes": r["full_bytes"], "rollout_workers": workers,
        "delta_bytes": statistics.median(r["delta_bytes"]), "changed_fraction": statistics.median(r["changed"]),
        "weight_sync_delta_s": statistics.median(delta), "weight_sync_delta_first_s": delta[0],
        "weight_sync_delta_samples_s": [round(x, 3) for x in delta],
        "weight_sync_full_s": statistics.median(full), "weight_sync_full_samples_s": [round(x, 3) for x in full],
        "raw_copy_s": raw, "weight_sync_delta_ratio": statistics.median(delta) / raw,
        "weight_sync_full_ratio": statistics.median(full) / raw,
        # where a delta version's time goes (medians): export_hf (verl gathers + casts the weights), the
        # publisher's stages (plan request, diff + hashing the changed tensors, zstd, write + fsync of the delta
        # file, the weight server's publish request), the rest is the workers' notice, read, decode, patch, check
        "weight_sync_delta_stages_s": stages,
        # CPU seconds a delta version costs (medians per process group, and of their sum) against the cores
        # there are: cpu_s / cores is as fast as the version could be here even if every stage overlapped
        "weight_sync_delta_cpu_s": cpu | {"total": statistics.median(totals)}, "cores": os.cpu_count(),
        "weight_sync_delta_cpu_bound_s": statistics.median(totals) / os.cpu_count(),
        "raw_copy_cpu_s": r["raw_copy_cpu_s"],
        "weight_sync_note": f"{r['params'] / 1e6:.0f}M-param Qwen2-shaped model, exported in bf16; each version is "
                            "one real verl FSDP2 optimizer step (lr 5e-6, AdamW) on the CPU trainer engine. Clock: "
                            "the trainer's publish (export_hf + WeightPublisher.publish: diff, hash, delta or full, "
                            "weight server fsync + manifest + announce) -> every real rollout worker (LocalStack "
                            "processes, HF engine, bf16) reports the version in rollout_weight_version on /metrics "
                            f"(polled every 10 ms). SNAPSHOT_EVERY={SYNC_SNAPSHOT_EVERY}: versions 1, "
                            f"{1 + SYNC_SNAPSHOT_EVERY}, ... are full snapshots (weight_sync_full_s), the others "
                            "deltas applied in place (weight_sync_delta_s; _first_s: the first delta). "
                            "changed_fraction: share of the checkpoint's weight bytes that changed per delta "
                            "version. raw_copy_s: copy + fsync of the full bf16 model.safetensors on the same disk "
                            "in the same run (median of 5; raw_copy_cpu_s: this process's CPU per copy, the unlink "
                            "after it included). CPU seconds per delta version, from the step's end to every worker "
                            "serving: trainer = this process (export, publish, and the 10 ms polling of /metrics), "
                            "rollout workers and weight server = their process_cpu_seconds_total (10 ms ticks).",
    }


# Keys an earlier weight_sync part wrote (full checkpoints only) that no longer mean anything: dropped on rewrite.
STALE_SYNC_KEYS = ("checkpoint_bytes", "publish_request_s", "publish_request_verify_staging_s")


SYNC_SNAPSHOT_EVERY = 4
SYNC_VERSIONS = 13  # full at 1, 5, 9, 13; deltas at 2-4, 6-8, 10-12


def bench_weight_sync(work: Path, redis_url: str, database_url: str, workers: int, hidden: int, layers: int) -> dict:
    import httpx
    import numpy as np
    import redis

    from infra.local.stack import LocalStack
    from services.trainer.engine import PolicyEngine
    from services.trainer.publisher import WeightPublisher
    from shared.contracts.run_config import AlgorithmConfig

    model_dir = build_model(work / "model", hidden=hidden, layers=layers)
    run_id = _insert_bench_run(database_url, model_dir)
    trainer = PolicyEngine(str(model_dir), AlgorithmConfig(lr=5e-6), micro_batch_size=8, group_size=4)
    step = _ppo_step(trainer)
    env = {"REDIS_URL": redis_url, "DATABASE_URL": database_url, "LOG_LEVEL": "WARNING",
           "SNAPSHOT_EVERY": str(SYNC_SNAPSHOT_EVERY)}
    out: dict = {"delta_s": [], "full_s": [], "delta_bytes": [], "changed": [], "params": trainer.num_parameters,
                 "delta_stages": {}, "delta_cpu": {}}
    with LocalStack(data_dir=work / "stack", env=env) as stack:
        stack.start(services=["weight-server", "env-worker", "rollout-worker"], counts={"rollout-worker": workers})
        stack.wait_healthy(120)
        urls = [f"http://127.0.0.1:{stack.instance('rollout-worker', i).port}/metrics" for i in range(workers)]
        _warm_up(redis.Redis.from_url(redis_url), run_id, urls, None)
        publisher = WeightPublisher(stack.weight_server_url, stack.data_dir / "weights")
        http = httpx.Client(timeout=5)
        server_metrics = f"{stack.weight_server_url}/metrics"
        previous = None
        for version in range(1, SYNC_VERSIONS + 1):
            step()  # a real optimizer step: off the clock
            # CPU seconds of every process on the clock: this one (the trainer's export and publish, and the
            # polling below), each rollout worker, the weight server
            cpu_before = [time.process_time(), *(_cpu_seconds(u, http) for u in [*urls, server_metrics])]
            start = time.time()
            staging = publisher.staging_folder(run_id, version)
            tensors = trainer.export_hf(staging, "bfloat16", weights=False)  # as the trainer's loop does
            exported = time.time()
            msg = publisher.publish(run_id, version, staging, {"reward_mean": 0.0}, tensors=tensors)
            published = time.time()
            while any(_served_version(u, run_id, http) != version for u in urls):
                assert time.time() - start < 300, "rollout workers did not reload"
                time.sleep(0.01)
            elapsed = time.time() - start
            cpu_after = [time.process_time(), *(_cpu_seconds(u, http) for u in [*urls, server_metrics])]
            cpu = [b - a for a, b in zip(cpu_before, cpu_after, strict=True)]
            current = publisher.last[run_id].tensors
            if publisher.last_kind == "delta":
                out["delta_s"].append(elapsed)
                stages = {"export_s": exported - start, **publisher.last_timings,
                          "workers_after_publish_s": elapsed - (published - start)}
                for k, v in stages.items():
                    out["delta_stages"].setdefault(k, []).append(v)
                out["delta_bytes"].append(msg.bytes)
                for k, v in (("trainer", cpu[0]), ("rollout_workers", sum(cpu[1:-1])), ("weight_server", cpu[-1])):
                    out["delta_cpu"].setdefault(k, []).append(v)
                changed = sum(int(np.count_nonzero(_bits(previous[n]) != _bits(t))) * t.element_size()
                              for n, t in current.items())
                out["changed"].append(changed / sum(t.numel() * t.element_size() for t in current.values()))
            else:
                out["full_s"].append(elapsed)
                out["full_bytes"] = msg.bytes
                weights_file = Path(msg.path) / "model.safetensors"
            previous = current
            laps = " ".join(f"{k} {v:.3f}" for k, v in publisher.last_timings.items())
            log(f"v{version} {publisher.last_kind}: {elapsed:.3f} s (export {exported - start:.3f} s, publish "
                f"{published - exported:.3f} s: {laps}), {msg.bytes} bytes, CPU s {[round(c, 3) for c in cpu]}")
        http.close()
        cpu_before = time.process_time()
        out["raw_copy_s"] = raw_copy(weights_file, work)
        out["raw_copy_cpu_s"] = (time.process_time() - cpu_before) / 5  # raw_copy runs 5 copies
    return out


def _bits(t):
    import torch

    return t.reshape(-1).view(torch.int16).numpy()


def _ppo_step(engine):
    """One real verl policy update (PPO loss, AdamW) on a fixed random batch, as the trainer does per version."""
    import torch

    B, P, R = 8, 8, 8
    g = torch.Generator().manual_seed(0)
    t = _random_batch(B, P, R, 4, g)
    old, _ = engine.log_probs(t)
    adv, weights = torch.randn(B, R, generator=g), torch.ones(B, R)
    return lambda: engine.update(t, old, adv, weights)


def _random_batch(batch: int, prompt_len: int, response_len: int, group_size: int, g: torch.Generator) -> dict:
    """A verl batch of random token ids (no padding) in groups of `group_size`, drawn from generator `g`."""
    import numpy as np
    import torch

    prompts = torch.randint(4, 64, (batch, prompt_len), generator=g)
    responses = torch.randint(4, 64, (batch, response_len), generator=g)
    attention = torch.ones(batch, prompt_len + response_len, dtype=torch.long)
    return {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attention, "position_ids": (attention.cumsum(-1) - 1),
            "response_mask": attention[:, prompt_len:],
            "uid": np.array([str(i // group_size) for i in range(batch)], dtype=object)}


def _cpu_seconds(url: str, http) -> float:
    """process_cpu_seconds_total from a service's /metrics (prometheus-client reads /proc: 10 ms ticks)."""
    for line in http.get(url, timeout=30).text.splitlines():
        if line.startswith("process_cpu_seconds_total "):
            return float(line.split()[1])
    raise RuntimeError(f"{url} reports no process_cpu_seconds_total")


def _served_version(url: str, run_id: str, http=None) -> int | None:
    import httpx

    try:
        text_ = (http or httpx).get(url, timeout=30).text
    except httpx.HTTPError:  # a worker busy loading a model may answer late
        return None
    for line in text_.splitlines():
        if line.startswith("rollout_weight_version{") and run_id in line:
            return int(float(line.rsplit(" ", 1)[1]))
    return None


def raw_copy(path: Path, work: Path) -> float:
    times = []
    for _ in range(5):
        start = time.time()
        dst = work / "raw-copy.bin"
        shutil.copyfile(path, dst)
        with open(dst, "rb+") as f:
            os.fsync(f.fileno())
        times.append(time.time() - start)
        dst.unlink()
    return statistics.median(times)


# -- 1b. weight sync across a shaped network link -------------------------------------------------------------
def sync_parts(work: Path, redis_url: str, database_url: str, small: bool, which: str) -> dict:
    """The weight_sync part: the co-located case (page cache, `weight_sync_*` keys) and the link case (`link`)."""
    out: dict = {}
    if which in ("both", "colocated"):
        out |= weight_sync(work, redis_url, database_url, small=small)
    if which in ("both", "link"):
        out |= link_sync(work, redis_url, database_url, small=small)
    return out


LINK_RATES = ("1gbit", "10gbit")
LINK_WORKERS = (1, 2, 4)
LINK_SNAPSHOT_EVERY = 3  # per (workers, rate): full, delta, delta, full, delta, delta
LINK_VERSIONS = 6


def link_sync(work: Path, redis_url: str, database_url: str, small: bool = False) -> dict:
    """Weight sync as deployed: the weight server (with the trainer beside it, publishing through the shared
    volume) in one network namespace, each rollout worker in its own, joined by a bridge, every link shaped by
    `tc tbf` (tests/support/netns.py). Workers fetch over HTTP only, relaying to each other (services/rollout_worker/weight_relay.py).
    Per rate and worker count: full and delta versions (publish call -> every worker serving) and the weight
    server's egress bytes per version; per rate, the raw transfer of the full checkpoint (one plain HTTP GET)."""
    hidden, layers = (256, 2) if small else (1024, 12)
    return {"link": bench_link_sync(work / "link", redis_url, database_url, hidden, layers)}


def bench_link_sync(work: Path, redis_url: str, database_url: str, hidden: int, layers: int) -> dict:
    import httpx
    import redis

    from infra.local.ports import free_port
    from infra.local.stack import LocalStack, Placement
    from services.trainer.engine import PolicyEngine
    from services.trainer.publisher import WeightPublisher
    from shared.contracts.run_config import AlgorithmConfig
    from tests.support.netns import ShapedNetwork, namespaces

    if not redis_url.startswith("unix://") or "host=/" not in database_url:
        raise RuntimeError("the link bench reaches Redis and Postgres on unix sockets from every namespace: "
                           "run it through bench.train's private backends")
    model_dir = build_model(work / "model", hidden=hidden, layers=layers)
    run_id = _insert_bench_run(database_url, model_dir)
    trainer = PolicyEngine(str(model_dir), AlgorithmConfig(lr=5e-6), micro_batch_size=8, group_size=4)
    step = _ppo_step(trainer)
    # "observer": where the bench polls the workers' /metrics from, so that polling is not the server's egress
    hosts = ["server", "observer", *(f"w{i}" for i in range(max(LINK_WORKERS)))]
    out: dict = {rate: {"workers": {}} for rate in LINK_RATES}
    with ShapedNetwork(hosts, rate=LINK_RATES[0]) as net, net.entered("server"):
        port = free_port()
        env = {"REDIS_URL": redis_url, "DATABASE_URL": database_url, "LOG_LEVEL": "WARNING",
               "SNAPSHOT_EVERY": str(LINK_SNAPSHOT_EVERY), "ANNOUNCE_PATH": "false", "WEIGHT_SERVER_PORT": str(port),
               "PUBLIC_URL": f"http://{net.address('server')}:{port}"}

        def placement(name: str, index: int) -> Placement:
            if name != "rollout-worker":
                return Placement()  # beside the weight server: started from this thread, in its namespace
            host = f"w{index}"
            return Placement(tuple(net.exec_prefix(host)), net.address(host),
                             {"RELAY_HOST": net.address(host), "CHECKPOINT_CACHE_DIR": str(work / f"cache-{host}")})

        with LocalStack(data_dir=work / "stack", env=env, placement=placement) as stack:
            stack.start(services=["weight-server", "env-worker"])
            publisher = WeightPublisher(stack.weight_server_url, stack.data_dir / "weights")
            http = httpx.Client(timeout=30)
            version = 0
            for workers in LINK_WORKERS:
                running = sum(1 for i in stack.instances if i.name == "rollout-worker")
                stack.start(services=["rollout-worker"], counts={"rollout-worker": workers - running})
                stack.wait_healthy(300)
                urls = [f"{stack.instance('rollout-worker', i).url}/metrics" for i in range(workers)]
                _warm_up(redis.Redis.from_url(redis_url), run_id, urls, http)  # late joiners load the newest
                for rate in LINK_RATES:
                    net.set_rate(rate)
                    samples = {"full": [], "delta": [], "egress": {"full": [], "delta": []}, "bytes": {},
                               "stages": {"full": {}, "delta": {}}}
                    for _ in range(LINK_VERSIONS):
                        version += 1
                        step()
                        kind, seconds, msg, egress, stages = _timed_version(
                            trainer, publisher, run_id, version, urls, lambda: net.tx_bytes("server"),
                            lambda: net.entered("observer"))
                        samples[kind].append(seconds)
                        samples["egress"][kind].append(egress)
                        samples["bytes"].setdefault(kind, []).append(msg.bytes)
                        for k, v in stages.items():
                            samples["stages"][kind].setdefault(k, []).append(v)
                        if kind == "full":
                            full_msg = msg
                        log(f"{rate} {workers} workers v{version} {kind}: {seconds:.3f} s, {msg.bytes} bytes, "
                            f"server egress {egress} bytes, stages {[round(v, 3) for v in stages.values()]}")
                    out[rate]["workers"][str(workers)] = _link_figures(samples)
                    if "raw_transfer_s" not in out[rate]:
                        out[rate] |= _raw_transfer(net, f"{full_msg.uri}/model.safetensors", work)
            http.close()
    left = [n for n in namespaces() if n.startswith(net.tag)]  # the network is gone with its links
    assert not left, f"the link bench left network namespaces behind: {left}"
    for rate in LINK_RATES:  # the layout the targets name: raw_transfer_s and "1", "2", "4" side by side
        out[rate] |= out[rate].pop("workers")
    load = os.getloadavg()
    one, four = out["1gbit"]["1"], out["1gbit"]["4"]
    out["targets"] = {
        "delta_4_workers_over_raw_1gbit": {"value": four["delta_s"] / out["1gbit"]["raw_transfer_s"], "target": "<= 0.5"},
        "full_4_over_1_workers_1gbit": {"value": four["full_s"] / one["full_s"], "target": "<= 1.5"},
        "egress_over_version_bytes_4_workers": {
            "value": max(four["egress_bytes_per_version"][k] / four["version_bytes"][k] for k in ("full", "delta")),
            "target": "<= 1.2"},
    }
    out["loadavg"] = [round(x, 2) for x in load]
    out["note"] = (
        f"{trainer.num_parameters / 1e6:.0f}M-param Qwen2-shaped model in bf16, a real verl optimizer step per "
        "version. The weight server and the trainer share a network namespace (the trainer publishes through the "
        "server's volume); each rollout worker (real process, HF engine) sits in its own namespace; all join a "
        "bridge through veth pairs shaped on both ends by `tc qdisc ... tbf rate <rate> burst 256kb latency 50ms`. "
        "Workers fetch over HTTP only (ANNOUNCE_PATH=false, own cache folder each) through the relay chain: the "
        "server feeds the first worker, each worker checks every 1 MiB piece against the manifest before writing, "
        "serving or forwarding it. Per worker count, versions alternate full, delta, delta (SNAPSHOT_EVERY="
        f"{LINK_SNAPSHOT_EVERY}), {LINK_VERSIONS} versions per rate; full_s / delta_s: medians of the trainer's "
        "publish call (export included) -> every worker reports the version on /metrics (polled every 10 ms from "
        "a namespace of its own, not the server's). "
        "egress_bytes_per_version: median bytes the server's link sent during a version (eth0 tx counter, TCP/IP "
        "framing included); version_bytes: the version's files (the delta file, or the full snapshot). "
        "raw_transfer_s: one plain HTTP GET (curl) of the full model.safetensors from the weight server to one "
        "worker namespace, written to disk, median of 3. Workers joined one after another (1, then 2, then 4): "
        "the new ones loaded the newest version as late joiners. Measured on a shared 2-core machine under load.")
    return out


def _insert_bench_run(database_url: str, model_dir: Path) -> str:
    from sqlalchemy import create_engine, text

    from tests.support.demo import demo_config

    run_id = str(uuid.uuid4())
    config = demo_config(model_dir, steps=3, tasks=1, n=2, lr=5e-6, max_staleness=0)
    config["engine"] |= {"dtype": "bfloat16", "weights_dtype": "bfloat16"}
    with create_engine(database_url).begin() as c:
        c.execute(text("INSERT INTO runs (id, name, kind, status, config, policy_version, summary) "
                       "VALUES (:id, 'bench-sync', 'train', 'running', CAST(:cfg AS jsonb), 0, '{}')"),
                  {"id": run_id, "cfg": json.dumps(config | {"schema_version": 1})})
    return run_id


def _warm_up(client, run_id: str, urls: list[str], http) -> None:
    """Send tasks until every worker serves the run (a worker builds a run's context at its first task)."""
    from shared.contracts.messages import RolloutTask, encode
    from shared.contracts.streams import ROLLOUT_TASKS

    deadline, i = time.monotonic() + 600, 0
    while any(_served_version(u, run_id, http) is None for u in urls):
        assert time.monotonic() < deadline, "rollout workers never picked up the run"
        task = RolloutTask(run_id=run_id, task_id=f"warm{i}", sample_idx=0, dispatched_at=time.time(),
                           task={"task_id": f"warm{i}", "question": "one", "answer": "1"})
        client.xadd(ROLLOUT_TASKS, encode(task))
        i += 1
        time.sleep(0.5)


def _timed_version(trainer, publisher, run_id: str, version: int, urls: list[str], tx_bytes, observer):
    """Export + publish one version and wait until every worker serves it (polled from the `observer`
    namespace): (kind, seconds, message, bytes the weight server's link sent meanwhile)."""
    import httpx

    sent = tx_bytes()
    start = time.time()
    staging = publisher.staging_folder(run_id, version)
    tensors = trainer.export_hf(staging, "bfloat16", weights=False)
    exported = time.time()
    msg = publisher.publish(run_id, version, staging, {"reward_mean": 0.0}, tensors=tensors)
    published = time.time()
    with observer(), httpx.Client(timeout=30) as http:
        while any(_served_version(u, run_id, http) != version for u in urls):
            assert time.time() - start < 300, f"rollout workers did not reload v{version}"
            time.sleep(0.01)
    end = time.time()
    stages = {"export_s": exported - start, "publish_s": published - exported, "workers_after_publish_s": end - published}
    return publisher.last_kind, end - start, msg, tx_bytes() - sent, stages


def _link_figures(samples: dict) -> dict:
    med = statistics.median
    return {"full_s": med(samples["full"]), "delta_s": med(samples["delta"]),
            "full_samples_s": [round(x, 3) for x in samples["full"]],
            "delta_samples_s": [round(x, 3) for x in samples["delta"]],
            "egress_bytes_per_version": {k: int(med(v)) for k, v in samples["egress"].items()},
            "version_bytes": {k: int(med(v)) for k, v in samples["bytes"].items()},
            # where a version's seconds go (medians): the trainer's export, its publish call (diff, hashes, zstd,
            # write, the weight server's publish), then until every worker serves it (relay fetch, apply)
            "stages_s": {kind: {k: round(med(v), 3) for k, v in st.items()} for kind, st in samples["stages"].items()}}


def _raw_transfer(net, url: str, work: Path) -> dict:
    """One plain HTTP GET of the full checkpoint file from the weight server into w0's disk (curl), median
    of 3."""
    dest = work / "raw-transfer.bin"
    times = []
    for _ in range(3):
        r = net.exec("w0", ["curl", "-sf", "-o", str(dest), "-w", "%{time_total} %{size_download}", url],
                     capture_output=True, text=True, check=True)
        seconds, size = r.stdout.split()
        times.append(float(seconds))
        dest.unlink()
    return {"raw_transfer_s": statistics.median(times), "raw_transfer_bytes": int(size),
            "raw_transfer_samples_s": [round(t, 3) for t in times]}


# -- 2. sync vs async -----------------------------------------------------------------------------------------
def bench_async(work: Path, redis_url: str, database_url: str, versions: int = 12, warmup: int = 2,
                tasks: int = 8, n: int = 8) -> dict:
    """Seconds per policy version through the real services (controller, rollout worker, env worker, trainer
    on verl, weight server), max_staleness 0 vs 2. Inference is the mock LLM behind the openai engine (it
    follows each hot reload's version), its latency set so that a batch's rollout takes about as long as the
    trainer's cycle for one version, measured first with near-zero latency."""
    from infra.local.stack import LocalStack

    model_dir = build_model(work / "async-model", hidden=256, layers=4)
    env = {"REDIS_URL": redis_url, "DATABASE_URL": database_url, "LOG_LEVEL": "WARNING"}
    with LocalStack(data_dir=work / "async-stack", env=env) as stack:
        stack.start(services=["weight-server", "env-worker", "rollout-worker", "trainer", "controller"])
        stack.wait_healthy(180)
        bench = AsyncBench(database_url, model_dir, work, tasks, n)
        calibration = bench.run(max_staleness=2, latency_s=0.001, versions=4, warmup=warmup)
        latency_s = max(0.05, calibration["per_version_s"] - calibration["rollout_batch_s"])
        log(f"trainer-bound version: {calibration['per_version_s']:.2f}s -> mock latency {latency_s:.2f}s")
        runs = {k: bench.run(max_staleness=k, latency_s=latency_s, versions=versions, warmup=warmup) for k in (0, 2)}
    sync, async_ = runs[0], runs[2]
    return {
        "sync_step_s": sync["per_version_s"], "async_step_s": async_["per_version_s"],
        "async_speedup": sync["per_version_s"] / async_["per_version_s"],
        "train_step_s": sync["train_step_s"], "rollout_batch_s": sync["rollout_batch_s"],
        "mock_latency_s": round(latency_s, 3), "async_versions_timed": versions,
        "async_runs": {"max_staleness_0": sync, "max_staleness_2": async_, "calibration": calibration},
        "async_note": "real services on this machine: controller (dispatch window), rollout worker (openai engine "
                      "-> mock LLM, hot reload per version), env worker (math env), trainer (verl FSDP2 step, "
                      "checkpoint, record, publish), weight server. Seconds per version: checkpoint publish times "
                      f"of versions {warmup}..{warmup + versions} (the first versions load the run). Mock "
                      "latency = the trainer-bound seconds per version (max_staleness 2, ~0 latency) minus that "
                      "run's rollout overhead, so rollout_batch_s (median over the sync run's batches: first "
                      "dispatch -> last stored) is about train_step_s + publish. max_staleness 0 (sync) vs 2. "
                      "tasks_dispatched_per_version above tasks_per_batch counts replacement groups for samples "
                      "dropped as too stale: the controller dispatches batch b once version b is recorded, which "
                      "precedes its publish and the rollout worker's reload, so at max_staleness 0 some of a "
                      "batch is generated one version behind.",
    }


class AsyncBench:
    """One training run per call, on the stack already started: arithmetic tasks, math env, the tests' tiny
    Qwen2 (bigger), openai engine -> a fresh mock LLM answering correctly after `latency_s`."""

    def __init__(self, database_url: str, model_dir: Path, work: Path, tasks: int, n: int):
        from sqlalchemy import create_engine

        from tests.support.live import register_dataset

        self.db = create_engine(database_url)
        self.model_dir, self.work, self.tasks, self.n = model_dir, work, tasks, n
        register_dataset(self.db, "bench-async", 512, split="train")

    def run(self, *, max_staleness: int, latency_s: float, versions: int, warmup: int) -> dict:
        from infra.local.ports import free_port
        from tests.support.live import insert_run, start_mock_llm, wait_run_ended

        port = free_port()
        mock = start_mock_llm(port, latency_s * 1000, answer="correct", tokenizer=str(self.model_dir))
        try:
            run_id = insert_run(self.db, self.config(max_staleness, f"http://127.0.0.1:{port}/v1", versions + warmup))
            assert wait_run_ended(self.db, run_id, 600) == "completed", f"async bench run {run_id} did not complete"
        finally:
            mock.terminate()
            mock.wait(10)
        return self.measure(run_id, warmup, versions) | {"max_staleness": max_staleness}

    def config(self, max_staleness: int, base_url: str, steps: int) -> dict:
        return {
            "name": f"bench-async-{max_staleness}", "kind": "train", "model": str(self.model_dir),
            "dataset": "bench-async", "agent": {"name": "math"}, "env": {"name": "math"},
            "engine": {"type": "openai", "base_url": base_url}, "algorithm": {"adv_estimator": "grpo", "lr": 1e-4},
            "samples_per_task": self.n, "tasks_per_batch": self.tasks, "max_response_tokens": 32,
            "max_staleness": max_staleness, "total_steps": steps,
            "max_in_flight": (max_staleness + 1) * self.tasks * self.n,  # the window, not max_in_flight, limits
            "trajectory_timeout_s": 120,
        }

    def measure(self, run_id: str, warmup: int, versions: int) -> dict:
        from sqlalchemy import text

        with self.db.connect() as c:
            published = dict(c.execute(text(
                "SELECT version, extract(epoch FROM created_at) FROM checkpoints WHERE run_id = :r"), {"r": run_id}).all())
            step_s = c.execute(text("SELECT value FROM metrics WHERE run_id = :r AND name = 'step_s' AND step > :w"),
                               {"r": run_id, "w": warmup}).scalars().all()
            batches = c.execute(text(
                "SELECT extract(epoch FROM max(finished_at) - min(dispatched_at)) FROM rollout_tasks "
                "WHERE run_id = :r AND batch_idx >= :w GROUP BY batch_idx"), {"r": run_id, "w": warmup}).scalars().all()
            dispatched = c.execute(text("SELECT count(*) FROM rollout_tasks WHERE run_id = :r"), {"r": run_id}).scalar()
        end = warmup + versions
        return {"per_version_s": (float(published[end]) - float(published[warmup])) / versions,
                "train_step_s": statistics.median(step_s), "rollout_batch_s": statistics.median(map(float, batches)),
                "tasks_dispatched_per_version": dispatched / self.n / end, "run_id": run_id}


# -- 3. engine vs plain torch ---------------------------------------------------------------------------------
def bench_engine(work: Path, iters: int = 9) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from verl.trainer.ppo import core_algos

    from services.trainer.engine import PolicyEngine
    from shared.contracts.run_config import AlgorithmConfig

    model_dir = build_model(work / "engine-model", hidden=512, layers=4)
    B, P, R = 32, 32, 32
    g = torch.Generator().manual_seed(0)
    t = _random_batch(B, P, R, 8, g)
    algo = AlgorithmConfig(lr=1e-5)
    engine = PolicyEngine(str(model_dir), algo, micro_batch_size=B, group_size=8)
    old, _ = engine.log_probs(t)
    adv = torch.randn(B, R, generator=g)
    weights = torch.ones(B, R)

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    loss_fn = core_algos.get_policy_loss_fn("vanilla")

    def torch_step():
        logits = model(input_ids=t["input_ids"], attention_mask=t["attention_mask"],
                       position_ids=t["position_ids"]).logits[:, P - 1:-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, t["responses"].unsqueeze(-1)).squeeze(-1)
        loss = loss_fn(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=t["response_mask"],
                       loss_agg_mode="token-mean", config=engine.actor_config, rollout_is_weights=weights)[0]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad()

    # Interleaved, median of each: the machine is shared, so load changes between runs.
    engine_times, torch_times = timed_pair(lambda: engine.update(t, old, adv, weights), torch_step, iters)
    e, p = statistics.median(engine_times), statistics.median(torch_times)
    return {"engine_step_s": e, "torch_step_s": p, "engine_overhead_ratio": e / p,
            "engine_batch": f"{B} x {P + R} tokens, {engine.num_parameters / 1e6:.1f}M params, fp32, CPU"}


def timed_pair(a, b, iters: int) -> tuple[list[float], list[float]]:
    a(), b()  # warm-up
    out: tuple[list[float], list[float]] = ([], [])
    for _ in range(iters):
        for fn, times in ((a, out[0]), (b, out[1])):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return out


PARTS = ("engine", "async", "weight_sync", "step")


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="make bench-train: writes bench/results/train.json")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"comma-separated subset of {PARTS}; a subset updates those keys of the existing JSON")
    ap.add_argument("--small", action="store_true", help="weight_sync on a small model (a smoke run, not a figure)")
    ap.add_argument("--sync", choices=("both", "colocated", "link"), default="both",
                    help="weight_sync: the co-located (page-cache) case, the shaped-link case (root), or both")
    ap.add_argument("--versions", type=int, default=12, help="async: policy versions timed per run (>= 10)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    if unknown := set(parts) - set(PARTS):
        ap.error(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    result: dict = json.loads(args.out.read_text()) if set(parts) != set(PARTS) and args.out.exists() else {}
    redis_url, database_url, cleanup = private_backends()
    try:
        with tempfile.TemporaryDirectory(prefix="flywheel-bench-train-") as tmp:
            work = Path(tmp)
            for part, fn in (("engine", lambda: bench_engine(work)),
                             ("async", lambda: bench_async(work, redis_url, database_url, versions=args.versions)),
                             ("weight_sync", lambda: sync_parts(work, redis_url, database_url, args.small, args.sync)),
                             ("step", lambda: bench_step(work))):
                if part in parts:
                    log(f"{part} ...")
                    if part == "weight_sync" and args.sync == "both":  # replaced whole: nothing stale survives
                        result = {k: v for k, v in result.items()
                                  if not k.startswith("weight_sync") and k not in STALE_SYNC_KEYS}
                    result |= fn()
                    log(json.dumps(result))
    finally:
        cleanup()
    result["targets"] = {"weight_sync_delta_ratio": "< 1 (weight_sync_delta_s < raw_copy_s)", "async_speedup": ">= 1.67",
                         "engine_overhead_ratio": "<= 1.3", "step_packed_speedup": ">= 2 (CPU)"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


def private_backends():
    """Embedded Redis and Postgres in a temp folder (migrated), so the bench never touches shared data."""
    from infra.local.servers import PostgresServer, RedisServer
    from shared.platform.db.migrate import upgrade
    from shared.platform.settings import ServiceSettings

    folder = Path(tempfile.mkdtemp(prefix="flywheel-bench-db-"))
    redis_server, pg = RedisServer(folder / "redis", unix_socket=True), PostgresServer(folder / "pg")
    redis_server.start()
    pg.start()
    url = ServiceSettings(database_url=pg.url).database_url
    upgrade(url)

    def cleanup():
        pg.stop()
        redis_server.stop()
        shutil.rmtree(folder, ignore_errors=True)

    return redis_server.url, url, cleanup


if __name__ == "__main__":
    main()
