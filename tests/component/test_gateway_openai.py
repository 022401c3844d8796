"""The agent-program gateway served in-process on a real port, driven by the unmodified `openai` SDK (only the
base URL set). A scripted engine produces known texts (the tiny model cannot be relied on to emit tool calls);
token ids are the tiny tokenizer's, so the token bookkeeping is exercised for real."""

from __future__ import annotations

import time
from types import SimpleNamespace

import openai
import pytest
from fixtures.rollout_stack import run_config

from services.rollout_worker.agent_program import build_episode
from services.rollout_worker.assembly import ChatTokenizer, assemble
from services.rollout_worker.chat_assembly import ChatFormat
from services.rollout_worker.engines.base import Generation, InferenceEngine, SamplingParams
from services.rollout_worker.gateway import Gateway
from shared.contracts.messages import RolloutTask
from shared.sdk.types import TerminationReason as TR
from tests.support.tiny_model import build_tokenizer

CALC = {"type": "function", "function": {"name": "calc", "description": "evaluate arithmetic",
                                         "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                                                        "required": ["expr"]}}}


class ScriptedEngine(InferenceEngine):
    """Answers each call with the next scripted text, as the tokenizer's ids + EOS, version 7."""

    def __init__(self, tokenizer, script: list[str]):
        self.tokenizer, self.script, self.prompts, self.max_tokens = tokenizer, list(script), [], []

    @property
    def version(self) -> int:
        return 7

    async def generate(self, prompt_ids, sampling: SamplingParams, max_tokens: int) -> Generation:
        self.prompts.append(list(prompt_ids))
        self.max_tokens.append(max_tokens)
        text = self.script.pop(0)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return Generation(ids, [-0.5] * len(ids), text, "stop", self.version)

    async def load_weights(self, folder, version):
        raise NotImplementedError


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture
async def gateway():
    gw = Gateway("127.0.0.1", 0)
    await gw.start()
    yield gw
    await gw.close()


def session_for(gateway, tokenizer, script, **config):
    engine = ScriptedEngine(tokenizer, script)
    cfg = run_config("unused-model", **{"max_response_tokens": 64, "max_prompt_tokens": 1024, **config})
    ctx = SimpleNamespace(config=cfg, chat=ChatTokenizer(tokenizer), engine=engine,
                          sampling=lambda greedy: SamplingParams())
    session = gateway.open(ctx, False, time.monotonic() + 60)
    client = openai.AsyncOpenAI(base_url=gateway.base_url(session), api_key="unused", max_retries=0)
    return session, client, engine


async def test_chat_completion_records_tokens(gateway, tokenizer):
    session, client, engine = session_for(gateway, tokenizer, ["The answer is 42."])
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    resp = await client.chat.completions.create(model="policy", messages=messages, logprobs=True)
    assert resp.choices[0].message.content == "The answer is 42."
    assert resp.choices[0].finish_reason == "stop" and resp.system_fingerprint == "flywheel-v7"
    assert [t.logprob for t in resp.choices[0].logprobs.content] == [-0.5] * resp.usage.completion_tokens
    [traj] = session.trajectories()
    [step] = traj.steps
    fmt = ChatFormat(ChatTokenizer(tokenizer))
    expected = ChatTokenizer(tokenizer).encode(fmt.render(messages, None, add_generation_prompt=True))
    assert step.prompt_ids == expected == engine.prompts[0]
    assert step.weight_version == 7 and len(step.response_ids) == resp.usage.completion_tokens
    assert step.response_ids[-1] == tokenizer.eos_token_id


async def test_tool_call_round_trip_is_one_token_exact_trajectory(gateway, tokenizer):
    script = ['Let me compute. <tool_call>{"name": "calc", "arguments": {"expr": "6 * 7"}}</tool_call>',
              "The answer is 42."]
    session, client, engine = session_for(gateway, tokenizer, script)
    messages = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "6 * 7?"}]
    first = await client.chat.completions.create(model="policy", messages=messages, tools=[CALC])
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and msg.content == "Let me compute."
    [call] = msg.tool_calls
    assert call.function.name == "calc" and call.function.arguments == '{"expr": "6 * 7"}'
    # The usual agent loop: append the assistant message as the SDK returned it, then the tool result.
    messages += [msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "42"}]
    second = await client.chat.completions.create(model="policy", messages=messages, tools=[CALC])
    assert second.choices[0].message.content == "The answer is 42." and not second.choices[0].message.tool_calls
    assert "calc" in tokenizer.decode(engine.prompts[0])  # the tools were described to the model
    [traj] = session.trajectories()
    assert len(traj.steps) == 2 and session.mismatches == 0
    s1, s2 = traj.steps
    context = s1.prompt_ids + s1.response_ids
    assert s2.prompt_ids[: len(context)] == context  # the generated ids were reused, not re-tokenized
    assert "<|im_start|>tool\n42<|im_end|>" in tokenizer.decode(s2.prompt_ids[len(context):])
    tokens = assemble(traj.steps)
    assert not tokens.mismatch and sum(tokens.loss_mask) == len(s1.response_ids) + len(s2.response_ids)


async def test_streaming_chat_and_tool_calls(gateway, tokenizer):
    script = ["Hello there.", '<tool_call>{"name": "calc", "arguments": {"expr": "1+1"}}</tool_call>']
    session, client, _ = session_for(gateway, tokenizer, script)
    stream = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}],
                                                  stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello there."
    assert chunks[-1].usage.completion_tokens > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    stream = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "add"}],
                                                  tools=[CALC], stream=True)
    calls = [tc for c in [c async for c in stream] if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert calls[0].function.name == "calc" and calls[0].function.arguments == '{"expr": "1+1"}'


async def test_edited_history_is_a_counted_mismatch_and_a_new_trajectory(gateway, tokenizer):
    session, client, _ = session_for(gateway, tokenizer, ["First answer.", "Second answer."])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Question one?"}]
    first = await client.chat.completions.create(model="policy", messages=messages)
    # The agent rewrites its own reply before continuing (e.g. drops reasoning): no longer token-exact.
    edited = messages + [{"role": "assistant", "content": first.choices[0].message.content.upper()},
                         {"role": "user", "content": "And two?"}]
    await client.chat.completions.create(model="policy", messages=edited)
    assert session.mismatches == 1
    trajs = session.trajectories()
    assert len(trajs) == 2 and trajs[1].info["split_by_mismatch"]
    assert all(not assemble(t.steps).mismatch for t in trajs)  # each trajectory aligned on its own


async def test_agents_by_model_name_and_header_are_separate_trajectories(gateway, tokenizer):
    session, client, _ = session_for(gateway, tokenizer, ["x = 4", "correct", "ok"])
    await client.chat.completions.create(model="solver", messages=[{"role": "user", "content": "solve"}])
    await client.chat.completions.create(model="judge", messages=[{"role": "user", "content": "judge x = 4"}])
    await client.chat.completions.create(model="any", messages=[{"role": "user", "content": "plan"}],
                                         extra_headers={"X-Flywheel-Agent": "planner"})
    assert [t.name for t in session.trajectories()] == ["solver", "judge", "planner"]
    assert session.mismatches == 0


async def test_completions_endpoint_extends_its_own_output(gateway, tokenizer):
    session, client, engine = session_for(gateway, tokenizer, ["2 + 2 = 4", "done"])
    engine.tokenizer_eos = None
    first = await client.completions.create(model="policy", prompt="Q: 2 + 2?\nA:", logprobs=1, max_tokens=8)
    assert first.choices[0].text == "2 + 2 = 4" and first.choices[0].logprobs.token_logprobs[0] == -0.5
    assert session.trajectories()[0].steps[0].prompt_ids == ChatTokenizer(tokenizer).encode("Q: 2 + 2?\nA:")


async def test_bad_requests_and_unknown_sessions_get_clear_errors(gateway, tokenizer):
    session, client, _ = session_for(gateway, tokenizer, ["unused"])
    with pytest.raises(openai.BadRequestError, match="messages"):
        await client.chat.completions.create(model="p", messages=[])
    gateway.close_session(session)
    with pytest.raises(openai.NotFoundError, match="unknown or finished gateway session"):
        await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}])


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # create_react_agent moved to the `langchain` package
async def test_langgraph_react_agent_tool_round_trip(gateway, tokenizer):
    """A real agent framework (LangGraph's prebuilt ReAct agent on langchain-openai), unmodified but for the
    base URL: it sends the tool call back in its own serialization, and the trajectory stays token-exact."""
    pytest.importorskip("langgraph")
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    script = ['<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>', "It is 42."]
    session, _, engine = session_for(gateway, tokenizer, script)

    @tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    llm = ChatOpenAI(model="policy", base_url=gateway.base_url(session), api_key="unused", max_retries=0)
    agent = create_react_agent(llm, [multiply])
    out = await agent.ainvoke({"messages": [("user", "What is 6 times 7?")]})
    assert [m.type for m in out["messages"]] == ["human", "ai", "tool", "ai"]
    assert out["messages"][2].content == "42" and out["messages"][-1].content == "It is 42."
    [traj] = session.trajectories()
    assert len(traj.steps) == 2 and session.mismatches == 0
    s1, s2 = traj.steps
    assert s2.prompt_ids[: len(s1.prompt_ids) + len(s1.response_ids)] == s1.prompt_ids + s1.response_ids
    assert "multiply" in tokenizer.decode(engine.prompts[0])


async def test_malformed_tool_call_history_is_a_400(gateway, tokenizer):
    session, client, _ = session_for(gateway, tokenizer, ["unused"])
    bad = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]
    with pytest.raises(openai.BadRequestError, match="malformed messages or tools"):
        await client.chat.completions.create(model="p", messages=bad)


async def test_the_context_window_caps_calls_and_a_prompt_past_it_ends_the_episode(gateway, tokenizer):
    """max_context_tokens: a call's max_tokens is cut to the room left; a prompt that leaves none gets OpenAI's
    400 context_length_exceeded, and the episode, whatever the program reports, ends as context_exceeded."""
    chat = ChatTokenizer(tokenizer)
    first = [{"role": "user", "content": "What is 12 + 30?"}]
    n = len(chat.encode(ChatFormat(chat).render(first, None, add_generation_prompt=True)))
    session, client, engine = session_for(gateway, tokenizer, ["The answer is 42.", "Still 42."],
                                          max_prompt_tokens=n, max_context_tokens=n + 64)
    await client.chat.completions.create(model="p", messages=first)
    again = [*first, {"role": "assistant", "content": "The answer is 42."}, {"role": "user", "content": "Sure?"}]
    await client.chat.completions.create(model="p", messages=again)
    assert engine.max_tokens[0] == 64 and engine.max_tokens[1] == n + 64 - len(engine.prompts[1]) < 64
    overlong = [*again, {"role": "assistant", "content": "Still 42."}, {"role": "user", "content": "check " * 80}]
    with pytest.raises(openai.BadRequestError, match="max_context_tokens") as e:
        await client.chat.completions.create(model="p", messages=overlong)
    assert e.value.code == "context_length_exceeded" and len(engine.prompts) == 2
    task = RolloutTask(run_id="r", task_id="t", sample_idx=0, task={}, dispatched_at=time.time())
    episode = build_episode(task, session, TR.ENV_DONE, {"reward": 1.0})
    assert episode.termination_reason == TR.CONTEXT_EXCEEDED
    assert [t.termination_reason for t in episode.trajectories] == [TR.CONTEXT_EXCEEDED]
    assert [len(t.steps) for t in episode.trajectories] == [2]  # the calls before it are kept
