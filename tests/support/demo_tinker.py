"""`make demo-tinker`: the demo's task (a number word -> its digit, tests/support/recall.py) learned from chance
through the real `tinker` SDK, on the local stack (weight server, rollout worker, trainer, controller, API).

A plain Tinker RL loop, as a user writes it: each step saves the adapter for sampling
(`save_weights_and_get_sampling_client`), samples every question on the rollout worker, scores the one-token
answers, and trains on them with `importance_sampling` (GRPO's advantage: the reward's z-score in its group).
Training samples at temperature 1.5 (importance_sampling corrects for it: a question whose answer the policy has
all but lost is still found); every 10 steps the policy itself is evaluated at temperature 1. It passes (exit 0)
when that reward climbs from chance (<= 0.3) to >= 0.8 with every question >= 0.5 -> bench/results/demo_tinker.json.
"""

from __future__ import annotations

import argparse
import secrets
import sys
import tempfile
import time
from pathlib import Path

from tests.support.demo import LORA_INIT_STD, prompt_ids, write_result
from tests.support.recall import ANSWERS, WORDS, recall_reward
from tests.support.tiny_model import build_number_model

OUT = Path("bench/results/demo_tinker.json")
BAR = {"initial_reward_max": 0.3, "final_reward_min": 0.8, "question_accuracy_min": 0.5}
EVAL_EVERY = 10  # steps between evaluations of the policy itself (temperature 1, not trained on)


def rl_loop(base_url: str, key: str, tokenizer, steps: int, samples: int, lr: float, temperature: float,
            log=print) -> list[dict]:
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=base_url, api_key=key)
    training = service.create_lora_training_client(base_model="number", rank=8).result()
    prompts = {word: prompt_ids(tokenizer, word) for word in WORDS}
    curve, evals = [], []
    try:
        for step in range(steps):
            started = time.monotonic()
            sampler = training.save_weights_and_get_sampling_client().result()
            if step % EVAL_EVERY == 0:
                evals.append({"step": step} | evaluate(sampler, prompts, tokenizer, samples))
                log(f"step {step:3d}  eval at temperature 1: reward {evals[-1]['reward']:.3f}")
            futures = {w: sampler.sample(types.ModelInput.from_ints(p), samples,
                                         types.SamplingParams(max_tokens=1, temperature=temperature))
                       for w, p in prompts.items()}
            datums, rewards, by_word, groups = [], [], {}, []
            for word, future in futures.items():
                seqs = future.result().sequences
                scores = [recall_reward(ANSWERS[word], tokenizer.decode(s.tokens, skip_special_tokens=True))
                          for s in seqs]
                rewards += scores
                by_word[word] = round(sum(scores) / len(scores), 3)
                groups.append((word, seqs, scores))
            for word, seqs, scores in groups:
                mean = sum(scores) / len(scores)
                std = (sum((x - mean) ** 2 for x in scores) / len(scores)) ** 0.5
                for s, r in zip(seqs, scores, strict=True):
                    full = prompts[word] + list(s.tokens)
                    n = len(full) - 1
                    datums.append(types.Datum(
                        model_input=types.ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={"target_tokens": full[1:],
                                        "logprobs": [0.0] * (n - len(s.tokens)) + list(s.logprobs),
                                        "advantages": [0.0] * (n - len(s.tokens)) + [(r - mean) / (std + 1e-6)] * len(s.tokens)}))
            training.forward_backward(datums, "importance_sampling").result()
            training.optim_step(types.AdamParams(learning_rate=lr)).result()
            reward = sum(rewards) / len(rewards)
            curve.append({"step": step, "reward": round(reward, 4), "by_question": by_word,
                          "step_s": round(time.monotonic() - started, 2)})
            log(f"step {step:3d}  reward {reward:.3f}  ({curve[-1]['step_s']:.1f}s)")
        sampler = training.save_weights_and_get_sampling_client().result()
        evals.append({"step": steps} | evaluate(sampler, prompts, tokenizer, samples))
        log(f"final eval at temperature 1: reward {evals[-1]['reward']:.3f}, by question {evals[-1]['by_question']}")
    finally:
        service.close("success").result()
    return curve, evals


def evaluate(sampler, prompts: dict[str, list[int]], tokenizer, samples: int) -> dict:
    """The policy's own reward (temperature 1, not trained on): per question and overall."""
    from tinker import types

    futures = {w: sampler.sample(types.ModelInput.from_ints(p), samples, types.SamplingParams(max_tokens=1))
               for w, p in prompts.items()}
    by_word = {}
    for word, future in futures.items():
        seqs = future.result().sequences
        by_word[word] = round(sum(recall_reward(ANSWERS[word], tokenizer.decode(s.tokens, skip_special_tokens=True))
                                  for s in seqs) / len(seqs), 3)
    return {"reward": round(sum(by_word.values()) / len(by_word), 4), "by_question": by_word}


def judge(evals: list[dict]) -> list[str]:
    first, last = evals[0], evals[-1]
    problems = []
    if first["reward"] > BAR["initial_reward_max"]:
        problems.append(f"the first reward {first['reward']:.2f} is not chance (<= {BAR['initial_reward_max']})")
    if last["reward"] < BAR["final_reward_min"]:
        problems.append(f"the final reward {last['reward']:.2f} < {BAR['final_reward_min']}")
    lagging = {w: r for w, r in last["by_question"].items() if r < BAR["question_accuracy_min"]}
    if lagging:
        problems.append(f"questions below {BAR['question_accuracy_min']}: {lagging}")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--samples", type=int, default=32, help="samples per question per step")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--temperature", type=float, default=1.5,
                        help="sampling temperature: importance_sampling corrects for it (the sampler's logprobs)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from infra.local.ports import free_port
    from infra.local.stack import LocalStack

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="demo-tinker-") as tmp:
        data_dir = Path(tmp)
        model_dir = build_number_model(data_dir / "models" / "number", init_std=LORA_INIT_STD)
        token = secrets.token_hex(16)
        env = {"API_TOKEN": token, "API_PORT": str(free_port())}
        with LocalStack(data_dir=data_dir, env=env) as stack:
            stack.start(services=["weight-server", "rollout-worker", "trainer", "controller", "api"])
            stack.wait_healthy(180)
            print(f"stack up in {time.monotonic() - started:.0f}s; {args.steps} steps of 10 questions x "
                  f"{args.samples} samples through the tinker SDK")
            curve, evals = rl_loop(stack.api_url, "tml-" + token, AutoTokenizer.from_pretrained(model_dir),
                                   args.steps, args.samples, args.lr, args.temperature)
    problems = judge(evals)
    result = {"task": "recall (number word -> digit)", "model": "number (random init, LoRA rank 8)",
              "loss": "importance_sampling", "steps": args.steps, "samples_per_question": args.samples,
              "lr": args.lr, "temperature": args.temperature, "evals": evals, "curve": curve, "bar": BAR, "passed": not problems, "problems": problems,
              "wall_s": round(time.monotonic() - started, 1)}
    write_result(args.out, result)
    print(f"-> {args.out}: {'passed' if not problems else 'FAILED: ' + '; '.join(problems)}")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
