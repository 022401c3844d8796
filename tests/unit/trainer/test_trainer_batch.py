"""Batch assembly from stream messages: whole groups, masks, exclusions, dynamic sampling, staleness bound."""

from __future__ import annotations

import random

import pytest
import torch

from services.trainer.batch import (
    GroupBuffer,
    build_tensors,
    doomed_groups,
    excluded_reason,
    mismatch_probe,
    samples_from_result,
    select_groups,
    staleness,
)
from shared.contracts.messages import EpisodeResult, TrajectoryRecord, decode, encode
from shared.sdk.types import TerminationReason as TR


def result(task: str, sample: int, reward: float, *, versions=(0, 0), prompt=(5, 6, 7), response=(8, 9),
           mask=(1, 1), reason=TR.ENV_DONE, status="completed", greedy=False, batch=0,
           logprobs=None) -> EpisodeResult:
    logprobs = [-1.0] * len(response) if logprobs is None else list(logprobs)
    traj = TrajectoryRecord(uid=f"{task}-{sample}", reward=reward, termination_reason=reason, prompt_ids=list(prompt),
                            response_ids=list(response), loss_mask=list(mask), logprobs=logprobs,
                            versions=list(versions))
    msg = EpisodeResult(run_id="r", task_id=task, sample_idx=sample, status=status, termination_reason=reason,
                        reward=reward, trajectories=[traj], greedy=greedy, batch_idx=batch)
    return decode(encode(msg))  # as it arrives from the stream


def buffer_of(results, n=2, need_greedy=False) -> GroupBuffer:
    buf = GroupBuffer(n, need_greedy)
    for r in results:
        for s in samples_from_result(r):
            buf.add(s)
    return buf


def test_only_complete_groups_are_handed_out():
    buf = buffer_of([result("a", 0, 1.0), result("a", 1, 0.0), result("b", 0, 1.0)])
    assert [g.key[0] for g in buf.complete_groups()] == ["a"]


def test_remax_group_waits_for_its_greedy_baseline():
    results = [result("a", 0, 1.0), result("a", 1, 0.0)]
    assert buffer_of(results, need_greedy=True).complete_groups() == []
    buf = buffer_of([*results, result("a", 2, 0.5, greedy=True)], need_greedy=True)
    (group,) = buf.complete_groups()
    t = build_tensors([group], pad_id=0)
    assert t["reward_baselines"].tolist() == [0.5, 0.5]  # the greedy sample is the baseline, not a row
    assert t["input_ids"].shape[0] == 2


@pytest.mark.parametrize("reason,status", [(TR.INFRA_ERROR, "failed"), (TR.CANCELLED, "completed"),
                                           (TR.INFRA_ERROR, "completed")])
def test_infrastructure_failures_and_cancellations_are_excluded(reason, status):
    assert excluded_reason(result("a", 0, 0.0, reason=reason, status=status)) is not None
    assert excluded_reason(result("a", 0, 0.0)) is None


def test_user_env_error_stays_in_group_with_zero_loss_mask():
    buf = buffer_of([result("a", 0, 0.0, reason=TR.ERROR), result("a", 1, 1.0)])
    t = build_tensors(buf.complete_groups(), pad_id=0)
    assert t["response_mask"].tolist() == [[0, 0], [1, 1]]


def test_context_exceeded_stays_in_group_with_zero_loss_mask_unless_unmasked():
    results = [result("a", 0, 0.0, reason=TR.CONTEXT_EXCEEDED), result("a", 1, 1.0)]
    t = build_tensors(buffer_of(results).complete_groups(), pad_id=0)  # the default: algorithm.mask_termination
    assert t["response_mask"].tolist() == [[0, 0], [1, 1]] and t["token_level_rewards"][1].sum() == 1.0
    assert [s.masked for s in samples_from_result(results[0])] == ["context_exceeded"]
    assert samples_from_result(results[0], mask_termination=[])[0].loss_mask == [1, 1]
    assert samples_from_result(results[1], mask_termination=["env_done"])[0].loss_mask == [0, 0]


def test_mask_termination_reads_each_trajectorys_own_reason():
    """A solver/judge episode: only the trajectory cut by the context window loses its loss."""
    ok = TrajectoryRecord(uid="s", name="solver", reward=1.0, termination_reason=TR.ENV_DONE, prompt_ids=[5],
                          response_ids=[8, 9], loss_mask=[1, 1], logprobs=[-1.0, -1.0], versions=[0, 0])
    cut = ok.model_copy(update={"uid": "j", "name": "judge", "termination_reason": TR.CONTEXT_EXCEEDED})
    episode = EpisodeResult(run_id="r", task_id="a", sample_idx=0, status="completed",
                            termination_reason=TR.CONTEXT_EXCEEDED, trajectories=[ok, cut])
    assert [(s.name, s.loss_mask) for s in samples_from_result(episode)] == [("solver", [1, 1]), ("judge", [0, 0])]


def test_padding_masks_rewards_and_positions():
    buf = buffer_of([result("a", 0, 1.0, prompt=(5,), response=(8, 9, 10), mask=(1, 0, 1)),
                     result("a", 1, 0.0, prompt=(5, 6, 7), response=(8,), mask=(1,))])
    t = build_tensors(buf.complete_groups(), pad_id=0)
    assert t["prompts"].tolist() == [[0, 0, 5], [5, 6, 7]]  # left-padded prompts
    assert t["responses"].tolist() == [[8, 9, 10], [8, 0, 0]]  # right-padded responses
    assert t["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]
    assert t["response_mask"].tolist() == [[1, 0, 1], [1, 0, 0]]  # observation tokens (mask 0) stay masked
    assert t["position_ids"][0, 2:].tolist() == [0, 1, 2, 3]
    assert t["token_level_rewards"].tolist() == [[0, 0, 1.0], [0, 0, 0]]  # on the last trained token
    assert t["behaviour_log_probs"].tolist() == [[-1.0, 0.0, -1.0], [-1.0, 0.0, 0.0]]
    assert list(t["uid"]) == ["a/0/agent", "a/0/agent"]


def test_dynamic_sampling_drops_uniform_groups_and_refills_from_later_ones():
    buf = buffer_of([result("a", 0, 1.0), result("a", 1, 1.0),  # no signal
                     result("b", 0, 1.0), result("b", 1, 0.0),
                     result("c", 0, 0.0), result("c", 1, 0.0),  # no signal
                     result("d", 0, 0.0), result("d", 1, 1.0)])
    groups = buf.complete_groups()
    chosen, dropped = select_groups(groups, 2, dynamic_sampling=True, version=0, max_staleness=0, stale_policy="drop")
    assert [g.key[0] for g in chosen] == ["b", "d"]
    assert [g.key[0] for g in dropped["filtered"]] == ["a", "c"]
    chosen, dropped = select_groups(groups, 2, dynamic_sampling=False, version=0, max_staleness=0,
                                    stale_policy="drop")
    assert [g.key[0] for g in chosen] == ["a", "b"] and not dropped


def test_staleness_never_exceeds_the_bound_in_what_is_trained():
    rng = random.Random(0)
    for _ in range(50):
        version, k = rng.randrange(0, 10), rng.randrange(0, 4)
        results = []
        for t in range(8):
            v = rng.randrange(0, version + 1)
            results += [result(f"t{t}", s, float(s), versions=(v, rng.randrange(v, version + 1))) for s in range(2)]
        chosen, dropped = select_groups(buffer_of(results).complete_groups(), 8, dynamic_sampling=False,
                                        version=version, max_staleness=k, stale_policy="drop")
        used = [s for g in chosen for s in g.samples.values()]
        assert all(age <= k for age in staleness(used, version))
        assert all(age > k for g in dropped.get("stale", []) for age in [max(staleness(g.all_samples(), version))])


def test_downweight_keeps_stale_samples_with_smaller_weight():
    results = [result("old", s, float(s), versions=(1, 1)) for s in range(2)]
    results += [result("new", s, float(s), versions=(5, 5)) for s in range(2)]
    chosen, dropped = select_groups(buffer_of(results).complete_groups(), 2, dynamic_sampling=False, version=5,
                                    max_staleness=2, stale_policy="downweight")
    assert not dropped
    t = build_tensors(chosen, pad_id=0)
    assert t["sample_weights"].tolist() == [pytest.approx(1 / 3)] * 2 + [1.0, 1.0]  # 2 versions past the bound


def test_oldest_trained_token_decides_a_samples_version():
    (s,) = samples_from_result(result("a", 0, 1.0, response=(8, 9, 10), mask=(0, 1, 1), versions=(1, 3, 4)))
    assert s.min_version == 3  # the masked observation token's version does not count
    assert torch.tensor(s.logprobs).shape == (3,)


def test_groups_waiting_on_a_finally_failed_slot_are_doomed():
    buf = buffer_of([result("a", 0, 1.0), result("b", 0, 1.0, batch=1), result("a", 4, 1.0, batch=2),
                     result("c", 0, 1.0), result("c", 1, 0.0),  # complete samples, but no greedy baseline yet
                     result("d", 0, 1.0), result("d", 1, 0.0), result("d", 2, 0.0, greedy=True)],
                    need_greedy=True)
    waiting = buf.incomplete_groups()
    assert sorted(g.key[0] for g in waiting) == ["a", "a", "b", "c"]
    # final failures: a's slot 1 in batch 0, c's greedy baseline; d is complete, so never doomed
    doomed = doomed_groups(waiting, {("a", 0), ("c", 0), ("d", 0)})
    assert sorted(g.key[:2] for g in doomed) == [("a", 0), ("c", 0)]


def test_dropped_groups_are_recorded_with_their_reason_greedy_included():
    from services.trainer.loop import Trainer

    buf = buffer_of([result("a", 0, 1.0), result("a", 1, 1.0), result("a", 2, 1.0, greedy=True)], need_greedy=True)
    records = Trainer._records(buf.complete_groups(), "filtered")
    assert sorted((r.sample_idx, r.status) for r in records) == [(0, "filtered"), (1, "filtered"), (2, "filtered")]
    used = Trainer._records(buf.complete_groups())
    assert sorted((r.sample_idx, r.status) for r in used) == [(0, "used"), (1, "used"), (2, "baseline")]


def test_every_trajectory_of_a_multi_agent_episode_is_trained_in_its_role_group():
    """A solver-judge episode carries two "solver" trajectories and one "judge": the task's group holds every
    trajectory of its n episodes (none silently dropped), is complete once n episodes arrived, and its
    advantages compare trajectories of one role (verl's uid)."""
    def episode(sample: int, rewards: tuple[float, float, float]) -> EpisodeResult:
        trajs = [TrajectoryRecord(uid=f"{sample}-{i}", name=name, reward=r, termination_reason=TR.ENV_DONE,
                                  prompt_ids=[5, 6], response_ids=[8 + i], loss_mask=[1], logprobs=[-1.0],
                                  versions=[0])
                 for i, (name, r) in enumerate(zip(("solver", "solver", "judge"), rewards, strict=True))]
        msg = EpisodeResult(run_id="r", task_id="a", sample_idx=sample, status="completed",
                            termination_reason=TR.ENV_DONE, reward=rewards[2], trajectories=trajs)
        return decode(encode(msg))

    buf = buffer_of([episode(0, (1.0, 0.0, 1.0))], n=2)
    assert buf.complete_groups() == []  # one episode of two
    buf = buffer_of([episode(0, (1.0, 0.0, 1.0)), episode(1, (0.0, 0.0, 0.0))], n=2)
    (group,) = buf.complete_groups()
    assert len(group.samples) == 6 and sorted(group.rewards) == [0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    t = build_tensors([group], pad_id=0)
    uids = list(t["uid"])
    assert uids.count("a/0/solver") == 4 and uids.count("a/0/judge") == 2  # a GRPO group of four, one of two


@pytest.mark.parametrize("logprobs", [[], [-1.0], [-1.0, float("nan")]], ids=["none", "misaligned", "nan"])
def test_sample_without_behaviour_logprobs_is_masked_out_and_counted(logprobs):
    from prometheus_client import REGISTRY

    def counted() -> float:
        return REGISTRY.get_sample_value("trainer_samples_without_logprobs_total") or 0.0

    before = counted()
    buf = buffer_of([result("a", 0, 1.0, logprobs=logprobs), result("a", 1, 0.0, logprobs=[-0.5, -0.25])])
    (group,) = buf.complete_groups()  # its reward still counts in the group's advantage
    t = build_tensors([group], pad_id=0)
    assert t["response_mask"].tolist() == [[0, 0], [1, 1]]  # no loss from made-up logprobs
    assert t["behaviour_log_probs"].tolist() == [[0.0, 0.0], [-0.5, -0.25]]
    assert t["token_level_rewards"][0].sum().item() == 1.0
    assert counted() == before + 1


def test_untrained_tokens_need_no_logprob():
    (s,) = samples_from_result(result("a", 0, 1.0, mask=(0, 1), logprobs=[float("nan"), -0.5]))
    assert s.loss_mask == [0, 1]


@pytest.mark.parametrize("estimator, equal_rewards_teach", [
    ("grpo", False), ("rloo", False), ("reinforce_plus_plus", True), ("gae", True)])
def test_groups_without_learning_signal_are_read_off_the_estimators_advantages(estimator, equal_rewards_teach):
    """`groups_without_signal`: the share of a step's groups none of whose tokens got an advantage. A group of
    equal rewards teaches nothing under GRPO/RLOO; under REINFORCE++ (batch whitening) and GAE (a critic) it still
    does, and counting it signal-free there would warn a healthy run."""
    from services.trainer.algorithm import compute_advantages
    from services.trainer.learner import groups_without_signal
    from shared.contracts.run_config import AlgorithmConfig

    algo = AlgorithmConfig(adv_estimator=estimator)
    groups = buffer_of([result("a", 0, 0.0), result("a", 1, 0.0), result("b", 0, 1.0), result("b", 1, 0.0)]
                       ).complete_groups()
    t = build_tensors(groups, pad_id=0)
    values = torch.full_like(t["behaviour_log_probs"], 0.3) if estimator == "gae" else None
    advantages, _ = compute_advantages(algo, t, values)
    assert groups_without_signal(groups, advantages, t["response_mask"]) == (0.0 if equal_rewards_teach else 0.5)
    masked = t["response_mask"] * 0  # nothing trained: nothing taught, whatever the advantages
    assert groups_without_signal(groups, advantages, masked) == 1.0


def test_each_tokens_version_reaches_the_tensors_and_the_mismatch_probe_takes_only_trained_tokens_of_a_version():
    results = [result("a", 0, 1.0, versions=(3, -1, 4), response=(8, 9, 10), mask=(1, 0, 1)),
               result("a", 1, 0.0, versions=(3, -1, 3), response=(8, 9, 10), mask=(1, 0, 1)),
               result("b", 0, 0.0, versions=(-1, 4), response=(8, 9), mask=(0, 1), reason=TR.ERROR)]
    buf = buffer_of(results)
    t = build_tensors(buf.complete_groups(), pad_id=0)
    assert t["behaviour_versions"].tolist() == [[3, -1, 4], [3, -1, 3]]
    probe = mismatch_probe(buf, 4)  # the errored sample's version-4 token has no loss: not a trained token
    assert [(s.group[0], s.key[2]) for s in probe] == [("a", 0)]
    assert len(mismatch_probe(buf, 3)) == 2 and len(mismatch_probe(buf, 3, limit=1)) == 1
    assert mismatch_probe(buf, 5) == []


def test_async_metrics_count_stale_samples_and_partial_rollouts_as_verl_names_them():
    from services.trainer.learner import async_metrics

    samples = [s for r in (result("a", 0, 1.0, versions=(3, 3)), result("a", 1, 0.0, versions=(2, 3)),
                           result("b", 0, 1.0, versions=(1, 3), mask=(1, 1)), result("b", 1, 0.0, versions=(-1, 3)))
               for s in samples_from_result(r)]
    m = async_metrics(samples, version=3)
    # trained from version 3: the samples whose oldest trained token is older are stale; env tokens (-1) do not count
    assert m["fully_async/count/stale_samples_processed"] == 2.0
    assert m["fully_async/partial/total_partial_num"] == 2.0  # spans 1 and 2
    assert m["fully_async/partial/partial_ratio"] == 0.5
    assert m["fully_async/partial/max_partial_span"] == 2.0


def test_rollout_idle_ratio_is_the_uncovered_share_of_the_window_per_worker():
    from services.trainer.learner import rollout_idle_ratio

    assert rollout_idle_ratio([], 0.0, 10.0) is None
    # w1 busy 0-4 and 3-6 (overlapping: 6 s), w2 busy 8-12 clipped to 8-10 (2 s): idle 0.4 and 0.8
    spans = [("w1", 0.0, 4.0), ("w1", 3.0, 6.0), ("w2", 8.0, 12.0)]
    assert rollout_idle_ratio(spans, 0.0, 10.0) == pytest.approx(0.6)
    assert rollout_idle_ratio([("w1", -5.0, 20.0)], 0.0, 10.0) == 0.0


def cut_result(task: str, sample: int, reward: float, parts: int) -> EpisodeResult:
    """An episode whose agent rewrote its history: its trajectory arrives as `parts` sequences, in order."""
    trajs = [TrajectoryRecord(uid=f"{task}-{sample}/{k}", reward=reward, termination_reason=TR.ENV_DONE,
                              prompt_ids=[5, 6, 7 + k], response_ids=[8 + k, 9], loss_mask=[1, 1],
                              logprobs=[-1.0, -1.0], versions=[0, 0], info={"sequence": k, "sequences": parts})
             for k in range(parts)]
    msg = EpisodeResult(run_id="r", task_id=task, sample_idx=sample, status="completed",
                        termination_reason=TR.ENV_DONE, reward=reward, trajectories=trajs, batch_idx=0)
    return decode(encode(msg))


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "remax"])
def test_the_sequences_of_a_rewritten_trajectory_share_the_advantage_of_the_uncut_trajectory(estimator):
    """Group statistics see one row per trajectory (the last sequence); every earlier sequence takes that row's
    advantage: the same advantages as the same episodes uncut, on every trained token."""
    from services.trainer.algorithm import compute_advantages, share_sequence_advantages
    from shared.contracts.run_config import AlgorithmConfig

    algo = AlgorithmConfig(adv_estimator=estimator)
    greedy = [result("a", 9, 0.5, greedy=True)] if estimator == "remax" else []
    cut = [cut_result("a", 0, 1.0, 3), result("a", 1, 0.0), cut_result("a", 2, 1.0, 2), result("a", 3, 0.0)]
    uncut = [result("a", 0, 1.0), result("a", 1, 0.0), result("a", 2, 1.0), result("a", 3, 0.0)]
    need = estimator == "remax"
    (cut_group,) = buffer_of(cut + greedy, n=4, need_greedy=need).complete_groups()
    (uncut_group,) = buffer_of(uncut + greedy, n=4, need_greedy=need).complete_groups()
    t = build_tensors([cut_group], pad_id=0)
    assert t["advantage_from"].tolist() == [2, 2, -1, -1, 5, -1, -1]  # rows: a0 (3 sequences), a1, a2 (2), a3
    assert len(set(t["uid"])) == 1 + 3  # the earlier sequences each in a group of their own
    advantages = share_sequence_advantages(compute_advantages(algo, t, None)[0], t)
    u = build_tensors([uncut_group], pad_id=0)
    expected = compute_advantages(algo, u, None)[0][:, 0].tolist()  # one value per uncut trajectory
    per_row = [expected[0]] * 3 + [expected[1]] + [expected[2]] * 2 + [expected[3]]
    assert advantages[:, 0].tolist() == pytest.approx(per_row) and advantages[:, 1].tolist() == pytest.approx(per_row)
    assert any(abs(a) > 0.1 for a in per_row)  # the check means something: the advantages are not all zero


def test_a_trajectory_cut_at_no_rewrite_takes_no_other_rows_advantage():
    t = build_tensors(buffer_of([result("a", 0, 1.0), result("a", 1, 0.0)]).complete_groups(), pad_id=0)
    assert t["advantage_from"].tolist() == [-1, -1]
    from services.trainer.algorithm import share_sequence_advantages

    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    assert share_sequence_advantages(adv, t) is adv
