"""Built-in agents (rLLM-compatible): MathAgent, ToolAgent (Qwen `<tool_call>` format), FrozenLakeAgent,
CodeAgent, DigitsAgent. Each keeps the chat history it sends to the model and records one `Step` per model call; the
rollout worker fills each step's token ids, logprobs, policy version and (after env.step) reward and done."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from shared.sdk.agent import Action, BaseAgent, Step, Trajectory

BOXED_INSTRUCTION = "Let's think step by step, and put your final answer within \\boxed{}."


class ChatAgent(BaseAgent):
    """History keeping shared by the built-ins: subclasses turn observations into user/tool messages.
    `keep_last_turns` (agent args): a sliding window, the system prompt + the last K turns (a turn starts at a
    user message), the way long-horizon agents stay under their context; each cut starts a new training sequence
    (docs/agents-and-envs.md#token-bookkeeping)."""

    def __init__(self, system_prompt: str | None = None, accumulate_thinking: bool = True,
                 keep_last_turns: int | None = None):
        if keep_last_turns is not None and (not isinstance(keep_last_turns, int) or keep_last_turns < 1):
            raise ValueError(f"agent arg keep_last_turns must be a positive integer (turns of history kept), "
                             f"got {keep_last_turns!r}")
        self.system_prompt = system_prompt
        self.accumulate_thinking = accumulate_thinking
        self.keep_last_turns = keep_last_turns
        self.reset()

    def reset(self) -> None:
        self._trajectory = Trajectory()
        self.messages: list[dict[str, Any]] = []
        if self.system_prompt:
            self.messages.append({"role": "system", "content": self.system_prompt})

    @property
    def chat_completions(self) -> list[dict[str, Any]]:
        return self.messages

    @property
    def trajectory(self) -> Trajectory:
        return self._trajectory

    def update_from_env(self, observation: Any, reward: float, done: bool, info: dict, **kwargs) -> None:
        if done:
            return
        for message in self.observation_messages(observation):
            self.messages.append(message)
        if self.keep_last_turns is not None:
            self.messages = _last_turns(self.messages, self.keep_last_turns)

    def observation_messages(self, observation: Any) -> list[dict[str, Any]]:
        raise NotImplementedError

    def update_from_model(self, response: str, **kwargs) -> Action:
        content = response
        if not self.accumulate_thinking and "</think>" in response:
            content = response.rsplit("</think>", 1)[1].lstrip()
        self.messages.append({"role": "assistant", "content": content})
        action = self.parse_action(response)
        thought = response.rsplit("</think>", 1)[0] if "</think>" in response else ""
        self._trajectory.steps.append(Step(
            chat_completions=copy.deepcopy(self.messages), thought=thought, action=action, model_response=response,
        ))
        return Action(action=action)

    def parse_action(self, response: str) -> Any:
        return response


def _last_turns(messages: list[dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """The system messages + everything from the k-th last user message on."""
    starts = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if len(starts) <= k:
        return messages
    return [m for m in messages[: starts[0]] if m.get("role") == "system"] + messages[starts[-k]:]


class MathAgent(ChatAgent):
    """rLLM's MathAgent: the question with a boxed-answer instruction; later turns ask for a re-check."""

    def observation_messages(self, observation: Any) -> list[dict[str, Any]]:
        if not self._trajectory.steps:
            if not isinstance(observation, dict) or not ("question" in observation or "problem" in observation):
                raise ValueError("MathAgent expects the first observation to be a dict with a 'question'")
            question = observation.get("question") or observation["problem"]
            return [{"role": "user", "content": f"{question} {BOXED_INSTRUCTION}"}]
        return [{"role": "user", "content": "Your previous answer may contain a mistake. Please review it "
                                            "carefully and answer again. Put your final answer within \\boxed{}."}]


TOOL_SYSTEM = """You are a helpful assistant that solves problems, using tools when useful.

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>
When you are done, give the final answer without a tool call."""

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_tool_calls(response: str) -> list[dict[str, Any]]:
    """Qwen-format tool calls in a response. A call that is not valid JSON becomes a call of the tool
    `invalid_tool_call` so the env answers with an error observation (the model learns the format)."""
    calls = []
    for body in TOOL_CALL.findall(response):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append({"name": "invalid_tool_call", "arguments": {}, "error": str(e)})
            continue
        if not isinstance(call, dict):
            calls.append({"name": "invalid_tool_call", "arguments": {}, "error": "not a JSON object"})
            continue
        args = call.get("arguments", {})
        if isinstance(args, str):  # some models double-encode the arguments
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = {}
        calls.append({"name": call.get("name"), "arguments": args})
    return calls


class ToolAgent(ChatAgent):
    """Tool use in Qwen's format: tools listed in the system prompt, calls as <tool_call>{json}</tool_call>,
    results fed back as `tool` messages. A response without tool calls is the final answer."""

    def __init__(self, system_prompt: str | None = None, instruction: str = BOXED_INSTRUCTION, **kwargs):
        self.instruction = instruction
        self.base_system_prompt = system_prompt
        super().__init__(system_prompt=None, **kwargs)

    def observation_messages(self, observation: Any) -> list[dict[str, Any]]:
        if "tool_outputs" in observation:
            return [{"role": "tool", "content": str(o["content"])} for o in observation["tool_outputs"]]
        tools = "\n".join(json.dumps(t) for t in observation.get("tools", []))
        system = self.base_system_prompt or TOOL_SYSTEM.format(tools=tools)
        question = observation.get("question") or observation.get("problem") or ""
        return [{"role": "system", "content": system}, {"role": "user", "content": f"{question} {self.instruction}"}]

    def parse_action(self, response: str) -> Any:
        calls = parse_tool_calls(response)
        return {"tool_calls": calls} if calls else response


FROZENLAKE_SYSTEM = """You are walking on a frozen lake shown as a grid: P is you, S the start, F frozen (safe),
H a hole (falling in ends the game), G the goal. Reach G. Answer with one move, Left, Down, Right or Up,
inside \\boxed{}, e.g. \\boxed{Right}."""


class FrozenLakeAgent(ChatAgent):
    DIRECTIONS = ("left", "down", "right", "up")

    def __init__(self, system_prompt: str | None = FROZENLAKE_SYSTEM, **kwargs):
        super().__init__(system_prompt=system_prompt, **kwargs)

    def observation_messages(self, observation: Any) -> list[dict[str, Any]]:
        text = f"Current map:\n{observation['grid']}"
        if observation.get("error"):
            text = f"Your last move was not understood ({observation['error']}).\n" + text
        return [{"role": "user", "content": text + "\nYour move?"}]

    def parse_action(self, response: str) -> Any:
        from shared.tasks.answers import final_answer_text, last_boxed

        text = final_answer_text(response) or ""
        boxed = last_boxed(text)
        candidates = [boxed] if boxed else re.findall(r"[A-Za-z]+", text)[::-1]
        for word in candidates:
            if word and word.strip().lower() in self.DIRECTIONS:
                return word.strip().capitalize()
        return "invalid"


class CodeAgent(ChatAgent):
    """Shows the problem, asks for a ```python block; test failures come back as feedback."""

    INSTRUCTION = "Write a Python solution. Put the complete code in one ```python code block."

    def observation_messages(self, observation: Any) -> list[dict[str, Any]]:
        if "feedback" in observation:
            return [{"role": "user", "content": observation["feedback"] + "\nPlease fix the code."}]
        question = observation.get("question") or observation.get("prompt") or observation.get("problem") or ""
        return [{"role": "user", "content": f"{question}\n\n{self.INSTRUCTION}"}]


class DigitsAgent(ChatAgent):
    """The digits env's agent (services/env_worker/builtin/envs.py: DigitsEnv): each word the env says is one user message,
    each answer one assistant message, in one growing chat."""

    def observation_messages(self, observation: Any) -> list[dict[str, Any]]:
        if not isinstance(observation, dict) or "word" not in observation:
            raise ValueError(f"DigitsAgent expects observations like {{'word': 'seven'}}, got {observation!r}")
        return [{"role": "user", "content": str(observation["word"])}]


class RecallAgent(BaseAgent):
    """Sends the question alone as the user message (the number model's tokenizer knows no other words) and
    acts with the model's text."""

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
