"""Gateway token bookkeeping (services/rollout_worker/chat_assembly.py) with the tiny tokenizer: tool-call
parsing, templates with and without native tools, EOS handling, completions, mismatches."""

from __future__ import annotations

import json

import pytest

from services.rollout_worker.assembly import ChatTokenizer, assemble
from services.rollout_worker.chat_assembly import AgentCalls, BadRequest, ChatFormat, parse_tool_calls
from services.rollout_worker.engines.base import Generation
from tests.support.tiny_model import CHAT_TEMPLATE, build_tokenizer

TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
NATIVE_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\nTools: ' + (tools | tojson) + '<|im_end|>\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}{{ '<tool_call>' + (c['function'] | tojson) + '</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def calls_for(tokenizer, template=CHAT_TEMPLATE) -> AgentCalls:
    tokenizer.chat_template = template
    return AgentCalls("agent", ChatFormat(ChatTokenizer(tokenizer)))


def gen(tokenizer, text, eos=True) -> Generation:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if eos else [])
    return Generation(ids, [-0.5] * len(ids), text, "stop" if eos else "length", 3)


def test_parse_tool_calls_keeps_malformed_blocks_as_content():
    content, calls = parse_tool_calls('Sure. <tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call>')
    assert content == "Sure." and calls[0]["function"] == {"name": "calc", "arguments": '{"x": 1}'}
    text = "<tool_call>{not json}</tool_call>"
    assert parse_tool_calls(text) == (text, [])
    assert parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>')[1] == []  # no name: not a call


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, NATIVE_TEMPLATE], ids=["fallback", "native"])
@pytest.mark.parametrize("eos", [True, False], ids=["eos", "cut"])
def test_tool_loop_extends_token_for_token(tokenizer, template, eos):
    agent = calls_for(tokenizer, template)
    assert agent.fmt.native_tools == (template is NATIVE_TEMPLATE)
    messages = [{"role": "user", "content": "6 * 7?"}]
    p1 = agent.chat_prompt(messages, TOOLS)
    assert "calc" in tokenizer.decode(p1.ids)
    raw = '<tool_call>{"name": "calc", "arguments": {"e": "6*7"}}</tool_call>'
    g1 = gen(tokenizer, raw, eos)
    content, tool_calls = parse_tool_calls(raw)
    reply = {"role": "assistant", "content": content or None, "tool_calls": tool_calls}
    agent.record(p1, g1, messages, reply)
    echoed = {**reply, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps({"e": "6*7"},
                                                                                            indent=2)}}
                                      for c in tool_calls]}  # the client re-serialized the arguments
    messages2 = messages + [echoed, {"role": "tool", "tool_call_id": tool_calls[0]["id"], "content": "42"}]
    p2 = agent.chat_prompt(messages2, TOOLS)
    assert p2.segment is not None and p2.ids[: len(p1.ids) + len(g1.ids)] == p1.ids + g1.ids
    agent.record(p2, gen(tokenizer, "42"), messages2, {"role": "assistant", "content": "42"})
    [traj] = agent.trajectories()
    tokens = assemble(traj.steps)
    assert not tokens.mismatch and agent.mismatches == 0
    assert tokenizer.decode(tokens.prompt_ids + tokens.response_ids).count("<|im_end|>") >= 3


def test_foreign_assistant_tool_calls_render_in_the_template(tokenizer):
    agent = calls_for(tokenizer, NATIVE_TEMPLATE)
    few_shot = [{"role": "user", "content": "1+1?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c0", "type": "function", "function": {"name": "calc", "arguments": '{"e": "1+1"}'}}]},
                {"role": "tool", "tool_call_id": "c0", "content": "2"}, {"role": "user", "content": "2+2?"}]
    text = tokenizer.decode(agent.chat_prompt(few_shot, TOOLS).ids)
    block = text.split("<tool_call>")[1].split("</tool_call>")[0]
    assert json.loads(block) == {"name": "calc", "arguments": {"e": "1+1"}}  # the template's own rendering


def test_new_conversation_is_not_a_mismatch_but_an_edited_one_is(tokenizer):
    agent = calls_for(tokenizer)
    first = [{"role": "user", "content": "a"}]
    agent.record(agent.chat_prompt(first, None), gen(tokenizer, "b"), first, {"role": "assistant", "content": "b"})
    other = agent.chat_prompt([{"role": "user", "content": "unrelated"}], None)
    assert other.segment is None and not other.mismatch
    edited = agent.chat_prompt(first + [{"role": "assistant", "content": "B"}, {"role": "user", "content": "c"}],
                               None)
    assert edited.segment is None and edited.mismatch
    agent.record(edited, gen(tokenizer, "d"), [], {"role": "assistant", "content": "d"})
    assert agent.mismatches == 1 and len(agent.trajectories()) == 2


def test_completions_reuse_ids_unless_the_model_ended_its_turn(tokenizer):
    agent = calls_for(tokenizer)
    p1 = agent.completion_prompt("Q: 1+1?\nA:")
    agent.record(p1, gen(tokenizer, " 2", eos=False), None, None)
    p2 = agent.completion_prompt("Q: 1+1?\nA: 2\nQ: 2+2?\nA:")
    assert p2.segment is not None and p2.ids[: len(p1.ids) + 1] == p1.ids + gen(tokenizer, " 2", False).ids
    agent.record(p2, gen(tokenizer, " 4"), None, None)  # ended with EOS: the next prompt cannot contain it
    p3 = agent.completion_prompt("Q: 1+1?\nA: 2\nQ: 2+2?\nA: 4\nQ: 3+3?")
    assert p3.segment is None and p3.mismatch


def test_bad_messages_say_what_is_wrong(tokenizer):
    agent = calls_for(tokenizer)
    with pytest.raises(BadRequest, match="non-empty list"):
        agent.chat_prompt([], None)
    with pytest.raises(BadRequest, match="unsupported role 'robot'"):
        agent.chat_prompt([{"role": "robot", "content": "x"}], None)
    with pytest.raises(BadRequest, match="only text parts"):
        agent.chat_prompt([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], None)


def test_concurrent_calls_extending_one_segment_branch_instead_of_misaligning(tokenizer):
    agent = calls_for(tokenizer)
    first = [{"role": "user", "content": "a"}]
    agent.record(agent.chat_prompt(first, None), gen(tokenizer, "b"), first, {"role": "assistant", "content": "b"})
    follow = first + [{"role": "assistant", "content": "b"}]
    p1 = agent.chat_prompt(follow + [{"role": "user", "content": "c1"}], None)
    p2 = agent.chat_prompt(follow + [{"role": "user", "content": "c2"}], None)  # in flight at the same time
    agent.record(p1, gen(tokenizer, "d1"), [], {"role": "assistant", "content": "d1"})
    agent.record(p2, gen(tokenizer, "d2"), [], {"role": "assistant", "content": "d2"})
    trajs = agent.trajectories()
    assert [len(t.steps) for t in trajs] == [2, 1] and agent.mismatches == 0
    assert all(not assemble(t.steps).mismatch for t in trajs)
