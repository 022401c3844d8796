"""Multi-turn token assembly: observation tokens mask 0, completions mask 1, mismatch zeroes the mask."""

import pytest

from services.rollout_worker.assembly import ChatTokenizer, PromptBuilder, assemble
from shared.sdk.types import Step


def step(prompt, response, version=0):
    return Step(prompt_ids=prompt, response_ids=response, logprobs=[-0.5] * len(response), weight_version=version)


def test_single_turn():
    seq = assemble([step([1, 2, 3], [4, 5])])
    assert seq.prompt_ids == [1, 2, 3] and seq.response_ids == [4, 5]
    assert seq.loss_mask == [1, 1] and seq.logprobs == [-0.5, -0.5] and seq.versions == [0, 0]
    assert not seq.mismatch


def test_multi_turn_observation_tokens_are_masked():
    steps = [step([1, 2], [3, 4], version=0), step([1, 2, 3, 4, 9, 9], [5], version=1)]
    seq = assemble(steps)
    assert seq.prompt_ids == [1, 2]
    assert seq.response_ids == [3, 4, 9, 9, 5]
    assert seq.loss_mask == [1, 1, 0, 0, 1]
    assert seq.logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5]
    assert seq.versions == [0, 0, -1, -1, 1]
    assert not seq.mismatch


def test_turn_that_does_not_extend_context_masks_everything():
    steps = [step([1, 2], [3, 4]), step([1, 2, 7, 4, 9], [5])]  # token 3 was re-tokenized as 7
    seq = assemble(steps)
    assert seq.mismatch and set(seq.loss_mask) == {0}
    assert len(seq.loss_mask) == len(seq.response_ids) == len(seq.logprobs) == len(seq.versions)


def test_steps_without_tokens_are_ignored():
    assert assemble([Step()]).prompt_ids == []


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    from tests.support.tiny_model import build_tokenizer

    return ChatTokenizer(build_tokenizer())


def test_prompt_builder_extends_generated_ids_exactly(chat):
    builder = PromptBuilder(chat)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    p1 = builder.prompt_ids(messages)
    assert chat.tokenizer.decode(p1).endswith("<|im_start|>assistant\n")
    # ids the tokenizer would not produce for this text (a non-canonical split), ending with EOS
    generated = chat.encode("4") + chat.encode("2") + [chat.tokenizer.eos_token_id]
    text = chat.decode(generated)
    messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": "Sure?"}]
    builder.record(messages[:1], p1, generated, text)
    p2 = builder.prompt_ids(messages)
    assert p2[: len(p1) + len(generated)] == p1 + generated
    assert chat.tokenizer.decode(p2).endswith("<|im_end|>\n<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n")
    seq = assemble([step(p1, generated), step(p2, [5])])
    assert not seq.mismatch and seq.loss_mask.count(1) == len(generated) + 1


def test_prompt_builder_truncated_response_gets_full_closing(chat):
    builder = PromptBuilder(chat)
    messages = [{"role": "user", "content": "hi"}]
    p1 = builder.prompt_ids(messages)
    generated = chat.encode("abc")  # cut by max_tokens: no EOS
    text = chat.decode(generated)
    builder.record(messages, p1, generated, text)
    messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]
    p2 = builder.prompt_ids(messages)
    assert p2[: len(p1) + len(generated)] == p1 + generated
    assert chat.tokenizer.decode(p2[len(p1) + len(generated):]).startswith("<|im_end|>\n<|im_start|>user")


def test_rewritten_history_is_retemplated_and_detected(chat):
    builder = PromptBuilder(chat)
    messages = [{"role": "user", "content": "hi"}]
    p1 = builder.prompt_ids(messages)
    generated = chat.encode("<think>x</think>ok") + [chat.tokenizer.eos_token_id]
    text = chat.decode(generated)
    builder.record(messages, p1, generated, text)
    # an agent that drops its thinking from the history
    messages = messages + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]
    p2 = builder.prompt_ids(messages)
    assert p2 == chat.encode(chat.render(messages, add_generation_prompt=True))
    assert assemble([step(p1, generated), step(p2, [5])]).mismatch


def test_fast_encode_equals_the_tokenizers_own_encoding(chat):
    assert chat.backend is not None  # the tiny tokenizer is a fast one: the Rust path is taken
    texts = ["What is 2 + 2?", "<|im_start|>user\nhi<|im_end|>\n", "  spaced   out\n\n", "ünïcödé \\boxed{42}", ""]
    for text in texts:
        assert chat.encode(text) == chat.tokenizer(text, add_special_tokens=False)["input_ids"], text


def test_step_without_logprobs_leaves_the_trajectory_without_any():
    """Unknown behaviour logprobs are reported as unknown (empty), never filled in with a guess."""
    from services.rollout_worker.assembly import assemble
    from shared.sdk.types import Step

    seq = assemble([Step(prompt_ids=[1, 2], response_ids=[3, 4], logprobs=[-0.1, -0.2], weight_version=0),
                    Step(prompt_ids=[1, 2, 3, 4, 5], response_ids=[6], weight_version=0)])
    assert seq.response_ids == [3, 4, 5, 6] and seq.loss_mask == [1, 1, 0, 1]
    assert seq.logprobs == []


def test_both_assemblers_extend_a_context_by_the_same_rule(chat):
    """PromptBuilder (built-in agents) and the gateway's AgentCalls share `extend_context`: the same
    conversation gives the same prompt ids, token for token, whether the model stopped on EOS or was cut."""
    from services.rollout_worker.chat_assembly import AgentCalls, ChatFormat
    from services.rollout_worker.engines import Generation

    for generated in (chat.encode("4") + chat.encode("2") + [chat.tokenizer.eos_token_id], chat.encode("abc")):
        text = chat.decode(generated)
        first = [{"role": "user", "content": "What is 2 + 2?"}]
        later = first + [{"role": "assistant", "content": text}, {"role": "user", "content": "Sure?"}]
        builder, calls = PromptBuilder(chat), AgentCalls("agent", ChatFormat(chat))
        p1 = builder.prompt_ids(first)
        prompt = calls.chat_prompt(first, None)
        assert prompt.ids == p1
        builder.record(first, p1, generated, text)
        calls.record(prompt, Generation(generated, [0.0] * len(generated), text, "stop", 0), first, None)
        extended = builder.prompt_ids(later)
        assert extended[: len(p1) + len(generated)] == p1 + generated
        assert calls.chat_prompt(later, None).ids == extended


def test_extend_context_refuses_a_rewritten_history_and_a_foreign_eos(chat):
    from services.rollout_worker.assembly import extend_context

    first = [{"role": "user", "content": "hi"}]
    later = first + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]
    assert extend_context(chat, chat.render, first, "ok", False, later).startswith("<|im_end|>")
    assert extend_context(chat, chat.render, first, "ok", True, later).startswith("\n<|im_start|>user")
    assert extend_context(chat, chat.render, first, "other", False, later) is None  # reply rewritten
    assert extend_context(chat, chat.render, [{"role": "user", "content": "x"}], "ok", False, later) is None
    fake_eos = ChatTokenizer(chat.tokenizer)
    fake_eos.eos_text = "</s>"  # a template that does not close a reply with the model's EOS
    assert extend_context(fake_eos, chat.render, first, "ok", True, later) is None


def test_a_trajectory_is_cut_where_the_agent_rewrote_its_history_and_each_run_is_token_exact():
    from services.rollout_worker.assembly import context_runs
    from services.rollout_worker.episodes import sequences
    from shared.sdk.types import Trajectory

    steps = [step([1, 2], [3]), step([1, 2, 3, 4], [5]),  # turn 2 extends turn 1's context
             step([9, 4], [6]),  # the agent summarized: a new context
             step([9, 4, 6, 7], [8]), Step(), step([9, 4, 6, 7, 8, 2], [3])]  # a step without tokens stays put
    runs = context_runs(steps)
    assert [len(r) for r in runs] == [2, 4]
    for r in runs:  # each run is one sequence with nothing masked: no mismatch inside a run
        seq = assemble(r)
        assert not seq.mismatch and sum(seq.loss_mask) == sum(len(s.response_ids) for s in r)
        assert seq.prompt_ids + seq.response_ids == r[-1].prompt_ids + r[-1].response_ids  # token-exact
    for s, r in zip(steps[:3], [1.0, 0.0, 0.5], strict=False):
        s.reward = r
    traj = Trajectory(uid="u", steps=steps, info={"tool_call_errors": 1})
    parts = sequences(traj)
    assert [p.uid for p in parts] == ["u/0", "u/1"] and [p.steps for p in parts] == runs
    assert [p.reward for p in parts] == [1.5, 1.5]  # the whole trajectory's reward on each
    assert parts[0].info == {"tool_call_errors": 1, "sequence": 0, "sequences": 2, "first_turn": 0}
    assert parts[1].info == {"tool_call_errors": 1, "sequence": 1, "sequences": 2, "first_turn": 2,
                             "context_rewrites": 1}
    uncut = Trajectory(steps=runs[0])
    assert sequences(uncut) == [uncut] and sequences(uncut)[0] is uncut  # an uncut trajectory is itself
