"""Round trip of every message type through the wire codec, and rejection of bad entries."""

from __future__ import annotations

import time

import msgpack
import pytest

from shared.contracts.messages import (
    MESSAGE_TYPES,
    AcceptedResult,
    ConsumedGroup,
    EnvReply,
    EnvRequest,
    EpisodeResult,
    JobRequest,
    JobRequestReply,
    MessageDecodeError,
    RolloutTask,
    RunCommand,
    RunCommandReply,
    RunControl,
    TinkerDatum,
    TinkerOp,
    TinkerSample,
    TinkerWake,
    TrainerProgress,
    TrajectoryRecord,
    TrajectoryStep,
    WeightsPublished,
    decode,
    encode,
)
from shared.sdk.types import Step, TerminationReason, TokenSequence, Trajectory

NOW = time.time()
SAMPLES = {
    "rollout_task": RolloutTask(run_id="r", task_id="t1", sample_idx=3, attempt=1, task={"question": "1+1"},
                                batch_idx=2, dispatch_version=5, greedy=True, dispatched_at=NOW,
                                lease_expires_at=NOW + 630),
    "env_request": EnvRequest(request_id="q", op="step", session_id="s", run_id="r", env="math",
                              action={"tool": [1, 2]}, reply_to="env.replies.w", sent_at=NOW),
    "env_reply": EnvReply(request_id="q", session_id="s", env_worker_id="e1", ok=False, observation={"a": [1]},
                          error="Traceback ...", error_kind="user", final_reward=1.0),
    "episode_result": EpisodeResult(
        run_id="r", task_id="t1", sample_idx=0, status="completed", termination_reason=TerminationReason.ENV_DONE,
        reward=1.0, trajectories=[TrajectoryRecord(
            uid="u", prompt_ids=[1, 2, 3], response_ids=[4, 5, 6, 7], loss_mask=[1, 1, 0, 1],
            logprobs=[-0.25, -1.5, 0.0, -3.0], versions=[2, 2, -1, 3],
            steps=[TrajectoryStep(prompt_ids=[1, 2, 3], response_ids=[4, 5], logprobs=[-0.25, -1.5], weight_version=2,
                              chat_completions=[{"role": "user", "content": "hi"}], reward=1.0, done=True)],
        )],
    ),
    "trainer_progress": TrainerProgress(run_id="r", version=4, groups=[
        ConsumedGroup(task_id="t1", batch_idx=3, status="used"), ConsumedGroup(task_id="t2", batch_idx=3,
                                                                             status="filtered")]),
    "weights_published": WeightsPublished(run_id="r", version=3, uri="http://ws/r/v3", path="/w/r/v3",
                                          sha256="ab" * 32, bytes=1234, created_at=NOW),
}

SAMPLES["accepted_result"] = AcceptedResult.stored(SAMPLES["episode_result"])
SAMPLES["run_control"] = RunControl(run_id="r", action="stop", sent_at=NOW)
SAMPLES["run_command"] = RunCommand(command_id="c1", run_id="r", action="create", config={"name": "x"}, rows=5,
                                    created_by="job j", sent_at=NOW, expires_at=NOW + 10)
SAMPLES["run_command_reply"] = RunCommandReply(command_id="c1", outcome="refused", status="pending",
                                               message="cannot pause a run that is pending")
SAMPLES["job_request"] = JobRequest(job_id="0b7c9e5e-4f7a-4c55-9a51-7d1e2f7a9c10", kind="export", params={"run_id": "r"},
                                    run_id="r", sent_at=NOW, expires_at=NOW + 10)
SAMPLES["job_request_reply"] = JobRequestReply(job_id="0b7c9e5e-4f7a-4c55-9a51-7d1e2f7a9c10", outcome="expired",
                                               message="read after its sender stopped waiting")
SAMPLES["tinker_op"] = TinkerOp(request_id="f1", owner="ab" * 32, model_id="s:train:0", run_id="r", seq_id=3,
                                op="forward_backward", loss_fn="importance_sampling",
                                loss_fn_config={"clip_low_threshold": 0.8},
                                data=[TinkerDatum(tokens=[1, 2, 3], target_tokens=[2, 3, 4], logprobs=[-0.5, -1.0, -2.0],
                                                  advantages=[1.0, 1.0, 1.0])], sent_at=NOW)
SAMPLES["tinker_wake"] = TinkerWake(model_id="s:train:0", run_id="r")
SAMPLES["tinker_sample"] = TinkerSample(request_id="f2", owner="ab" * 32, run_id="r", version=3,
                                        sequence_ids=["f2:0", "f2:1"], prompt=[1, 2, 3], num_samples=2, max_tokens=8,
                                        temperature=0.7, stop_strings=["\n"], stop_tokens=[2], sent_at=NOW,
                                        target_prompt_ids=[[5, -1], [-1, 7]], target_sparse=True,
                                        prompt_alt_tokens_k=2, store_run_id="r2")


def test_every_message_type_has_a_sample():
    assert set(SAMPLES) == set(MESSAGE_TYPES)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_round_trip(name):
    msg = SAMPLES[name]
    fields = encode(msg)
    assert set(fields) == {b"t", b"v", b"d"}
    back = decode(fields, type(msg))
    assert back == msg


def test_token_arrays_are_binary_not_per_token_text():
    ids = list(range(50_000, 51_000))
    rec = TrajectoryRecord(uid="u", response_ids=ids, logprobs=[-0.5] * 1000)
    body = msgpack.unpackb(encode(EpisodeResult(run_id="r", task_id="t", sample_idx=0, status="completed",
                                                termination_reason="env_done", trajectories=[rec]))[b"d"])
    wire = body["trajectories"][0]
    assert isinstance(wire["response_ids"], bytes) and len(wire["response_ids"]) == 4000
    assert isinstance(wire["logprobs"], bytes) and len(wire["logprobs"]) == 4000


def test_logprobs_survive_as_float32():
    rec = TrajectoryRecord(uid="u", logprobs=[-0.1234567891])
    back = decode(encode(EpisodeResult(run_id="r", task_id="t", sample_idx=0, status="completed",
                                       termination_reason="env_done", trajectories=[rec])))
    assert back.trajectories[0].logprobs[0] == pytest.approx(-0.1234567891, rel=1e-6)


@pytest.mark.parametrize("fields, reason", [
    ({b"x": b"1"}, "lacks the t/v/d"),
    ({b"t": b"nope", b"v": b"1", b"d": b""}, "unknown message type"),
    ({b"t": b"rollout_task", b"v": b"2", b"d": b""}, "schema version 2 unsupported"),
    ({b"t": b"rollout_task", b"v": b"1", b"d": b"\xc1"}, "not valid msgpack"),
    ({b"t": b"rollout_task", b"v": b"1", b"d": msgpack.packb([1, 2])}, "must be a map"),
    ({b"t": b"rollout_task", b"v": b"1", b"d": msgpack.packb({"run_id": "r"})}, "failed validation"),
    ({b"t": b"rollout_task", b"v": b"x", b"d": b""}, "lacks the t/v/d"),
])
def test_bad_entries_raise_decode_error_with_reason(fields, reason):
    with pytest.raises(MessageDecodeError, match=reason):
        decode(fields)


def test_wrong_type_for_stream_rejected():
    with pytest.raises(MessageDecodeError, match="expected 'rollout_task'"):
        decode(encode(SAMPLES["weights_published"]), RolloutTask)


def test_newer_writer_extra_fields_are_ignored():
    body = msgpack.unpackb(encode(SAMPLES["rollout_task"])[b"d"])
    body["added_in_a_later_release"] = 1
    fields = {b"t": b"rollout_task", b"v": b"1", b"d": msgpack.packb(body, use_bin_type=True)}
    assert decode(fields).task_id == "t1"


def test_older_writer_without_a_lease_decodes_with_none():
    body = msgpack.unpackb(encode(SAMPLES["rollout_task"])[b"d"])
    del body["lease_expires_at"]  # a controller from before the field
    fields = {b"t": b"rollout_task", b"v": b"1", b"d": msgpack.packb(body, use_bin_type=True)}
    task = decode(fields, RolloutTask)
    assert task.lease_expires_at is None and task.lease_left(NOW + 10**6) == float("inf")


@pytest.mark.parametrize("name", ["rollout_task", "env_request", "episode_result", "accepted_result"])
def test_older_writer_without_a_traceparent_decodes_with_none(name):
    msg = SAMPLES[name].model_copy(update={"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"})
    assert decode(encode(msg)).traceparent == msg.traceparent  # carried when set
    body = msgpack.unpackb(encode(msg)[b"d"])
    del body["traceparent"]  # a writer from before the field
    fields = {b"t": name.encode(), b"v": b"1", b"d": msgpack.packb(body, use_bin_type=True)}
    assert decode(fields).traceparent is None


def test_trajectory_record_from_dataclass():
    traj = Trajectory(name="solver", steps=[Step(prompt_ids=[1], response_ids=[2, 3], logprobs=[-1.0, -2.0],
                                                 reward=0.5, weight_version=4),
                                            Step(reward=0.25, weight_version=6)],
                      termination_reason=TerminationReason.MAX_STEPS,
                      tokens=TokenSequence(prompt_ids=[1], response_ids=[2, 3], loss_mask=[1, 1]))
    rec = TrajectoryRecord.from_trajectory(traj)
    assert rec.reward == 0.75  # sum of step rewards when no trajectory reward is set
    assert rec.policy_versions == (4, 6)
    assert rec.termination_reason is TerminationReason.MAX_STEPS
    assert rec.steps[0].logprobs == [-1.0, -2.0]


def test_an_episode_result_of_version_1_is_still_read_and_a_newer_one_refused():
    """EpisodeResult 2 may carry compact steps; a version-1 writer's whole steps read as they always did."""
    msg = EpisodeResult(run_id="r", task_id="t", sample_idx=0, status="completed", termination_reason="env_done",
                        trajectories=[TrajectoryRecord(uid="u", steps=[TrajectoryStep(prompt_ids=[1],
                                                                                      chat_completions=[{"a": 1}])])])
    fields = encode(msg)
    old = decode({**fields, b"v": b"1"})
    assert old == msg and old.trajectories[0].steps[0].chat_from is None
    with pytest.raises(MessageDecodeError, match="schema version 3 unsupported"):
        decode({**fields, b"v": b"3"})


def test_a_message_is_stamped_with_the_oldest_version_that_reads_all_it_carries(monkeypatch):
    """A rolling upgrade: a newer writer's message that uses nothing new is read by a reader not yet upgraded;
    one that uses a newer field is refused by it (dead-lettered), never read without that field."""
    plain = SAMPLES["tinker_sample"].model_copy(update={"target_prompt_ids": None, "target_sparse": False,
                                                        "prompt_alt_tokens_k": 0, "store_run_id": None})
    assert encode(plain)[b"v"] == b"1"
    assert encode(plain.model_copy(update={"seed": 3}))[b"v"] == b"2"
    assert encode(plain.model_copy(update={"topk_prompt_logprobs": 2}))[b"v"] == b"2"
    targets = SAMPLES["tinker_sample"].model_copy(update={"store_run_id": None})
    assert encode(targets)[b"v"] == b"3"  # target prompt logprobs
    assert encode(SAMPLES["tinker_sample"])[b"v"] == b"4"  # stored in another run than the one serving it
    assert encode(plain.model_copy(update={"prompt_alt_tokens_k": 1}))[b"v"] == b"3"

    op = SAMPLES["tinker_op"]
    assert encode(op.model_copy(update={"loss_fn": "cross_entropy"}))[b"v"] == b"1"
    assert encode(op.model_copy(update={"op": "save_weights_external", "data": []}))[b"v"] == b"2"
    assert encode(op.model_copy(update={"loss_fn": "gspo"}))[b"v"] == b"3"
    assert encode(op.model_copy(update={"loss_fn": "stable_reinforce"}))[b"v"] == b"4"

    whole = SAMPLES["episode_result"].expanded()
    two_steps = whole.trajectories[0].model_copy(update={"steps": whole.trajectories[0].steps * 2})
    compact = whole.model_copy(update={"trajectories": [two_steps.compact()]})
    assert encode(whole)[b"v"] == b"1" and encode(compact)[b"v"] == b"2"

    monkeypatch.setattr(TinkerSample, "SCHEMA_VERSION", 2)  # a rollout worker not yet upgraded
    assert decode(encode(plain)) == plain
    with pytest.raises(MessageDecodeError, match="schema version 3 unsupported"):
        decode(encode(targets))
    monkeypatch.setattr(TinkerSample, "SCHEMA_VERSION", 3)  # one that would store the samples in the serving run
    with pytest.raises(MessageDecodeError, match="schema version 4 unsupported"):
        decode(encode(SAMPLES["tinker_sample"]))
