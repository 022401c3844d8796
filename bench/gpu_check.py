"""The stack on a GPU in one prepared script: `make gpu-check` (python -m bench.gpu_check [--device cpu]).

Parts, each recorded as it ends (a part that fails is an `error` in its place; the others still run):
- `logprob`: the trainer's log-prob paths (verl's chunked torch kernel; `chunked_triton`, whose vocabulary math
  never holds fp32 logits) against an fp32 eager forward, then training-step MFU per variant on the 0.5B shape
  (16 x 1024 tokens, full-length and RL-shaped).
- `lora`: a LoRA step (rank 32, every linear layer), its adapter exported and swapped into the `hf` engine.
- `stack`: every service (embedded Redis and Postgres) with the trainer and a rollout worker on the device: the
  recall task learned through hot-reloaded versions, then a run of the 0.5B shape (tokens/s, MFU, publish ->
  serving per version).
`--device cpu` runs the same code on tiny shapes (tests/e2e/test_gpu_check_cpu.py runs it in CI), so
device time is never spent on a bug. `make gpu-wheels` prepares what a lent machine lacks (infra/gpu/wheels.txt).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import re
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from tests.support.gpu_smoke import VARIANTS, batch, build_model, run_variant, time_steps

# The 0.5B shape (Qwen2.5-0.5B's) on the GPU; a tiny one on CPU, where only the code path is checked.
SHAPES = {
    "cuda": {"layers": 24, "hidden": 896, "heads": 14, "kv_heads": 2, "intermediate": 4864, "vocab": 151936,
             "batch": 16, "seq": 1024, "steps": 3},
    "cpu": {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 512,
            "batch": 4, "seq": 64, "steps": 1},
}
LOGPROB_BACKENDS = ("torch", "chunked_triton")  # PolicyEngine's fused_backend
MFU_VARIANTS = ("padded_mb16", "padded_mb16_chunked_triton", "padded_mb16_chunked_triton_liger",
                "packed_16k_flex_chunked_triton_liger")  # packed_16k_flex: bench/results/gpu_smoke.json
# liger-kernel's own fused linear + log-prob runs, on Hopper, a CuTe DSL kernel whose libraries
# (nvidia-cutlass-dsl-libs-cu13, 92 MB) are over what a device call carries: not measured here.
LORA = {"lora_rank": 32, "lora_alpha": 64, "target_modules": "all-linear"}
# The recall run: the demo's (tests/support/demo.py) on the device; on CPU a few versions only check the path.
RECALL_STEPS = {"cuda": 100, "cpu": 3}
BIG_RUN = {"cuda": {"tasks": 8, "samples": 8, "response_tokens": 256, "steps": 4},
           "cpu": {"tasks": 2, "samples": 2, "response_tokens": 8, "steps": 2}}
BAR = {"final_reward_min": 0.8, "versions_hot_reloaded_min": 10}


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _free(device: str) -> None:
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def unavailable(options: dict, device: str) -> str | None:
    """Why an engine with these options cannot run here (None: it can)."""
    import importlib.util

    if options.get("fused_backend") == "chunked_triton" and (device != "cuda" or not importlib.util.find_spec("triton")):
        return "Triton kernels need CUDA (tests/unit/test_logprob_kernel.py checks them on CPU in Triton's interpreter)"
    if options.get("use_liger") and (device != "cuda" or not importlib.util.find_spec("liger_kernel")):
        return "liger-kernel's kernels need CUDA and the liger-kernel package"
    return None


# -- logprob ------------------------------------------------------------------------------------------------------
def eager_log_probs(model_dir: Path, t: dict, device: str):
    """The reference: an fp32 HF forward of the same weights, log_softmax over the whole vocabulary."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model = model.to(device).eval()
    prompt = t["prompts"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=t["input_ids"].to(device), attention_mask=t["attention_mask"].to(device),
                       position_ids=t["position_ids"].to(device)).logits[:, prompt - 1:-1]
        out = torch.log_softmax(logits.float(), -1).gather(-1, t["responses"].to(device).unsqueeze(-1)).squeeze(-1)
    del model, logits
    return out.cpu()


def logprob_part(model_dir: Path, shape: dict, device: str) -> dict:
    import torch

    from services.trainer.engine import PolicyEngine
    from shared.contracts.run_config import AlgorithmConfig
    from tests.support.trainer_batches import spread_batch

    cuda = device == "cuda"
    prompt = shape["seq"] // 4
    t = spread_batch(8, prompt, shape["seq"] - prompt, shape["vocab"])
    # before any engine: verl patches the model class's forward for its fused kernels
    reference = eager_log_probs(model_dir, t, device)
    mask = t["response_mask"].bool()
    # bf16 weights and activations on the GPU against fp32: the tolerance of tests/gpu; fp32 on CPU: rounding only
    atol, rtol = (0.05, 0.02) if cuda else (1e-4, 1e-4)
    checks = {}
    for backend in LOGPROB_BACKENDS:
        if why := unavailable({"fused_backend": backend}, device):
            checks[backend] = {"skipped": why}
            continue
        engine = PolicyEngine(str(model_dir), AlgorithmConfig(lr=1e-6), device=device,
                              dtype="bf16" if cuda else "fp32", micro_batch_size=4, group_size=4,
                              fused_backend=backend)
        ours, _ = engine.log_probs(t)
        diff = (ours.cpu().float() - reference)[mask].abs()
        close = torch.allclose(ours.cpu().float()[mask], reference[mask], atol=atol, rtol=rtol)
        checks[backend] = {"max_abs_diff": round(float(diff.max()), 5), "mean_abs_diff": round(float(diff.mean()), 6),
                           "tolerance": {"atol": atol, "rtol": rtol}, "equal_to_eager": bool(close)}
        log(f"log-probs {backend}: {checks[backend]}")
        del engine
        _free(device)
    batches = {"full": batch(shape["batch"], shape["seq"], shape["vocab"]),
               "rl": spread_batch(shape["batch"], prompt, shape["seq"] - prompt, shape["vocab"])}
    variants = []
    for name in MFU_VARIANTS:
        # the trainer service's kernel on CPU too: verl patches the model class once per process, for every engine
        options = {"fused_backend": "torch"} | VARIANTS[name]
        if why := unavailable(options, device):
            variants.append({"variant": name, "skipped": why})
            continue
        if not cuda:  # CPU: no flex attention kernel, token budgets sized for the tiny batch
            options.pop("attn_implementation", None)
            if "micro_batch_tokens" in options:
                options["micro_batch_tokens"] = shape["seq"] * 2
        try:
            out = run_variant(name, options, model_dir, batches, shape["steps"], device=device)
        except Exception as exc:  # one variant's failure (a kernel missing here) must not lose the others
            out = {"variant": name, "error": f"{type(exc).__name__}: {exc}"[:500]}
        variants.append(out)
        log(f"variant {json.dumps(out)}")
        _free(device)
    mfus = [(v[label]["mfu"], v["variant"], label) for v in variants for label in ("full", "rl") if label in v]
    best = max(mfus, default=(None, None, None))
    return {"checks": checks, "variants": variants, "best_mfu": best[0], "best_variant": f"{best[1]} ({best[2]})"}


# -- lora ---------------------------------------------------------------------------------------------------------
def lora_part(model_dir: Path, shape: dict, device: str, work: Path) -> dict:
    """A LoRA step on the shape's full batch, the adapter's export, and the `hf` engine's adapter swap: a new
    adapter (loaded as a PEFT adapter) and a new version of the same adapter (copied into its tensors)."""
    import torch

    from services.trainer.engine import PolicyEngine
    from shared.contracts.run_config import AlgorithmConfig

    cuda = device == "cuda"
    engine = PolicyEngine(str(model_dir), AlgorithmConfig(lr=1e-4), device=device, dtype="bf16" if cuda else "fp32",
                          micro_batch_size=16, group_size=4, lora=LORA, fused_backend="torch")
    trainable = sum(p.numel() for p in engine.actor.engine.module.parameters() if p.requires_grad)
    step = time_steps(engine, batch(shape["batch"], shape["seq"], shape["vocab"]), shape["steps"])
    exported = {}
    for v in (1, 2):
        started = time.perf_counter()
        engine.export_adapter(work / f"adapter-v{v}")
        exported[v] = time.perf_counter() - started
        if v == 1:
            time_steps(engine, batch(shape["batch"], shape["seq"], shape["vocab"]), 1)  # v2 differs from v1
    del engine
    _free(device)
    import multiprocessing

    # a fresh process: verl patched this one's model class for its fused kernels, which plain HF generate can't use
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        swapped = pool.apply(adapter_swap, (model_dir, work, device))
    out = {"trainable_params": trainable, "step": step, "export_s": round(exported[2], 4)} | swapped
    if cuda:
        out["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return out


def adapter_swap(model_dir: Path, work: Path, device: str) -> dict:
    """The `hf` engine serving the exported adapter: a new adapter, then its next version, then 64 requests."""
    from transformers import AutoTokenizer

    from services.rollout_worker.engines import AdapterView, SamplingParams, build_engine
    from shared.contracts.run_config import EngineConfig
    from shared.weights.manifest import BaseModelRef, base_model_digest
    from tests.support.demo import prompt_ids

    cuda = device == "cuda"

    async def swap() -> dict:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        cfg = EngineConfig(device=device, dtype="bfloat16" if cuda else "float32", max_batch_size=64)
        base = build_engine("hf", str(model_dir), cfg, tokenizer)
        view = AdapterView(base, "gpu-check")
        ref = BaseModelRef(name=str(model_dir), sha256=base_model_digest(str(model_dir)))
        times = {}
        for v, label in ((1, "adapter_load_new_s"), (2, "adapter_swap_same_shape_s")):
            started = time.perf_counter()
            await view.load_adapter(work / f"adapter-v{v}", v, ref)
            times[label] = round(time.perf_counter() - started, 4)
        prompt = prompt_ids(tokenizer, "seven")
        tokens = 32 if cuda else 4
        started = time.perf_counter()
        outs = await asyncio.gather(*(view.generate(prompt, SamplingParams(temperature=1.0), tokens) for _ in range(64)))
        gen_s = time.perf_counter() - started
        times |= {"served_version": view.version, "generate_64x_tokens_per_s": round(sum(len(o.ids) for o in outs) / gen_s)}
        await base.close()
        return times

    return asyncio.run(swap())


# -- stack --------------------------------------------------------------------------------------------------------
class ServingWatch:
    """Polls the rollout worker's `rollout_weight_version` gauge: when each version of a run began serving."""

    def __init__(self, metrics_url: str):
        self.url, self.seen, self._stop = metrics_url, {}, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> ServingWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)

    def _poll(self) -> None:
        import httpx

        with httpx.Client(timeout=2) as http:
            while not self._stop.is_set():
                try:
                    text = http.get(self.url).text
                except httpx.HTTPError:
                    text = ""
                for run_id, version in re.findall(r'rollout_weight_version\{run_id="([^"]+)"\} ([0-9.e+]+)', text):
                    self.seen.setdefault((run_id, int(float(version))), time.time())
                self._stop.wait(0.05)


def big_run_config(model_dir: Path, device: str, shape: dict) -> dict:
    from tests.support.demo import demo_config

    big = BIG_RUN[device]
    # lr: bf16 weights move by at least a rounding step at 1e-4 (at 1e-6 none would, and every delta were empty)
    config = demo_config(model_dir, big["steps"], big["tasks"], big["samples"], 1e-4, max_staleness=1,
                         engine={"device": device, "dtype": "bfloat16" if device == "cuda" else "float32",
                                 "max_batch_size": big["tasks"] * big["samples"]})
    return config | {"name": "gpu-check-0.5b", "max_response_tokens": big["response_tokens"],
                     "max_prompt_tokens": 64, "trajectory_timeout_s": 600}


def run_seconds(api, run_id: str) -> dict:
    """Rollout and trainer throughput of a run, from what the services stored (SQL through the API)."""
    from tests.support.demo import sql_rows

    rollout = sql_rows(api, """
        SELECT sum(t.response_tokens) AS tokens, extract(epoch FROM max(t.created_at) - min(t.created_at)) AS span_s
        FROM trajectories t WHERE t.run_id = '{run_id}'""", run_id)[0]
    trainer = {r["name"]: r["value"] for r in sql_rows(api, """
        SELECT name, percentile_cont(0.5) WITHIN GROUP (ORDER BY value) AS value FROM metrics
        WHERE run_id = '{run_id}' AND name IN ('tokens_per_s', 'step_s', 'mfu') AND step > 1 GROUP BY name""", run_id)}
    span = float(rollout["span_s"] or 0)
    return {"rollout_tokens": int(rollout["tokens"] or 0),
            "rollout_tokens_per_s": round(int(rollout["tokens"] or 0) / span) if span > 0 else None,
            "trainer_tokens_per_s": trainer.get("tokens_per_s"), "trainer_step_s": trainer.get("step_s"),
            "trainer_mfu": trainer.get("mfu")}


def publish_to_serving(api, run_id: str, watch: ServingWatch) -> list[dict]:
    """Per published version: its bytes and kind (full or delta), and seconds from the checkpoint's row to the
    rollout worker serving it."""
    from datetime import datetime

    out = []
    for c in sorted(api.get(f"/v1/runs/{run_id}/checkpoints").json()["data"], key=lambda c: c["version"]):
        created = datetime.fromisoformat(c["created_at"]).timestamp()
        served = watch.seen.get((run_id, c["version"]))
        out.append({"version": c["version"], "bytes": c["bytes"], "uri": c["uri"],
                    "publish_to_serving_s": round(served - created, 3) if served else None})
    return out


def stack_part(work: Path, shape: dict, device: str) -> dict:
    from tests.support.demo import (
        SERVICES,
        answers_by_version,
        demo_config,
        recall_stack,
        summarize,
        train_runs,
    )

    cuda = device == "cuda"
    # sdpa: flex attention compiles a kernel per new packed length, which a short run would spend its time on
    env = {"DEVICE": device, "DTYPE": "bf16" if cuda else "fp32", "ATTN_IMPLEMENTATION": "sdpa"}
    out: dict = {}
    import shutil

    if shutil.which("bwrap") is None:  # the lent GPU machine has no bubblewrap; the recall env runs no model code
        env["SANDBOX_MODES"] = "none"
        out["sandbox"] = "none: no bubblewrap on this machine (the recall task runs no model-written code)"
    started = time.monotonic()
    with recall_stack(work / "stack", SERVICES, env, log) as (stack, api, model_dir):
        steps = RECALL_STEPS[device]
        config = demo_config(model_dir, steps, 8, 32, 3e-3, max_staleness=1, engine={"device": device})
        [run_id], seconds = train_runs(api, [config], steps, time.monotonic() + 900, log)
        out["recall"] = summarize(answers_by_version(api, run_id)) | {"train_s": round(seconds, 1)}
        out["final_reward"] = out["recall"]["final_reward"]
        out["versions_hot_reloaded"] = out["recall"]["versions_hot_reloaded"]
        log(f"recall: reward {out['recall']['initial_reward']} -> {out['final_reward']}, "
            f"{out['versions_hot_reloaded']} versions hot-reloaded")
        big_dir = build_model(work / "big" / "model", shape["layers"], shape["hidden"], shape["heads"],
                              shape["kv_heads"], shape["intermediate"], shape["vocab"], device=device)
        _free(device)
        worker = stack.instance("rollout-worker")
        with ServingWatch(f"{worker.url}/metrics") as watch:
            [big_id], seconds = train_runs(api, [big_run_config(big_dir, device, shape)], BIG_RUN[device]["steps"],
                                           time.monotonic() + 900, log)
            time.sleep(1)
        run = api.get(f"/v1/runs/{big_id}").json()
        out["big"] = {"shape": shape, "run": BIG_RUN[device], "train_s": round(seconds, 1), "status": run["status"],
                      "error": run.get("error"), "policy_version": run["policy_version"],
                      **run_seconds(api, big_id), "versions": publish_to_serving(api, big_id, watch)}
        log(f"0.5B shape: {json.dumps({k: v for k, v in out['big'].items() if k != 'versions'})}")
    out["wall_s"] = round(time.monotonic() - started, 1)
    return out


# -- main ---------------------------------------------------------------------------------------------------------
PARTS = ("logprob", "lora", "stack")


def judge(result: dict) -> list[str]:
    """What falls short of the bar (the learning bar is the device's: on CPU a few versions only check the path)."""
    failures = [f"{p}: {result[p]['error'].splitlines()[0]}" for p in PARTS if "error" in result.get(p, {})]
    checks = result.get("logprob", {}).get("checks", {})
    failures += [f"log-probs of {b} differ from eager" for b, c in checks.items() if c.get("equal_to_eager") is False]
    stack = result.get("stack", {})
    if stack.get("big", {}).get("status") == "failed":
        failures.append("the 0.5B-shape run failed (its error is on the run: GET /v1/runs/<id>)")
    if result["device"] != "cpu" and "final_reward" in stack:
        if (stack["final_reward"] or 0) < BAR["final_reward_min"]:
            failures.append(f"recall reward {stack['final_reward']} < {BAR['final_reward_min']}")
        if stack["versions_hot_reloaded"] < BAR["versions_hot_reloaded_min"]:
            failures.append(f"{stack['versions_hot_reloaded']} versions hot-reloaded")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    parser.add_argument("--out", type=Path, default=Path("bench/results/gpu_check.json"))
    parser.add_argument("--logs-to", type=Path, default=None, help="also archive the stack's service logs here (.tar.gz)")
    args = parser.parse_args()

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device (--device cpu runs the same code on tiny shapes)"}))
        return 2
    shape = SHAPES[args.device]
    result: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                    "torch": torch.__version__, "shape": shape, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(tmp)
        model_dir = build_model(work / "model", shape["layers"], shape["hidden"], shape["heads"], shape["kv_heads"],
                                shape["intermediate"], shape["vocab"], device=args.device)
        for part in [p for p in args.parts.split(",") if p]:
            part_started = time.monotonic()
            log(f"part {part}")
            try:
                if part == "logprob":
                    result[part] = logprob_part(model_dir, shape, args.device)
                    result["best_mfu"] = result[part]["best_mfu"]
                elif part == "lora":
                    result[part] = lora_part(model_dir, shape, args.device, work)
                else:
                    result[part] = stack_part(work, shape, args.device)
            except Exception as exc:
                result[part] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"}
            result[part]["part_s"] = round(time.monotonic() - part_started, 1)
            _free(args.device)
            _write(args.out, result)
        if args.logs_to and (work / "stack" / "logs").is_dir():
            import shutil

            shutil.make_archive(str(args.logs_to).removesuffix(".tar.gz"), "gztar", work / "stack" / "logs")
    result["wall_s"] = round(time.monotonic() - started, 1)
    result["failures"] = judge(result)
    result["passed"] = not result["failures"]
    _write(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k not in PARTS}, indent=1))
    print("passed" if result["passed"] else "failed:\n  " + "\n  ".join(result["failures"]))
    return 0 if result["passed"] else 1


def _write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
