"""Token-exact multi-turn bookkeeping.

`PromptBuilder` makes each turn's prompt ids: when the chat history only grew, the new prompt is the previous
prompt + the generated ids, exactly as generated, + the tokens of the new messages, so nothing the model
produced is re-tokenized. `context_runs(steps)` cuts a trajectory where a turn's prompt does not extend the
accumulated context (an agent that summarized or dropped old turns); `assemble(steps)` turns one run into the
trainer's `TokenSequence` (observation and template tokens mask 0, completions mask 1).

More: docs/agents-and-envs.md#token-bookkeeping
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from shared.sdk.types import Step, TokenSequence


class ChatTokenizer:
    """The run's HF tokenizer seen as text <-> ids plus its chat template."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.eos_ids = set(_as_list(tokenizer.eos_token_id))
        self.eos_text = tokenizer.eos_token or ""
        # Fast tokenizers: encode with the Rust tokenizer directly (the same ids; transformers' __call__
        # wrapping cost more than the tokenization of a short prompt).
        self.backend = getattr(tokenizer, "backend_tokenizer", None)

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)

    def encode(self, text: str) -> list[int]:
        if self.backend is not None:
            return self.backend.encode(text, add_special_tokens=False).ids
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


class PromptBuilder:
    """Per trajectory: `prompt_ids(messages)` before a model call, `record(...)` after it."""

    def __init__(self, chat: ChatTokenizer):
        self.chat = chat
        self.context: list[int] | None = None  # previous prompt + response ids
        self.messages: list[dict] = []  # history at the previous call
        self.response_ids: list[int] = []
        self.response_text = ""

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        if self.context is not None:
            delta = self.delta_text(messages)
            if delta is not None:
                return self.context + self.chat.encode(delta)
        return self.chat.encode(self.chat.render(messages, add_generation_prompt=True))

    def record(self, messages: list[dict], prompt_ids: list[int], response_ids: list[int], text: str) -> None:
        self.messages = copy.deepcopy(messages)
        self.context = list(prompt_ids) + list(response_ids)
        self.response_ids, self.response_text = list(response_ids), text

    def delta_text(self, messages: list[dict]) -> str | None:
        """Template text that follows the generated ids, or None if the history was not just appended to."""
        ended_with_eos = bool(self.response_ids) and self.response_ids[-1] in self.chat.eos_ids
        return extend_context(self.chat, self.chat.render, self.messages, self.response_text, ended_with_eos,
                              messages)


def extend_context(chat: ChatTokenizer, render: Callable[[list[dict], bool], str], previous: list[dict],
                   generated: str, ended_with_eos: bool, messages: list[dict]) -> str | None:
    """The one rule that extends a model's context, for both token assemblers.

    The context is `render(previous, add_generation_prompt=True)` + the `generated` text (its ids kept as
    generated). When `messages` is `previous` + that reply + anything new, return the template text that follows
    the context (the template's closing of the reply, minus an EOS the model already emitted, + the new
    messages); else None: the history was rewritten, or the template is not append-only here.
    """
    n = len(previous)
    if len(messages) <= n or messages[:n] != previous:
        return None
    reply = messages[n]
    if reply.get("role") != "assistant" or reply.get("content") != generated:
        return None
    before = render(previous, True)
    through_reply = render(messages[: n + 1], False)
    full = render(messages, True)
    context_text = before + generated
    if not through_reply.startswith(context_text) or not full.startswith(through_reply):
        return None
    closing = through_reply[len(context_text):]  # e.g. "<|im_end|>\n"
    if ended_with_eos:
        if not closing.startswith(chat.eos_text):
            return None
        closing = closing[len(chat.eos_text):]  # the model already emitted the EOS token
    return closing + full[len(through_reply):]


def context_runs(steps: list[Step]) -> list[list[Step]]:
    """The maximal runs of turns that extend one context: a turn whose prompt does not start with the previous
    turn's prompt + response (the agent rewrote its history) starts the next run. Steps without tokens (a
    workflow's own) stay with the run they follow."""
    runs: list[list[Step]] = [[]]
    context: list[int] | None = None
    for step in steps:
        if step.prompt_ids:
            if context is not None and step.prompt_ids[: len(context)] != context:
                runs.append([])
            context = list(step.prompt_ids) + list(step.response_ids)
        runs[-1].append(step)
    return runs


def assemble(steps: list[Step]) -> TokenSequence:
    steps = [s for s in steps if s.prompt_ids]
    seq = TokenSequence()
    if not steps:
        return seq
    seq.prompt_ids = list(steps[0].prompt_ids)
    context = list(steps[0].prompt_ids)
    missing_logprobs = False
    for i, step in enumerate(steps):
        if i > 0:
            if step.prompt_ids[: len(context)] == context:
                new = step.prompt_ids[len(context):]
            else:
                seq.mismatch = True
                new = list(step.prompt_ids)
            _append(seq, new, 0, [0.0] * len(new), -1)
            context = list(step.prompt_ids)
        missing_logprobs = missing_logprobs or (bool(step.response_ids) and not step.logprobs)
        version = step.weight_version if step.weight_version is not None else -1
        _append(seq, step.response_ids, 1, step.logprobs or [0.0] * len(step.response_ids), version,
                step.response_versions if len(step.response_versions) == len(step.response_ids) else None)
        context += step.response_ids
    if seq.mismatch:
        seq.loss_mask = [0] * len(seq.loss_mask)
    if missing_logprobs:  # a step made without the engine (e.g. by a workflow): no logprobs is said, not guessed
        seq.logprobs = []
    return seq


def _append(seq: TokenSequence, ids: list[int], mask: int, logprobs: list[float], version: int,
            versions: list[int] | None = None) -> None:
    """`versions`: each token's policy version (a partial rollout's), else `version` for all."""
    seq.response_ids.extend(ids)
    seq.loss_mask.extend([mask] * len(ids))
    seq.logprobs.extend(logprobs)
    seq.versions.extend(versions if versions is not None else [version] * len(ids))
