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
def build_tiny_model(folder: Path, *, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """Random-init Qwen2 + a byte-level BPE tokenizer trained on a few strings (~60 tokens, 10 digits)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.BPEDecoder()
    corpus = ["digit? 0 1 2 3 4 5 6 7 8 9", "the quick brown fox jumps over a lazy dog", "hello world"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=64, special_tokens=["<unk>", "<|endoftext|>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>")
    fast.save_pretrained(folder)
    config = Qwen2Config(vocab_size=len(fast), hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=True,
                         eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def write_result(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))


# -- in-process loop (sampler and trainer in one process; the services are not involved) --------------------
def sample_results(model, tokenizer, run_id: str, version: int, step: int, tasks: int, n: int) -> list:
    """Sample one token per (task, sample) with the HF model, as a rollout worker would, as EpisodeResults."""
    import torch

    from shared.messages import EpisodeResult, TrajectoryRecord
    from shared.types import TerminationReason

    prompt = tokenizer(PROMPT).input_ids
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].float()
    logp = torch.log_softmax(logits, -1)
    tokens = torch.multinomial(logp.exp(), tasks * n, replacement=True).tolist()
    results = []
    for i, token in enumerate(tokens):
        reward = digit_reward(tokenizer.decode([token]))
        traj = TrajectoryRecord(uid=f"{step}-{i}", reward=reward, termination_reason=TerminationReason.ENV_DONE,
                                prompt_ids=prompt, response_ids=[token], loss_mask=[1],
                                logprobs=[float(logp[token])], versions=[version])
        results.append(EpisodeResult(
            run_id=run_id, task_id=f"t{step}-{i // n}", sample_idx=i % n, status="completed",
            termination_reason=TerminationReason.ENV_DONE, reward=reward, is_correct=reward > 0,
            trajectories=[traj], batch_idx=step))
    return results


def run_inprocess(model_dir: Path, steps: int = 12, tasks: int = 8, n: int = 8, lr: float = 2e-3,
                  log=print) -> list[float]:
    """Train `steps` versions in one process; returns mean reward of the samples each version produced."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.trainer.batch import GroupBuffer, samples_from_result
    from services.trainer.engine import PolicyEngine
    from services.trainer.learner import Learner
    from shared.run_config import AlgorithmConfig

    algo = AlgorithmConfig(adv_estimator="grpo", lr=lr, grad_clip=1.0)
    engine = PolicyEngine(str(model_dir), algo, group_size=n, micro_batch_size=tasks * n)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    learner = Learner(engine, algo, tokenizer.pad_token_id)
    rewards = []
    for version in range(steps):
        buffer = GroupBuffer(n, need_greedy=False)
        for result in sample_results(model, tokenizer, "inprocess", version, version, tasks, n):
            for s in samples_from_result(result):
                buffer.add(s)
        metrics = learner.step(buffer.complete_groups(), version)
        rewards.append(metrics["reward_mean"])
        log(f"version {version:3d}  reward {metrics['reward_mean']:.3f}  grad_norm {metrics.get('grad_norm', 0):.3f}")
        export = model_dir.parent / "export"
        engine.export_hf(export)
        model.load_state_dict(load_file(export / "model.safetensors"), strict=False)  # hot swap in place
    return rewards
