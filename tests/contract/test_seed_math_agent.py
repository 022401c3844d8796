"""The seed document's MathAgent, with only its imports changed, runs under the BaseAgent API."""

from __future__ import annotations

import copy

from shared.sdk.agent import Action, BaseAgent, Step, Trajectory


# --- verbatim from ../shared/seeds/000 (only the imports above differ) ------------------------------------
class MathAgent(BaseAgent):
    def __init__(self, accumulate_thinking=True):
        self.instruction = "Let's think step by step, and put your final answer within \\boxed{}."
        self._trajectory = Trajectory()
        self.messages = []
        self.accumulate_thinking = accumulate_thinking

    def update_from_env(self, observation, reward, done, info, **kwargs):
        if not self.trajectory.steps:
            question = observation["question"]
            formatted_observation = f"{question} {self.instruction}"
        else:
            formatted_observation = "Your previous answer may contain a mistake. Please review it."

        self.messages.append({"role": "user", "content": formatted_observation})

    def update_from_model(self, response, **kwargs):
        self.messages.append({"role": "assistant", "content": response})
        new_step = Step(chat_completions=copy.deepcopy(self.chat_completions))
        self.trajectory.steps.append(new_step)
        return Action(action=response)

    def reset(self):
        self._trajectory = Trajectory()
        self.messages = []

    @property
    def chat_completions(self):
        messages = copy.deepcopy(self.messages)
        if not self.accumulate_thinking:
            for msg in messages[:-1]:
                if msg["role"] == "assistant":
                    _, sep, after = msg["content"].partition("</think>")
                    if sep:
                        msg["content"] = after
        return messages

    @property
    def trajectory(self):
        return self._trajectory

    def get_current_state(self):
        assert self._trajectory.steps
        return self._trajectory.steps[-1]
# ----------------------------------------------------------------------------------------------------------


def test_two_turn_self_correction():
    agent = MathAgent(accumulate_thinking=False)
    agent.reset()
    agent.update_from_env({"question": "What is 2+3?"}, 0.0, False, {})
    assert agent.chat_completions[-1]["content"].startswith("What is 2+3? Let's think step by step")
    action = agent.update_from_model("<think>2+3=6</think> \\boxed{6}")
    assert isinstance(action, Action) and action.action.endswith("\\boxed{6}")
    agent.update_from_env({"question": "ignored"}, 0.0, False, {})
    assert agent.messages[-1]["content"].startswith("Your previous answer may contain a mistake")
    agent.update_from_model("<think>recheck</think> \\boxed{5}")

    steps = agent.trajectory.steps
    assert len(steps) == 2 and agent.get_current_state() is steps[-1]
    # accumulate_thinking=False strips earlier thinking from the history sent to the model
    assert steps[1].chat_completions[1]["content"] == " \\boxed{6}"
    assert steps[1].chat_completions[-1]["content"] == "<think>recheck</think> \\boxed{5}"
    assert agent.trajectory.is_cumulative() is False  # history was rewritten, so turns do not extend


def test_reset_clears_state_and_trajectory_is_rllm_shaped():
    agent = MathAgent()
    agent.update_from_env({"question": "1+1"}, 0.0, False, {})
    agent.update_from_model("\\boxed{2}")
    agent.reset()
    assert agent.messages == [] and agent.trajectory.steps == []
    assert isinstance(agent.trajectory, Trajectory) and agent.trajectory.uid
    assert BaseAgent.get_current_state(agent) is None
