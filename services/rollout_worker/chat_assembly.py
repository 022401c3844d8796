"""Token-in/token-out bookkeeping for agent programs that call the gateway (OpenAI chat/completions format).

Per session and per agent name an `AgentCalls` keeps segments; a segment becomes one trajectory. A call that
extends a segment's messages with the reply we returned extends its prompt with the generated ids, exactly as
generated: nothing the model produced is re-tokenized. A call that extends no segment opens a new one; one
that shares a start with a segment is a counted *mismatch* and a separate trajectory, so no trajectory is ever
misaligned. Tool calls are parsed from the model's text, and our assistant messages are rendered back as the
raw generated text.

More: docs/agents-and-envs.md#token-bookkeeping
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from services.rollout_worker.assembly import ChatTokenizer, extend_context
from shared.sdk.types import Step, Trajectory

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
FALLBACK_TOOL_PROMPT = (
    "You can call these tools. To call one, write "
    '<tool_call>{{"name": <tool name>, "arguments": <arguments object>}}</tool_call>.\n'
    "Tools: {tools}"
)


class BadRequest(ValueError):
    """The request is malformed; the message says what to change (answered as HTTP 400)."""


# -- OpenAI messages <-> template messages -----------------------------------------------------------------
def text_of(content: Any) -> str:
    """OpenAI content: a string, None, or a list of parts ({"type": "text", "text": ...})."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text"):
                parts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                parts.append(part)
            else:
                raise BadRequest(f"unsupported content part {part!r}: only text parts are supported")
        return "".join(parts)
    raise BadRequest(f"message content must be a string or a list of text parts, got {type(content).__name__}")


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def reply_key(content: Any, tool_calls: list | None) -> str:
    """What identifies an assistant reply when the client sends it back (ids and formatting aside)."""
    calls = [(c.get("function", {}).get("name"), _arguments(c.get("function", {}).get("arguments")))
             for c in tool_calls or []]
    return json.dumps([text_of(content), calls], sort_keys=True, default=str)


def tool_call_text(name: str, arguments: Any) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "</tool_call>"


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """(content without the tool-call blocks, OpenAI tool_calls). A block that is not valid JSON with a
    `name` stays in the content: the model made a malformed call and the agent sees what it wrote."""
    calls: list[dict] = []
    kept: list[str] = []
    pos = 0
    for m in TOOL_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", {})
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": obj["name"],
                                   "arguments": args if isinstance(args, str) else json.dumps(args)}})
    kept.append(text[pos:])
    return "".join(kept).strip() if calls else text, calls


class ChatFormat:
    """Renders OpenAI messages (+ tools) with the run's chat template."""

    def __init__(self, chat: ChatTokenizer):
        self.chat = chat
        template = getattr(chat.tokenizer, "chat_template", None) or ""
        self.native_tools = isinstance(template, str) and "tools" in template

    def template_messages(self, messages: list[dict], tools: list | None, replies: dict[str, str]) -> list[dict]:
        """OpenAI messages -> what the template renders. Assistant messages we produced become their raw text."""
        if not isinstance(messages, list) or not messages:
            raise BadRequest("`messages` must be a non-empty list of {role, content} objects")
        out: list[dict] = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest(f"messages[{i}] must be an object with a string `role`")
            role = m["role"]
            if role == "developer":
                role = "system"
            if role == "assistant":
                raw = replies.get(reply_key(m.get("content"), m.get("tool_calls")))
                if raw is not None:
                    out.append({"role": "assistant", "content": raw})
                elif self.native_tools and m.get("tool_calls"):
                    calls = [{"type": "function", "function": {"name": c["function"]["name"],
                                                                "arguments": _arguments(c["function"]["arguments"])}}
                             for c in m["tool_calls"]]
                    out.append({"role": "assistant", "content": text_of(m.get("content")), "tool_calls": calls})
                else:  # a message we did not produce (few-shot, edited): written in the tool-call syntax
                    calls = [tool_call_text(c["function"]["name"], _arguments(c["function"]["arguments"]))
                             for c in m.get("tool_calls") or []]
                    out.append({"role": "assistant", "content": "\n".join([text_of(m.get("content")), *calls])
                                .strip() if calls else text_of(m.get("content"))})
            elif role == "tool":
                msg = {"role": "tool", "content": text_of(m.get("content"))}
                if self.native_tools and m.get("tool_call_id"):
                    msg["tool_call_id"] = m["tool_call_id"]
                out.append(msg)
            elif role in ("system", "user"):
                out.append({"role": role, "content": text_of(m.get("content"))})
            else:
                raise BadRequest(f"messages[{i}]: unsupported role {role!r} (system, developer, user, assistant, "
                                 "tool)")
        if tools and not self.native_tools:
            functions = [t.get("function", t) for t in tools]
            prompt = FALLBACK_TOOL_PROMPT.format(tools=json.dumps(functions, ensure_ascii=False))
            if out[0]["role"] == "system":
                out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
            else:
                out.insert(0, {"role": "system", "content": prompt})
        return out

    def render(self, messages: list[dict], tools: list | None, add_generation_prompt: bool) -> str:
        kwargs = {"tools": tools} if tools and self.native_tools else {}
        return self.chat.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                       tokenize=False, **kwargs)


# -- per-agent segments ------------------------------------------------------------------------------------
@dataclass
class Segment:
    """One trajectory's worth of calls whose prompts extend each other token for token."""

    trajectory: Trajectory
    messages: list[dict] = field(default_factory=list)  # template messages of the last call
    tools: list | None = None
    prompt_text: str = ""  # completions: the last prompt
    context: list[int] = field(default_factory=list)  # last prompt ids + its completion ids
    raw_text: str = ""  # the last completion as generated
    from_mismatch: bool = False


@dataclass
class Prompt:
    ids: list[int]
    segment: Segment | None  # None: a new segment is opened when the call is recorded
    mismatch: bool = False
    messages: list[dict] = field(default_factory=list)
    tools: list | None = None
    prompt_text: str = ""
    steps_seen: int = 0  # the segment's step count when this prompt was made


class AgentCalls:
    """One agent's calls within one session: prompt ids before a model call, a Step after it."""

    def __init__(self, name: str, fmt: ChatFormat):
        self.name, self.fmt, self.chat = name, fmt, fmt.chat
        self.segments: list[Segment] = []
        self.replies: dict[str, str] = {}  # reply_key -> raw generated text, for every reply we returned
        self.mismatches = 0

    # chat ------------------------------------------------------------------------------------------------
    def chat_prompt(self, messages: list[dict], tools: list | None) -> Prompt:
        tmsgs = self.fmt.template_messages(messages, tools, self.replies)
        for seg in reversed(self.segments):
            delta = self._chat_delta(seg, tmsgs, tools)
            if delta is not None:
                return Prompt(seg.context + self.chat.encode(delta), seg, messages=tmsgs, tools=tools,
                              steps_seen=len(seg.trajectory.steps))
        ids = self.chat.encode(self.fmt.render(tmsgs, tools, add_generation_prompt=True))
        shared_start = any(seg.messages and seg.messages[0] == tmsgs[0] for seg in self.segments)
        return Prompt(ids, None, mismatch=shared_start, messages=tmsgs, tools=tools)

    def _chat_delta(self, seg: Segment, tmsgs: list[dict], tools: list | None) -> str | None:
        """Template text after the segment's generated ids, or None if `tmsgs` does not extend it."""
        if not seg.messages or tools != seg.tools:
            return None
        ended_with_eos = bool(seg.context) and seg.context[-1] in self.chat.eos_ids
        return extend_context(self.chat, lambda msgs, gen_prompt: self.fmt.render(msgs, tools, gen_prompt),
                              seg.messages, seg.raw_text, ended_with_eos, tmsgs)

    # completions -------------------------------------------------------------------------------------------
    def completion_prompt(self, prompt: str) -> Prompt:
        for seg in reversed(self.segments):
            done = seg.prompt_text + seg.raw_text
            if seg.prompt_text and prompt.startswith(done) and not (seg.context[-1:] and
                                                                    seg.context[-1] in self.chat.eos_ids):
                return Prompt(seg.context + self.chat.encode(prompt[len(done):]), seg, prompt_text=prompt,
                              steps_seen=len(seg.trajectory.steps))
        shared_start = any(seg.prompt_text and prompt.startswith(seg.prompt_text) for seg in self.segments)
        return Prompt(self.chat.encode(prompt), None, mismatch=shared_start, prompt_text=prompt)

    # after the model call ----------------------------------------------------------------------------------
    def record(self, prompt: Prompt, gen: Any, openai_messages: list[dict] | None, reply: dict | None) -> Step:
        seg = prompt.segment
        if seg is not None and len(seg.trajectory.steps) != prompt.steps_seen:
            seg = None  # a concurrent call of this agent extended the segment first: this one is a branch
        if seg is None:
            if prompt.mismatch:
                self.mismatches += 1
            seg = Segment(Trajectory(name=self.name), from_mismatch=prompt.mismatch)
            seg.trajectory.info["segment"] = len(self.segments)
            if prompt.mismatch:
                seg.trajectory.info["split_by_mismatch"] = True
            self.segments.append(seg)
        seg.messages, seg.tools, seg.prompt_text = prompt.messages, prompt.tools, prompt.prompt_text
        seg.context = list(prompt.ids) + list(gen.ids)
        seg.raw_text = gen.text
        if reply is not None:
            self.replies[reply_key(reply.get("content"), reply.get("tool_calls"))] = gen.text
        step = Step(prompt_ids=list(prompt.ids), response_ids=list(gen.ids), logprobs=list(gen.logprobs),
                    chat_completions=openai_messages or [{"role": "user", "content": prompt.prompt_text}],
                    model_response=gen.text, action=reply, weight_version=gen.weight_version,
                    response_versions=gen.versions or [], info={"finish_reason": gen.finish_reason})
        seg.trajectory.steps.append(step)
        return step

    def trajectories(self) -> list[Trajectory]:
        return [s.trajectory for s in self.segments]
