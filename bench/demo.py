"""The learning demo: `make demo` (python -m bench.demo).

A tiny random-init Qwen2 learns by RL, from scratch, on 2 CPU cores, to answer "digit?" with a digit token:
reward 1 when the one generated token is a digit (chance ~ 10 / vocab ~ 0.15). The toy env (`DigitEnv`) and
agent (`DigitAgent`) ship here as user components, plugged in by import path (`bench.demo:DigitEnv`).

Modes: `--inprocess` runs sampler and trainer in one process (verl engine + HF sampling, no services);
the default starts the local stack and a training run through the REST API and watches reward per version.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from shared.agent import Action, BaseAgent, BaseEnv, Step, Trajectory

PROMPT = "digit?"
DIGITS = re.compile(r"^\s*\d\s*$")


# -- toy task ------------------------------------------------------------------------------------------------
class DigitEnv(BaseEnv):
    """One step: reward 1.0 if the action (the model's decoded token) is a single digit, else 0.0."""

    def __init__(self, task: dict | None = None):
        self.task = task or {}

    def reset(self) -> tuple[Any, dict]:
        return PROMPT, {}

    def step(self, action: Any) -> tuple[Any, float, bool, dict]:
        return "", float(bool(DIGITS.match(str(action or "")))), True, {}

    @staticmethod
    def from_dict(info: dict) -> DigitEnv:
        return DigitEnv(info)


class DigitAgent(BaseAgent):
    """Sends the raw prompt (no chat template: the tiny tokenizer has none) and acts with the text."""

    def __init__(self, **_: Any):
        self._trajectory = Trajectory()
        self._messages: list[dict] = []

    @property
    def chat_completions(self) -> list[dict]:
        return self._messages

    @property
    def trajectory(self) -> Trajectory:
        return self._trajectory

    def reset(self) -> None:
        self._trajectory, self._messages = Trajectory(), []

    def update_from_env(self, observation: Any, reward: float, done: bool, info: dict, **kwargs) -> None:
        if self._trajectory.steps:
            self._trajectory.steps[-1].reward, self._trajectory.steps[-1].done = reward, done
        if observation:
            self._messages.append({"role": "user", "content": str(observation)})

    def update_from_model(self, response: str, **kwargs) -> Action:
        self._trajectory.steps.append(Step(chat_completions=list(self._messages), model_response=response,
                                           action=response))
        self._messages.append({"role": "assistant", "content": response})
        return Action(response)


def digit_reward(text: str) -> float:
    return float(bool(DIGITS.match(text)))


# -- tiny model ----------------------------------------------------------------------------------------------
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_model(folder: Path, *, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """Random-init Qwen2 + a BPE tokenizer trained on a few strings (~64 tokens, 10 of them digits) with a
    Qwen-style chat template, saved as an HF folder. Nothing is downloaded."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.BPEDecoder()
    corpus = ["digit? 0 1 2 3 4 5 6 7 8 9 user assistant system", "the quick brown fox jumps over a lazy dog"] * 20
    specials = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=64, special_tokens=specials))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>", chat_template=CHAT_TEMPLATE,
                                   additional_special_tokens=["<|im_start|>"])
    fast.save_pretrained(folder)
    config = Qwen2Config(vocab_size=len(fast), hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=True,
                         eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = fast.eos_token_id, fast.pad_token_id
    model.save_pretrained(folder)
    return folder


def prompt_ids(tokenizer) -> list[int]:
    messages = [{"role": "user", "content": PROMPT}]
    return tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False).input_ids


def write_result(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))


# -- in-process loop (sampler and trainer in one process; the services are not involved) --------------------
def sample_results(model, tokenizer, run_id: str, version: int, step: int, tasks: int, n: int) -> list:
    """Sample one token per (task, sample) with the HF model, as a rollout worker would, as EpisodeResults."""
    import torch

    from shared.messages import EpisodeResult, TrajectoryRecord
    from shared.types import TerminationReason

    prompt = prompt_ids(tokenizer)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].float()
    logp = torch.log_softmax(logits, -1)
    tokens = torch.multinomial(logp.exp(), tasks * n, replacement=True).tolist()
    results = []
    for i, token in enumerate(tokens):
        reward = digit_reward(tokenizer.decode([token], skip_special_tokens=True))
        traj = TrajectoryRecord(uid=f"{step}-{i}", reward=reward, termination_reason=TerminationReason.ENV_DONE,
                                prompt_ids=prompt, response_ids=[token], loss_mask=[1],
                                logprobs=[float(logp[token])], versions=[version])
        results.append(EpisodeResult(
            run_id=run_id, task_id=f"t{step}-{i // n}", sample_idx=i % n, status="completed",
            termination_reason=TerminationReason.ENV_DONE, reward=reward, is_correct=reward > 0,
            trajectories=[traj], batch_idx=step))
    return results


def run_inprocess_parts(model_dir: Path, tasks: int, n: int, lr: float):
    """The trainer's pieces without the service: (Learner, PolicyEngine, results -> GroupBuffer)."""
    from transformers import AutoTokenizer

    from services.trainer.batch import GroupBuffer, samples_from_result
    from services.trainer.engine import PolicyEngine
    from services.trainer.learner import Learner
    from shared.run_config import AlgorithmConfig

    algo = AlgorithmConfig(adv_estimator="grpo", lr=lr, grad_clip=1.0)
    engine = PolicyEngine(str(model_dir), algo, group_size=n, micro_batch_size=tasks * n)
    learner = Learner(engine, algo, AutoTokenizer.from_pretrained(model_dir).pad_token_id)

    def buffer_of(results) -> GroupBuffer:
        buffer = GroupBuffer(n, need_greedy=False)
        for result in results:
            for s in samples_from_result(result):
                buffer.add(s)
        return buffer

    return learner, engine, buffer_of


def run_inprocess(model_dir: Path, steps: int = 12, tasks: int = 8, n: int = 8, lr: float = 2e-3,
                  log=print) -> list[float]:
    """Train `steps` versions in one process; returns mean reward of the samples each version produced."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    learner, engine, buffer_of = run_inprocess_parts(model_dir, tasks, n, lr)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rewards = []
    for version in range(steps):
        results = sample_results(model, tokenizer, "inprocess", version, version, tasks, n)
        metrics = learner.step(buffer_of(results).complete_groups(), version)
        rewards.append(metrics["reward_mean"])
        log(f"version {version:3d}  reward {metrics['reward_mean']:.3f}  grad_norm {metrics.get('grad_norm', 0):.3f}")
        export = model_dir.parent / "export"
        engine.export_hf(export)
        model.load_state_dict(load_file(export / "model.safetensors"), strict=False)  # hot swap in place
    return rewards


# -- the full stack ------------------------------------------------------------------------------------------
def demo_config(model_dir: Path, steps: int, tasks: int, n: int, lr: float, max_staleness: int,
                stale_policy: str = "drop") -> dict:
    return {
        "name": "digit-demo", "kind": "train", "model": str(model_dir), "dataset": "digits",
        "agent": {"name": "bench.demo:DigitAgent"}, "env": {"name": "bench.demo:DigitEnv"},
        "engine": {"type": "hf", "max_batch_size": tasks * n}, "sampling": {"temperature": 1.0},
        "algorithm": {"adv_estimator": "grpo", "lr": lr, "grad_clip": 1.0},
        "samples_per_task": n, "tasks_per_batch": tasks, "max_prompt_tokens": 64, "max_response_tokens": 1,
        # Reload lag leaves a few samples one version past the bound: dropped (the default; the controller
        # dispatches replacement groups) or, with --stale-policy downweight, trained on with less weight.
        "max_staleness": max_staleness, "stale_policy": stale_policy, "total_steps": steps,
        "max_in_flight": 4 * tasks * n,
        "trajectory_timeout_s": 60, "env_step_timeout_s": 10,
    }


def run_stack(data_dir: Path, *, steps: int = 20, tasks: int = 8, n: int = 8, lr: float = 1e-2,
              max_staleness: int = 1, stale_policy: str = "drop", timeout_s: float = 600.0, env: dict | None = None,
              log=print) -> dict:
    """Start every service (embedded Redis/Postgres unless REDIS_URL/DATABASE_URL are set), create a training
    run through the REST API, print reward per policy version until `steps` versions are trained."""
    import secrets
    import time

    import httpx

    from infra.local_stack import LocalStack, free_port

    started = time.monotonic()
    model_dir = build_tiny_model(data_dir / "model")
    token = secrets.token_hex(16)
    services = ["weight-server", "env-worker", "rollout-worker", "trainer", "controller", "api"]
    env = {"API_TOKEN": token, "API_PORT": str(free_port()), **(env or {})}
    with LocalStack(data_dir=data_dir, env=env) as stack:
        stack.start(services=services)
        stack.wait_healthy(180)
        log(f"stack up in {time.monotonic() - started:.0f}s: {', '.join(services)}")
        api = httpx.Client(base_url=stack.api_url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
        rows = "\n".join(json.dumps({"task_id": f"d{i}", "question": PROMPT}) for i in range(steps * tasks))
        api.post("/v1/datasets", data={"name": "digits"},
                 files={"file": ("digits.jsonl", rows.encode())}).raise_for_status()
        run = api.post("/v1/runs", json=demo_config(model_dir, steps, tasks, n, lr, max_staleness, stale_policy))
        run.raise_for_status()
        run_id = run.json()["id"]
        log(f"run {run_id}: {steps} versions of {tasks} tasks x {n} samples, max_staleness {max_staleness}")
        by_version = watch(api, run_id, steps, started + timeout_s, log)
        api.post(f"/v1/runs/{run_id}/stop")
        published = len(api.get(f"/v1/runs/{run_id}/checkpoints").json()["items"])
    versions = sorted(v for v in by_version if v is not None)
    return {
        "initial_reward": by_version[versions[0]]["mean_reward"] if versions else None,
        "final_reward": by_version[versions[-1]]["mean_reward"] if versions else None,
        "versions_published": published, "versions_used_by_rollouts": len(versions),
        "reward_by_version": {v: round(by_version[v]["mean_reward"], 3) for v in versions},
        "wall_s": round(time.monotonic() - started, 1), "run_id": run_id,
    }


def watch(api, run_id: str, steps: int, deadline: float, log) -> dict:
    """Print each policy version's mean rollout reward as it completes; return them by version."""
    import time

    shown: set = set()
    items: dict = {}
    while time.monotonic() < deadline:
        run = api.get(f"/v1/runs/{run_id}").json()
        items = {i["policy_version"]: i for i in api.get(f"/v1/runs/{run_id}/rewards").json()["items"]}
        trained = run["policy_version"]
        for v in sorted(k for k in items if k is not None and k not in shown and k < trained):
            bar = "#" * int(40 * items[v]["mean_reward"])
            log(f"  v{v:<3d} reward {items[v]['mean_reward']:.2f} {bar:<40s} ({items[v]['num_trajectories']} traj)")
            shown.add(v)
        if trained >= steps or run["status"] in ("completed", "failed", "stopped"):
            if run["status"] == "failed":
                log(f"run failed: {run['error']}")
            return items
        time.sleep(1.0)
    log("timed out")
    return items


def main() -> None:
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inprocess", action="store_true", help="no services: sampler and trainer in-process")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--stale-policy", choices=("drop", "downweight"), default="drop",
                        help="samples older than max_staleness versions: dropped (and replaced) or down-weighted")
    parser.add_argument("--out", type=Path, default=Path("bench/results/demo.json"))
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="where the stack keeps its data and logs (default: a new .data/demo-* folder, kept)")
    args = parser.parse_args()
    Path(".data").mkdir(exist_ok=True)
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="demo-", dir=Path(".data").resolve()))
    if args.inprocess:
        rewards = run_inprocess(build_tiny_model(data_dir / "model"), steps=args.steps, lr=1e-2)
        result = {"initial_reward": rewards[0], "final_reward": rewards[-1], "mode": "inprocess"}
    else:
        result = run_stack(data_dir, steps=args.steps, max_staleness=args.max_staleness,
                           stale_policy=args.stale_policy)
        print(f"service logs: {data_dir / 'logs'}")
    write_result(args.out, result)
    print(json.dumps(result, indent=1))
    ok = (result["initial_reward"] or 1) <= 0.3 and (result["final_reward"] or 0) >= 0.8
    print("learned: reward {:.2f} -> {:.2f}".format(result["initial_reward"] or 0, result["final_reward"] or 0)
          + ("" if ok else "  (below the demo's bar)"))


if __name__ == "__main__":
    main()
