"""Tinker on a stack (API + controller + trainer + weight server + rollout worker, real Postgres/Redis), driven by
the real `tinker` SDK: forward_backward / forward / optim_step on LoRA models of one shared base in one trainer
engine, tenants kept apart, bad datums refused with the field named, checkpoints, a trainer restart, a fleet of two
trainers (each model served by its holder, a dead holder's model taken over), and sampling on the rollout worker
with every sample stored as a trajectory.

    pytest -q tests/e2e/test_tinker_training.py
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import httpx
import pyrage
import pytest
import redis
from sqlalchemy import create_engine, text
from tinker_testlib import BASE, tinker_stack

from shared.contracts.messages import decode
from shared.contracts.streams import WEIGHTS
from tests.support.procs import stop, wait_until

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

pytestmark = pytest.mark.slow  # minutes of processes

SEQS = [[5, 9, 13, 17, 21, 25, 29, 33, 37], [40, 44, 48, 52, 56, 60, 64, 68, 72]]


@pytest.fixture(scope="module")
def database_url(isolated_urls):
    """This module's own database (its trainer takes leases on tinker runs only) and the session's Redis database
    flushed (no stream holds an earlier module's entries: the fuzz suite leaves junk on `weights`)."""
    return isolated_urls[1]


@pytest.fixture(scope="module")
def api(database_url, redis_url, tmp_path_factory):
    with tinker_stack(database_url, redis_url, tmp_path_factory.mktemp("tinker-train")) as stack:
        yield stack


OPEN: list = []


@pytest.fixture(autouse=True)
def _close_clients():
    yield
    while OPEN:
        with contextlib.suppress(Exception):
            OPEN.pop().close("success").result(timeout=10)


def new_token(api, name: str) -> str:
    with api.client() as admin:
        r = admin.post("/v1/tokens", json={"name": name, "scopes": ["read", "write"]})
        assert r.status_code == 201, r.text
        return r.json()["token"]


def training_client(api, token: str | None = None, rank: int = 8):
    service = tinker.ServiceClient(base_url=api.url, api_key="tml-" + (token or api.token))
    OPEN.append(service)
    return service.create_lora_training_client(base_model=BASE, rank=rank).result(timeout=60)


def sft_datum(seq: list[int], weights: list[float] | None = None) -> types.Datum:
    weights = weights if weights is not None else [0.0] + [1.0] * (len(seq) - 2)
    return types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                       loss_fn_inputs={"target_tokens": seq[1:], "weights": weights})


def nll(output, datums: list[types.Datum]) -> float:
    """Mean negative log-likelihood per weighted token, from forward_backward's per-datum logprobs."""
    total = weight = 0.0
    for out, d in zip(output.loss_fn_outputs, datums, strict=True):
        lp, w = out["logprobs"].tolist(), d.loss_fn_inputs["weights"].tolist()
        total -= sum(a * b for a, b in zip(lp, w, strict=True))
        weight += sum(w)
    return total / weight


def test_sft_loop_loss_falls_through_the_sdk(api):
    tc = training_client(api)
    datums = [sft_datum(s) for s in SEQS]
    losses = []
    for _ in range(12):
        fb = tc.forward_backward(datums, "cross_entropy").result(timeout=300)
        losses.append(nll(fb, datums))
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=120)
    out = fb.loss_fn_outputs[0]
    assert out["logprobs"].shape == [len(SEQS[0]) - 1] and out["elementwise_loss"].shape == [len(SEQS[0]) - 1]
    # the loss the server reports is Tinker's: the sum of every datum's elementwise loss
    assert math.isclose(fb.metrics["loss:sum"], sum(sum(o["elementwise_loss"].tolist()) for o in fb.loss_fn_outputs),
                        rel_tol=1e-4)
    # the tiny model's frozen tied embedding (norm ~0.1) bounds how sharp its predictions get: from chance
    # (ln 512 = 6.24 nats) the adapter alone takes it ~0.5 nats down in 12 steps
    assert losses[-1] < losses[0] - 0.3 and losses[-1] < min(losses[:3]), losses


def test_importance_sampling_raises_the_advantaged_sequence_and_lowers_the_other(api):
    tc = training_client(api)
    probe = [sft_datum(s) for s in SEQS]
    before = tc.forward(probe, "cross_entropy").result(timeout=300)
    sampled = [lo["logprobs"].tolist() for lo in before.loss_fn_outputs]  # the sampler's logprobs: the same weights
    datums = [types.Datum(model_input=types.ModelInput.from_ints(s[:-1]),
                          loss_fn_inputs={"target_tokens": s[1:], "logprobs": lp, "advantages": [adv] * (len(s) - 1)})
              for s, lp, adv in zip(SEQS, sampled, (1.0, -1.0), strict=True)]
    for _ in range(3):
        fb = tc.forward_backward(datums, "importance_sampling").result(timeout=300)
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=120)
    assert set(fb.loss_fn_outputs[0]) == {"logprobs", "elementwise_loss"}
    after = tc.forward(probe, "cross_entropy").result(timeout=300)
    up, down = (sum(a["logprobs"].tolist()) - sum(b["logprobs"].tolist())
                for a, b in zip(after.loss_fn_outputs, before.loss_fn_outputs, strict=True))
    assert up > 0 > down, (up, down)


def test_stable_reinforce_trains_sampled_spans_against_the_samplers_recorded_logprobs(api):
    """A datum built from a sample with its provenance: the sampled positions are trained against the logprobs the
    sampler recorded (the client's are replaced: zeros here), the prompt positions not at all; a span whose tokens
    are not its sample's, or that names another key's sample, is a 400 naming it."""
    tc = training_client(api)
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=300)
    prompt = SEQS[0][:4]
    sample = sampler.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=4)).result(
        timeout=300).sequences[0]
    full = prompt + list(sample.tokens)
    n = len(full) - 1

    def datum(tokens: list[int], sequence_id: str) -> types.Datum:
        return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
            "target_tokens": tokens[1:], "logprobs": [0.0] * n, "advantages": [1.0] * n}).with_provenance(
            model_input=[types.PromptProvenanceSpan(sequence_id=sequence_id, length=len(prompt)),
                         types.SampledProvenanceSpan(sequence_id=sequence_id, length=n - len(prompt))],
            loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sequence_id, offset=1, length=len(prompt) - 1),
                            types.SampledProvenanceSpan(sequence_id=sequence_id, length=len(sample.tokens))])

    out = tc.forward_backward([datum(full, sample.sequence_id)], "stable_reinforce").result(timeout=300)
    logp = out.loss_fn_outputs[0]["logprobs"].tolist()
    loss = out.loss_fn_outputs[0]["elementwise_loss"].tolist()
    k = len(prompt) - 1
    assert loss[:k] == [0.0] * k  # prompt positions: not trained
    # the weights have not moved since sampling: the ratio over the recorded logprobs is 1, so each sampled position's
    # loss is -logp (with the client's zeros it would be -exp(logp) * logp)
    assert close([loss[k:]], [[-x for x in logp[k:]]], tol=1e-3), (loss, logp)
    assert close([list(sample.logprobs)], [logp[k:]], tol=1e-3)

    altered = full[:-1] + [(full[-1] + 1) % 64]
    with pytest.raises(tinker.BadRequestError, match="as it was sampled"):
        tc.forward_backward([datum(altered, sample.sequence_id)], "stable_reinforce").result(timeout=300)
    other = training_client(api, new_token(api, "tinker-mallory"))
    with pytest.raises(tinker.BadRequestError, match="not a stored sample of this key's"):
        other.forward_backward([datum(full, sample.sequence_id)], "stable_reinforce").result(timeout=300)
    bare = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
        "target_tokens": full[1:], "logprobs": [0.0] * n, "advantages": [1.0] * n})
    with pytest.raises(tinker.BadRequestError, match="needs provenance on every datum"):
        tc.forward_backward([bare], "stable_reinforce").result(timeout=300)


def test_forward_backward_custom_trains_with_the_clients_own_loss(api):
    """The SDK's client-side custom loss: forward for the logprobs, the loss and its gradient computed by the
    client, sent back as the weights of a cross_entropy step. A custom NLL gives cross_entropy's gradients."""
    import torch

    custom, reference = training_client(api), training_client(api)
    datums = [sft_datum(s) for s in SEQS]

    def weighted_nll(data, logprobs_list):
        weighted = [-(lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs_list,
                                                                                           strict=True)]
        loss = torch.stack(weighted).sum()
        return loss, {"nll": float(loss.detach())}

    before = forward(reference, datums)  # both adapters start as zero updates of one base
    expected = -sum(lp * w for lps, d in zip(before, datums, strict=True)
                    for lp, w in zip(lps, d.loss_fn_inputs["weights"].tolist(), strict=True))
    out = custom.forward_backward_custom(datums, weighted_nll).result(timeout=300)
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4) and "nll" in str(out.metrics)
    reference.forward_backward(datums, "cross_entropy").result(timeout=300)
    for tc in (custom, reference):
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result(timeout=120)
    assert close(forward(custom, datums), forward(reference, datums), tol=1e-4)  # the same step


def test_one_tenants_steps_leave_another_tenants_adapter_and_models_alone(api):
    alice, bob = new_token(api, "tinker-alice"), new_token(api, "tinker-bob")
    a, b = training_client(api, alice), training_client(api, bob)
    probe = [sft_datum(s) for s in SEQS]
    b_before = [o["logprobs"].tolist() for o in b.forward(probe, "cross_entropy").result(timeout=300).loss_fn_outputs]
    a_before = [o["logprobs"].tolist() for o in a.forward(probe, "cross_entropy").result(timeout=300).loss_fn_outputs]
    b.forward_backward(probe, "cross_entropy").result(timeout=300)  # bob's gradients, not yet applied
    for _ in range(3):
        a.forward_backward(probe, "cross_entropy").result(timeout=300)
        a.optim_step(types.AdamParams(learning_rate=2e-2)).result(timeout=120)
    a_after = [o["logprobs"].tolist() for o in a.forward(probe, "cross_entropy").result(timeout=300).loss_fn_outputs]
    b_after = [o["logprobs"].tolist() for o in b.forward(probe, "cross_entropy").result(timeout=300).loss_fn_outputs]
    assert a_after != a_before  # alice trained
    assert b_after == b_before  # bob's adapter untouched by alice's steps (and his pending gradients not applied)
    assert b_before == a_before  # the same seed: the two adapters started equal, so the check above is sharp

    # bob's key cannot reach alice's model, nor her futures
    body = forward_backward_request_to_proto(types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=probe, loss_fn="cross_entropy"),
        model_id=a.model_id, seq_id=100)).SerializeToString()
    r = httpx.post(api.url + "/api/v1/forward_backward", content=body, timeout=30,
                   headers={"X-API-Key": "tml-" + bob, "Content-Type": "application/x-protobuf"})
    assert r.status_code == 404 and a.model_id in r.json()["message"], r.text
    r = httpx.post(api.url + "/api/v1/optim_step", timeout=30, headers={"X-API-Key": "tml-" + bob},
                   json={"model_id": a.model_id, "seq_id": 100, "adam_params": {"learning_rate": 1.0}})
    assert r.status_code == 404, r.text
    mine = httpx.post(api.url + "/api/v1/optim_step", timeout=30, headers={"X-API-Key": "tml-" + alice},
                      json={"model_id": a.model_id, "seq_id": 1000, "adam_params": {"learning_rate": 0.0}})
    assert mine.status_code == 200, mine.text
    r = httpx.post(api.url + "/api/v1/retrieve_future", timeout=30, headers={"X-API-Key": "tml-" + bob},
                   json={"request_id": mine.json()["request_id"]})
    assert r.status_code == 404, r.text


def _post_fb(api, model_id: str, datums: list[types.Datum], loss: str = "cross_entropy",
             config: dict | None = None) -> httpx.Response:
    body = forward_backward_request_to_proto(types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=datums, loss_fn=loss, loss_fn_config=config),
        model_id=model_id, seq_id=1)).SerializeToString()
    return httpx.post(api.url + "/api/v1/forward_backward", content=body, timeout=30,
                      headers={"X-API-Key": "tml-" + api.token, "Content-Type": "application/x-protobuf"})


def test_bad_datums_and_losses_are_refused_with_the_field_named(api):
    tc = training_client(api)
    good = sft_datum(SEQS[0])
    short = sft_datum(SEQS[1], weights=[1.0] * 3)  # 3 weights for 8 input tokens
    r = _post_fb(api, tc.model_id, [good, short])
    assert r.status_code == 400, r.text
    assert r.json()["detail"][0]["field"] == "forward_backward_input.data[1].loss_fn_inputs.weights"
    assert "3 values" in r.json()["message"] and "8 tokens" in r.json()["message"]

    r = _post_fb(api, tc.model_id, [good], loss="dpo")
    assert r.status_code == 400 and "cross_entropy" in r.json()["detail"][0]["hint"], r.text

    unshifted = types.Datum(model_input=types.ModelInput.from_ints(SEQS[0][:-1]),
                            loss_fn_inputs={"target_tokens": SEQS[0][:-1], "weights": [1.0] * 8})
    r = _post_fb(api, tc.model_id, [unshifted])
    assert r.status_code == 400 and r.json()["detail"][0]["field"].endswith("target_tokens"), r.text

    r = _post_fb(api, tc.model_id, [good], loss="importance_sampling")  # no logprobs, no advantages
    assert r.status_code == 400 and "needs" in r.json()["message"], r.text

    n = len(SEQS[0]) - 1
    rl = sft_datum(SEQS[0])
    rl = types.Datum(model_input=rl.model_input, loss_fn_inputs={"target_tokens": SEQS[0][1:],
                                                                 "logprobs": [-1.0] * n, "advantages": [1.0] * n})
    r = _post_fb(api, tc.model_id, [rl], loss="dro")  # dro's beta has no default
    assert r.status_code == 400 and r.json()["detail"][0]["field"] == "forward_backward_input.loss_fn_config.beta"
    r = _post_fb(api, tc.model_id, [rl], loss="cispo", config={"clip_ratio": 0.2})
    assert r.status_code == 400 and "clip_high_threshold" in r.json()["detail"][0]["hint"], r.text
    assert _post_fb(api, tc.model_id, [rl], loss="dro", config={"beta": 0.1}).status_code == 200
    gspo = types.Datum(model_input=rl.model_input, loss_fn_inputs={**rl.loss_fn_inputs,
                                                                   "sequence_ratio_mask": [0.0] + [1.0] * (n - 1)})
    assert _post_fb(api, tc.model_id, [gspo], loss="gspo").status_code == 200
    assert _post_fb(api, tc.model_id, [rl], loss="gspo").status_code == 200  # the mask is optional
    r = _post_fb(api, tc.model_id, [gspo], loss="ppo")  # only gspo takes it
    assert r.status_code == 400 and r.json()["detail"][0]["field"].endswith("loss_fn_inputs.sequence_ratio_mask")

    # the SDK raises the 400 to its caller
    with pytest.raises(tinker.BadRequestError, match="weights"):
        tc.forward_backward([short], "cross_entropy").result(timeout=60)


def forward(tc, datums) -> list[list[float]]:
    return [o["logprobs"].tolist() for o in tc.forward(datums, "cross_entropy").result(timeout=300).loss_fn_outputs]


def train(tc, datums, steps: int, lr: float = 2e-2) -> None:
    for _ in range(steps):
        tc.forward_backward(datums, "cross_entropy").result(timeout=300)
        tc.optim_step(types.AdamParams(learning_rate=lr)).result(timeout=120)


def close(a: list[list[float]], b: list[list[float]], tol: float = 1e-4) -> bool:
    return all(abs(x - y) <= tol for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def test_save_state_load_state_and_sampler_weights(api, redis_url):
    tc = training_client(api)
    datums = [sft_datum(s) for s in SEQS]
    train(tc, datums, 2)
    saved = tc.save_state("after-2").result(timeout=300).path
    assert saved == f"tinker://{tc.model_id}/weights/after-2"
    at_save = forward(tc, datums)
    train(tc, datums, 2)
    assert not close(forward(tc, datums), at_save)
    tc.load_state(saved).result(timeout=300)
    assert close(forward(tc, datums), at_save)

    service = tinker.ServiceClient(base_url=api.url, api_key="tml-" + api.token)
    OPEN.append(service)
    twin = service.create_training_client_from_state_with_optimizer(saved).result(timeout=300)
    assert twin.model_id != tc.model_id and twin.get_info().lora_rank == 8
    assert close(forward(twin, datums), at_save)
    rest = tinker.RestClient(base_url=api.url, api_key="tml-" + api.token)
    copied = rest.copy_weights(saved, "archive").result(timeout=60)  # shares the saved folder
    rest.delete_checkpoint_from_tinker_path(saved).result(timeout=60)
    from_copy = service.create_training_client_from_state(copied).result(timeout=300)
    assert close(forward(from_copy, datums), at_save)

    sampler = tc.save_weights_for_sampler("for-sampling").result(timeout=300).path
    assert sampler == f"tinker://{tc.model_id}/sampler_weights/for-sampling"
    with api.client() as admin:
        runs = admin.get("/v1/runs", params={"kind": "tinker", "limit": 200}).json()["data"]
    run_id = next(r["id"] for r in runs if r["name"] == f"tinker {tc.model_id}")
    announced = [decode(f) for _, f in redis.Redis.from_url(redis_url).xrange(WEIGHTS)]
    assert any(w.run_id == run_id for w in announced)  # a version of the model's run, for rollout workers

    other = new_token(api, "tinker-eve")
    r = httpx.post(api.url + "/api/v1/load_weights", timeout=30, headers={"X-API-Key": "tml-" + other},
                   json={"model_id": tc.model_id, "path": saved, "optimizer": False})
    assert r.status_code == 404, r.text  # neither her model nor her checkpoint


def test_a_published_checkpoint_is_loaded_and_sampled_by_another_key_until_unpublished(api, database_url):
    tc = training_client(api)
    datums = [sft_datum(s) for s in SEQS]
    train(tc, datums, 2)
    state = tc.save_state("shared").result(timeout=300).path
    sampler = tc.save_weights_for_sampler("shared-sampler").result(timeout=300).path
    at_save = forward(tc, datums)
    owner = tinker.RestClient(base_url=api.url, api_key="tml-" + api.token)
    eve_key = new_token(api, "tinker-eve-public")
    eve = tinker.ServiceClient(base_url=api.url, api_key="tml-" + eve_key)
    OPEN.append(eve)
    eve_rest = tinker.RestClient(base_url=api.url, api_key="tml-" + eve_key)
    prompt = types.ModelInput.from_ints(SEQS[0][:4])

    with pytest.raises(tinker.NotFoundError):  # private: not hers to load
        eve.create_training_client_from_state(state).result(timeout=300)
    with pytest.raises(tinker.NotFoundError):
        eve.create_sampling_client(model_path=sampler).result(timeout=120)
    with pytest.raises(tinker.NotFoundError):  # nor to publish
        eve_rest.publish_checkpoint_from_tinker_path(state).result(timeout=60)

    owner.publish_checkpoint_from_tinker_path(state).result(timeout=60)
    owner.publish_checkpoint_from_tinker_path(sampler).result(timeout=60)
    assert {c.tinker_path: c.public for c in owner.list_checkpoints(tc.model_id).result(timeout=60).checkpoints} == \
        {state: True, sampler: True}
    twin = eve.create_training_client_from_state(state).result(timeout=300)  # the trainer loads another key's
    assert close(forward(twin, datums), at_save)
    mine = training_client(api, eve_key)
    mine.load_state(state).result(timeout=300)
    assert close(forward(mine, datums), at_save)
    sampled = eve.create_sampling_client(model_path=sampler).result(timeout=120)
    out = sampled.sample(prompt, 1, types.SamplingParams(max_tokens=4)).result(timeout=300)
    assert 1 <= len(out.sequences[0].tokens) <= 4
    # her samples are hers: stored in a run of her key's, not in the publisher's run that served them
    engine = create_engine(database_url)

    def stored_by() -> str | None:
        with engine.connect() as c:
            return c.execute(text("SELECT r.config->>'owner_name' FROM episodes e JOIN runs r ON r.id = e.run_id "
                                  "WHERE e.info->>'sequence_id' = :id"), {"id": out.sequences[0].sequence_id}).scalar()
    assert wait_until(stored_by, timeout_s=60, what="her sample stored") == "tinker-eve-public"
    engine.dispose()

    owner.unpublish_checkpoint_from_tinker_path(state).result(timeout=60)
    owner.unpublish_checkpoint_from_tinker_path(sampler).result(timeout=60)
    assert not any(c.public for c in owner.list_checkpoints(tc.model_id).result(timeout=60).checkpoints)
    with pytest.raises(tinker.NotFoundError):
        eve.create_training_client_from_state(state).result(timeout=300)
    with pytest.raises(tinker.NotFoundError):  # onto her own model neither
        mine.load_state(state).result(timeout=300)
    with pytest.raises(tinker.NotFoundError):
        eve.create_sampling_client(model_path=sampler).result(timeout=120)


def test_deleted_and_expired_checkpoints_are_gone_and_their_files_removed(api, redis_url):
    """A deleted checkpoint is gone at once (not listed, not loadable); one past its ttl too; the trainer then
    removes their folders and records, and leaves the others alone. Another key can delete nothing."""
    tc = training_client(api)
    train(tc, [sft_datum(s) for s in SEQS], 1)
    kept, doomed = (tc.save_state(name).result(timeout=300).path for name in ("kept", "doomed"))
    brief = tc.save_state("brief", ttl_seconds=3).result(timeout=300).path
    r = redis.Redis.from_url(redis_url)
    folders = {p: Path(json.loads(r.get("tinker:checkpoint:" + p))["folder"]) for p in (kept, doomed, brief)}
    assert all(f.is_dir() for f in folders.values())
    rest = tinker.RestClient(base_url=api.url, api_key="tml-" + api.token)

    def listed() -> dict:
        return {c.tinker_path: c for c in rest.list_checkpoints(tc.model_id).result(timeout=60).checkpoints}

    assert listed()[kept].expires_at is None
    # a name is taken until deleted, unless the save says overwrite; metadata goes with the checkpoint
    with pytest.raises(tinker.BadRequestError, match="exists already"):
        tc.save_state("kept").result(timeout=300)
    assert tc.save_state("kept", overwrite=True, user_metadata={"step": "1"}).result(timeout=300).path == kept
    assert listed()[kept].user_metadata == {"step": "1"}
    stranger = httpx.delete(f"{api.url}/api/v1/training_runs/{tc.model_id}/checkpoints/weights/kept",
                            headers={"X-API-Key": "tml-" + new_token(api, "tinker-mallory")})
    assert stranger.status_code == 404, stranger.text
    rest.delete_checkpoint_from_tinker_path(doomed).result(timeout=60)
    assert doomed not in listed()
    with pytest.raises(Exception, match="does not exist"):
        tc.load_state(doomed).result(timeout=300)

    rest.set_checkpoint_ttl_from_tinker_path(kept, 7200).result(timeout=60)
    assert listed()[kept].expires_at is not None
    rest.set_checkpoint_ttl_from_tinker_path(kept, None).result(timeout=60)
    assert listed()[kept].expires_at is None

    wait_until(lambda: brief not in listed(), timeout_s=60, what="the 3 s checkpoint to expire")
    wait_until(lambda: not folders[doomed].exists() and not folders[brief].exists(), timeout_s=60,
               what="the trainer to remove the deleted and the expired checkpoints' folders")
    assert folders[kept].is_dir() and r.get("tinker:checkpoint:" + doomed) is None
    tc.load_state(kept).result(timeout=300)  # what was kept still loads


def test_a_restarted_trainer_resumes_each_model_from_its_last_save(api):
    saver, unsaved = training_client(api), training_client(api)
    datums = [sft_datum(s) for s in SEQS]
    train(saver, datums, 2)
    train(unsaved, datums, 1)
    saver.save_state("before-crash").result(timeout=300)
    at_save = forward(saver, datums)
    train(saver, datums, 2)  # lost with the trainer
    api.kill_trainer()
    api.start_trainer()
    assert close(forward(saver, datums), at_save)  # from its last save_state on
    with pytest.raises(Exception, match="weights are lost"):  # never a fresh adapter in its place
        unsaved.forward(datums, "cross_entropy").result(timeout=300)


def held_by(api, worker_id: str) -> set[str]:
    raw = redis.Redis.from_url(api.redis_url).get(f"heartbeat:trainer:{worker_id}")
    return set(json.loads(raw).get("tinker_models", [])) if raw else set()


def test_a_fleet_of_trainers_serves_each_model_on_its_holder_and_takes_over_a_dead_ones(api):
    """Two trainers read `tinker.requests`: every operation of a model is served by the one holding it, whichever
    trainer a wake reaches; a holder killed, the other takes its model over once the lease lapses, from its last
    save_state, with the operation sent meanwhile answered."""
    second = api.start_trainer("trainer-tinker-2")
    trainers = {"trainer-tinker": api.trainer, "trainer-tinker-2": second}
    try:
        clients = [training_client(api) for _ in range(4)]
        datums = [sft_datum(s) for s in SEQS]
        for tc in clients:  # each op's wake reaches either trainer: none may fail as held elsewhere
            train(tc, datums, 2)
        def holders() -> dict[str, set[str]] | None:  # each model in exactly one trainer's heartbeat
            h = {tc.model_id: {w for w in trainers if tc.model_id in held_by(api, w)} for tc in clients}
            return h if all(len(w) == 1 for w in h.values()) else None

        (dead,) = wait_until(holders, timeout_s=30, what="each model held by one trainer")[clients[0].model_id]

        tc = clients[0]
        tc.save_state("before-takeover").result(timeout=300)
        at_save = forward(tc, datums)
        train(tc, datums, 1)  # lost with its holder
        trainers[dead].kill()
        trainers[dead].wait(30)
        # sent while the dead holder's lease still stands: answered by the survivor once it lapses
        assert close(forward(tc, datums), at_save)
        (survivor,) = set(trainers) - {dead}
        wait_until(lambda: tc.model_id in held_by(api, survivor), timeout_s=30, what="the survivor to hold it")
        train(tc, datums, 1)  # and trained on there
    finally:
        stop(second)
        if api.trainer.poll() is not None:
            api.start_trainer()


def test_samples_of_a_base_model_and_of_trained_weights_are_served_and_stored(api, database_url):
    service = tinker.ServiceClient(base_url=api.url, api_key="tml-" + api.token)
    OPEN.append(service)
    prompt = types.ModelInput.from_ints(SEQS[0][:4])
    base = service.create_sampling_client(base_model=BASE).result(timeout=120)
    out = base.sample(prompt, 3, types.SamplingParams(max_tokens=6)).result(timeout=300)
    assert len(out.sequences) == 3
    for seq in out.sequences:
        assert 1 <= len(seq.tokens) <= 6 and len(seq.logprobs) == len(seq.tokens) and seq.sequence_id
    greedy = base.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0)).result(timeout=300)
    tokens = greedy.sequences[0].tokens
    stop_at = tokens[2]
    cut = base.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[stop_at])).result(timeout=300)
    assert cut.sequences[0].tokens == tokens[:tokens.index(stop_at) + 1] and cut.sequences[0].stop_reason == "stop"

    # a trained adapter, sampled on the rollout worker: its logprobs are the trainer's for the same tokens
    tc = training_client(api)
    train(tc, [sft_datum(s) for s in SEQS], 3)
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=300)
    sampled = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=5)).result(timeout=300)
    for seq in sampled.sequences:
        full = SEQS[0][:4] + seq.tokens
        datum = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                            loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)})
        trainer_lp = forward(tc, [datum])[0][3:]
        assert close([trainer_lp], [list(seq.logprobs)], tol=1e-3), (trainer_lp, seq.logprobs)

    # every sample is a stored episode of the sampling run, found by the sequence id the SDK returned
    ids = [s.sequence_id for s in out.sequences + sampled.sequences]
    engine = create_engine(database_url)

    def stored() -> int:
        with engine.connect() as c:
            return c.execute(text("SELECT count(*) FROM episodes e JOIN trajectories t ON t.episode_id = e.id "
                                  "WHERE e.info->>'sequence_id' = ANY(:ids)"), {"ids": ids}).scalar()
    wait_until(lambda: stored() == len(ids), timeout_s=60, what="the samples stored as episodes")
    engine.dispose()


def test_a_sampler_of_older_sampler_weights_serves_them_beside_newer_ones(api):
    """The cookbook's async RL samples from a model's earlier sampler weights while the trainer moves on: a sampler
    keeps serving the version it was made of after newer ones are published, side by side with the newest (a
    version the weight server no longer keeps is refused with the reason: tests/unit/rollout)."""
    tc = training_client(api)
    datums = [sft_datum(s) for s in SEQS]
    scored = types.ModelInput.from_ints(SEQS[1])
    train(tc, datums, 2)
    first = tc.save_weights_and_get_sampling_client().result(timeout=300)
    first_lp = first.compute_logprobs(scored).result(timeout=300)[1:]
    train(tc, datums, 2)
    second = tc.save_weights_and_get_sampling_client().result(timeout=300)
    second_lp = second.compute_logprobs(scored).result(timeout=300)[1:]
    assert not close([first_lp], [second_lp], tol=1e-3)  # training moved the adapter

    both = [first.compute_logprobs(scored), second.compute_logprobs(scored)]  # served together
    assert close([both[0].result(timeout=300)[1:]], [first_lp], tol=1e-5)
    assert close([both[1].result(timeout=300)[1:]], [second_lp], tol=1e-5)

    # the newest again, and the older one still loaded beside it
    assert close([second.compute_logprobs(scored).result(timeout=300)[1:]], [second_lp], tol=1e-5)
    assert close([first.compute_logprobs(scored).result(timeout=300)[1:]], [first_lp], tol=1e-5)


def test_a_named_sampler_checkpoint_outlives_retention_until_deleted(api):
    """A named save_weights_for_sampler checkpoint is pinned on the weight server: once the model has published
    more newer versions than the weight server keeps (KEEP_LAST), a sampler made from it still serves its weights;
    deleted, the trainer's sweep unpins it and retention removes the version."""
    tc = training_client(api)
    datums = [sft_datum(s) for s in SEQS]
    scored = types.ModelInput.from_ints(SEQS[1])
    train(tc, datums, 1)
    path = tc.save_weights_for_sampler("keep-me").result(timeout=300).path
    service = tinker.ServiceClient(base_url=api.url, api_key="tml-" + api.token)
    OPEN.append(service)
    pinned_lp = service.create_sampling_client(model_path=path).result(timeout=60) \
        .compute_logprobs(scored).result(timeout=300)[1:]
    with api.client() as admin:
        runs = admin.get("/v1/runs", params={"kind": "tinker", "limit": 200}).json()["data"]
    run_id = next(r["id"] for r in runs if r["name"] == f"tinker {tc.model_id}")

    def versions() -> list[int]:
        return [v["version"] for v in httpx.get(f"{api.ws.url}/v1/runs/{run_id}/versions", timeout=30).json()]

    (pinned,) = versions()
    train(tc, datums, 2)
    keep_last = int(api.ws.env["KEEP_LAST"])
    for _ in range(keep_last + 1):  # a sampler's own (unnamed) weights: kept only among the newest
        newest = tc.save_weights_and_get_sampling_client().result(timeout=300)
    wait_until(lambda: len(versions()) == keep_last + 1, 30, "retention of the unnamed versions")
    assert versions()[0] == pinned
    again = service.create_sampling_client(model_path=path).result(timeout=60) \
        .compute_logprobs(scored).result(timeout=300)[1:]
    assert close([again], [pinned_lp], tol=1e-5)
    assert not close([newest.compute_logprobs(scored).result(timeout=300)[1:]], [pinned_lp], tol=1e-3)

    tinker.RestClient(base_url=api.url, api_key="tml-" + api.token).delete_checkpoint_from_tinker_path(path) \
        .result(timeout=60)
    wait_until(lambda: pinned not in versions(), 60, "the trainer's sweep to unpin the deleted checkpoint")
    assert len(versions()) == keep_last


def test_a_sample_cancelled_before_the_rollout_worker_reads_it_is_dropped(api, database_url, redis_url):
    """A sample the client abandons while the rollout worker is paused (SIGSTOP) is cancelled (`cancel_future`);
    resumed, the worker acknowledges it without generating or storing anything, and its future keeps the
    cancel's answer; the next sample is served as usual."""
    import signal

    service = tinker.ServiceClient(base_url=api.url, api_key="tml-" + api.token)
    OPEN.append(service)
    base = service.create_sampling_client(base_model=BASE).result(timeout=120)
    prompt = types.ModelInput.from_ints(SEQS[0][:4])
    api.rollout.send_signal(signal.SIGSTOP)
    try:
        abandoned = base.sample(prompt, 2, types.SamplingParams(max_tokens=6))
        with pytest.raises(TimeoutError):
            abandoned.result(timeout=3)
        abandoned.future().cancel()
        client = redis.Redis.from_url(redis_url)

        def marked() -> list[str]:  # the request ids the rollout workers are told to drop
            return [k.decode().split(":", 2)[2] for k in client.scan_iter("tinker:cancelled:*")]

        (request_id,) = wait_until(marked, 30, "the SDK's cancel_future")
    finally:
        api.rollout.send_signal(signal.SIGCONT)
    served = base.sample(prompt, 1, types.SamplingParams(max_tokens=4)).result(timeout=300)
    assert served.sequences[0].tokens
    wait_until(lambda: client.xpending("tinker.samples", "rollout")["pending"] == 0, 30, "both requests acknowledged")
    r = httpx.post(api.url + "/api/v1/retrieve_future", json={"request_id": request_id},
                   headers={"X-API-Key": "tml-" + api.token}, timeout=30)
    assert "cancelled" in r.json().get("error", ""), r.text  # not overwritten by a worker's answer
    engine = create_engine(database_url)
    with engine.connect() as c:
        stored = c.execute(text("SELECT count(*) FROM episodes WHERE task_id = :t"),
                           {"t": request_id}).scalar()
    engine.dispose()
    assert stored == 0


def test_compute_logprobs_and_top_k_logprobs_are_the_models(api):
    """compute_logprobs on trained sampler weights gives the trainer's logprobs of the same tokens; the last n
    alone when asked; top-k logprobs of sampled and prompt positions hold each token's own logprob; a seed fixes
    the samples."""
    tc = training_client(api)
    train(tc, [sft_datum(s) for s in SEQS], 2)
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=300)
    seq = SEQS[1]
    datum = types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                        loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)})
    trainer_lp = forward(tc, [datum])[0]
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(seq)).result(timeout=300)
    assert scored[0] is None and close([scored[1:]], [trainer_lp], tol=1e-3), (scored, trainer_lp)
    last = sampler.compute_logprobs(types.ModelInput.from_ints(seq), prompt_logprobs_last_n=3).result(timeout=300)
    assert last[:-3] == [None] * (len(seq) - 3) and close([last[-3:]], [scored[-3:]], tol=1e-5)

    out = sampler.sample(types.ModelInput.from_ints(seq[:4]), 2, types.SamplingParams(max_tokens=4, top_k=3),
                         include_prompt_logprobs=True, topk_prompt_logprobs=2, topk_sample_logprobs=5,
                         ).result(timeout=300)
    assert out.prompt_logprobs[0] is None and close([out.prompt_logprobs[1:]], [scored[1:4]], tol=1e-5)
    for position, (token, lp) in enumerate(zip(seq[1:4], scored[1:4], strict=True), start=1):
        top = out.topk_prompt_logprobs[position]
        assert len(top) == 2 and top[0][1] >= lp - 1e-5 and dict(top).get(token, lp) == pytest.approx(lp, abs=1e-5)
    for sample in out.sequences:
        assert len(sample.topk_logprobs) == len(sample.tokens)
        for token, lp, top in zip(sample.tokens, sample.logprobs, sample.topk_logprobs, strict=True):
            assert 1 <= len(top) <= 3 and dict(top)[token] == pytest.approx(lp, abs=1e-4)  # top_k 3 left 3 at most

    # a seed fixes the samples: the same request again draws the same ones
    seeded = [sampler.sample(types.ModelInput.from_ints(seq[:4]), 2, types.SamplingParams(max_tokens=6, seed=11))
              .result(timeout=300) for _ in range(2)]
    assert [s.tokens for s in seeded[0].sequences] == [s.tokens for s in seeded[1].sequences]

    # asked of the server without the SDK's own checks: a clear 400 naming the field
    r = httpx.post(api.url + "/api/v1/asample", headers={"X-API-Key": "tml-" + api.token}, json={
        "sampling_session_id": sampler._sampling_session_id, "num_samples": 1, "prompt_logprobs": True,
        "prompt_logprobs_last_n": len(seq), "sampling_params": {"max_tokens": 1},
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": seq}]}})
    assert r.status_code == 400 and "prompt_logprobs_last_n" in r.text, r.text


def test_target_prompt_logprobs_and_prompt_alt_tokens_are_the_models(api):
    """target_prompt_logprobs score the ids asked for at each prompt position (the prompt's own tokens give its
    prompt logprobs; a sparse request is answered sparse); prompt_alt_tokens_k draws k ids per position whose
    logprobs are the model's (scored again as targets), the same ones again under the same seed."""
    torch = pytest.importorskip("torch")
    service = tinker.ServiceClient(base_url=api.url, api_key="tml-" + api.token)
    OPEN.append(service)
    base = service.create_sampling_client(base_model=BASE).result(timeout=120)
    seq = SEQS[1]
    prompt, rows = types.ModelInput.from_ints(seq), len(seq) - 1
    one_token = types.SamplingParams(max_tokens=1, temperature=1.0)
    ids = torch.full((rows, 2), -1, dtype=torch.int64)
    ids[:, 0] = torch.tensor(seq[1:])
    ids[2, 1], ids[5, 1] = 3, 99
    out = base.sample(prompt, 1, one_token, include_prompt_logprobs=True, topk_prompt_logprobs=1,
                      target_prompt_logprobs=types.TensorData.from_torch(ids)).result(timeout=300)
    got = out.target_prompt_logprobs.to_torch()
    assert list(got.shape) == [rows, 2]
    assert close([got[:, 0].tolist()], [out.prompt_logprobs[1:]], tol=1e-5)
    assert got[0, 1].item() == 0.0  # a cell not asked for
    assert got[2, 1].item() <= out.topk_prompt_logprobs[3][0][1] + 1e-5  # row 2 is position 3: not above its top

    few = torch.full((rows, 4), -1, dtype=torch.int64)  # sparse enough that the SDK sends it as CSR
    few[0, 0], few[2, 3], few[5, 1] = seq[1], 3, 99
    sparse = base.sample(prompt, 1, one_token, target_prompt_logprobs=types.TensorData.from_torch_sparse(
        few, pad_value=-1)).result(timeout=300).target_prompt_logprobs
    assert sparse.sparse_crow_indices is not None and sparse.sparse_col_indices == [0, 3, 1]
    assert close([list(sparse.data)], [[got[0, 0].item(), got[2, 1].item(), got[5, 1].item()]], tol=1e-5)

    drawn = [base.sample(prompt, 1, types.SamplingParams(max_tokens=1, temperature=1.0, seed=7),
                         prompt_alt_tokens_k=3).result(timeout=300).prompt_alt_tokens for _ in range(2)]
    tokens = drawn[0].tokens.to_torch()
    assert list(tokens.shape) == [rows, 3] and torch.equal(tokens, drawn[1].tokens.to_torch())
    rescored = base.sample(prompt, 1, one_token, target_prompt_logprobs=types.TensorData.from_torch(tokens)
                           ).result(timeout=300).target_prompt_logprobs.to_torch()
    assert close([rescored.flatten().tolist()], [drawn[0].logprobs.to_torch().flatten().tolist()], tol=1e-5)

    # asked of the server without the SDK's own checks: a clear 400 naming the field
    r = httpx.post(api.url + "/api/v1/asample", headers={"X-API-Key": "tml-" + api.token}, json={
        "sampling_session_id": base._sampling_session_id, "num_samples": 1, "sampling_params": {"max_tokens": 1},
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": seq}]},
        "target_prompt_logprobs": {"data": [1, 2], "dtype": "int64", "shape": [2, 1]}})
    assert r.status_code == 400 and "target_prompt_logprobs.shape" in r.text, r.text


def test_futures_outlive_an_api_restart_mid_session(api):
    """Futures and operations live in Redis, not in the API process: an operation in flight when the API is
    killed completes, and the session goes on against the restarted API."""
    tc = training_client(api)
    datums = [sft_datum(s) for s in SEQS]
    before = forward(tc, datums)
    pending = tc.forward_backward(datums, "cross_entropy")  # sent (or retried by the SDK) around the restart
    api.restart_api()
    assert pending.result(timeout=300).metrics["loss:sum"] > 0
    tc.optim_step(types.AdamParams(learning_rate=2e-2)).result(timeout=120)
    assert not close(forward(tc, datums), before)  # the step after the restart applied the gradients from before it


def test_the_rest_clients_listings_show_a_keys_training_runs_and_checkpoints(api):
    tc = training_client(api)
    train(tc, [sft_datum(SEQS[0])], 1)
    state = tc.save_state("listed").result(timeout=300).path
    sampler = tc.save_weights_for_sampler("listed-sampler").result(timeout=300).path
    rest = tinker.ServiceClient(base_url=api.url, api_key="tml-" + api.token)
    OPEN.append(rest)
    client = rest.create_rest_client()
    run = client.get_training_run(tc.model_id).result(timeout=60)
    assert (run.base_model, run.lora_rank, run.is_lora) == (BASE, 8, True)
    assert run.last_checkpoint.tinker_path == state and run.last_sampler_checkpoint.tinker_path == sampler
    assert [c.tinker_path for c in client.list_checkpoints(tc.model_id).result(timeout=60).checkpoints] == [state, sampler]
    runs = client.list_training_runs(limit=200).result(timeout=60)
    assert tc.model_id in {r.training_run_id for r in runs.training_runs}
    assert runs.cursor.total_count >= 1
    assert state in {c.tinker_path for c in client.list_user_checkpoints(limit=500).result(timeout=60).checkpoints}
    info = client.get_weights_info_by_tinker_path(state).result(timeout=60)
    assert (info.base_model, info.lora_rank) == (BASE, 8)

    eve = tinker.ServiceClient(base_url=api.url, api_key="tml-" + new_token(api, "tinker-eve-lists"))
    OPEN.append(eve)
    theirs = eve.create_rest_client()
    assert tc.model_id not in {r.training_run_id for r in theirs.list_training_runs(limit=200).result(timeout=60).training_runs}
    with pytest.raises(Exception, match="does not exist"):
        theirs.get_training_run(tc.model_id).result(timeout=60)


def test_usage_counts_what_the_trainer_and_the_rollout_worker_did_for_a_key(api):
    """The billing usage of a key of its own: the input tokens of each forward_backward and forward, one
    checkpoint per save, the prompt and the sampled tokens of each sample; and the bytes its checkpoints store."""
    from datetime import UTC, datetime, timedelta

    token = new_token(api, "tinker-billed")
    tc = training_client(api, token)
    datums = [sft_datum(s) for s in SEQS]
    train(tc, datums, 2)
    forward(tc, datums[:1])
    tc.save_state("billed").result(timeout=300)
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=300)
    prompt = types.ModelInput.from_ints(SEQS[0][:4])
    out = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=5)).result(timeout=300)

    admin = tinker.AdminClient(base_url=api.url, api_key="tml-" + token)
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    totals: dict[str, int] = {}
    gigabyte_hours = 0.0
    for e in admin.get_billing_usage(hour - timedelta(hours=1), hour + timedelta(hours=1)).result(timeout=60).data:
        assert e.base_model == BASE, e
        if e.event_info.type == "storage":  # what the key's checkpoints held (no session)
            assert e.session_id is None
            gigabyte_hours += e.event_info.gigabyte_hours
            continue
        assert e.session_id == tc.model_id.split(":")[0], e
        n = e.event_info.count if e.event_info.type == "checkpoint" else e.event_info.token_count
        totals[e.event_info.type] = totals.get(e.event_info.type, 0) + n
    assert gigabyte_hours > 0
    inputs = sum(d.model_input.length for d in datums)
    assert totals == {"training": 2 * inputs + datums[0].model_input.length, "checkpoint": 2,
                      "sampling_prefill": 4, "sampling_sample": sum(len(q.tokens) for q in out.sequences)}, totals

    rest = tinker.RestClient(base_url=api.url, api_key="tml-" + token)
    listed = rest.list_user_checkpoints(limit=100).result(timeout=60).checkpoints
    assert listed and all(c.size_bytes and c.size_bytes > 0 for c in listed), listed
    [stored] = admin.get_current_checkpoint_storage_usage().result(timeout=60).data
    assert (stored.checkpoint_count, stored.size_bytes) == (len(listed), sum(c.size_bytes for c in listed))


def peft_logprobs(base_dir: Path, adapter_dir: Path, datums: list[types.Datum]) -> list[list[float]]:
    """Each datum's target-token logprobs under the base model with the adapter loaded by PEFT (as a user of the
    export would load it)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    out = []
    for d in datums:
        with torch.no_grad():
            logits = model(torch.tensor([d.model_input.to_ints()])).logits[0].float()
        targets = torch.tensor(d.loss_fn_inputs["target_tokens"].tolist())
        out.append(torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0].tolist())
    return out


def test_external_weights_are_the_adapter_in_peft_layout_behind_signed_urls(api, tmp_path):
    """save_weights_external: the adapter PEFT loads onto the base (it scores as the trainer's model does), listed
    as an external checkpoint, downloaded with no key through signed URLs that serve no other file and no other
    key; encrypted to age recipients when asked; gone, files and all, once deleted."""
    tc = training_client(api)
    datums = [sft_datum(s) for s in SEQS]
    train(tc, datums, 2)
    trained = forward(tc, datums)
    path = tc.save_weights_external("final").result(timeout=300).path
    assert path == f"tinker://{tc.model_id}/external_weights/final"
    identity = pyrage.x25519.Identity.generate()
    sealed = tc.save_weights_external("sealed", age_encryption_recipients=[str(identity.to_public())]
                                      ).result(timeout=300).path
    with pytest.raises(tinker.BadRequestError, match="not an age recipient"):
        tc.save_weights_external("bad", age_encryption_recipients=["age1nope"]).result(timeout=60)

    rest = tinker.RestClient(base_url=api.url, api_key="tml-" + api.token)
    signed = rest.get_external_weights_urls(path).result(timeout=60)
    assert sorted(signed.urls) == ["adapter_config.json", "adapter_model.safetensors"]
    export = tmp_path / "export"
    export.mkdir()
    for name, url in signed.urls.items():
        with urllib.request.urlopen(url, timeout=60) as r:  # no key: the URL is the credential
            (export / name).write_bytes(r.read())
    listed = {c.tinker_path: c for c in rest.list_checkpoints(tc.model_id).result(timeout=60).checkpoints}
    assert listed[path].checkpoint_type == "external"
    assert listed[path].size_bytes == sum(f.stat().st_size for f in export.iterdir())
    assert close(peft_logprobs(api.model_dir, export, datums), trained, tol=1e-3)

    sealed_urls = rest.get_external_weights_urls(sealed).result(timeout=60).urls
    assert sorted(sealed_urls) == ["adapter_config.json.age", "adapter_model.safetensors.age"]
    ciphertext = httpx.get(sealed_urls["adapter_model.safetensors.age"], timeout=60).content
    assert pyrage.decrypt(ciphertext, [identity]) == (export / "adapter_model.safetensors").read_bytes()

    url = signed.urls["adapter_model.safetensors"]
    forged = httpx.get(url.replace("adapter_model.safetensors", "adapter_config.json"), timeout=30)
    assert forged.status_code == 403 and "signature does not match" in forged.text
    eve = tinker.RestClient(base_url=api.url, api_key="tml-" + new_token(api, "tinker-eve-export"))
    with pytest.raises(tinker.NotFoundError):
        eve.get_external_weights_urls(path).result(timeout=60)

    exported = next((api.data_dir / "weights" / "exports").glob("*/final"))
    rest.delete_checkpoint_from_tinker_path(path).result(timeout=60)
    assert httpx.get(url, timeout=30).status_code == 404
    wait_until(lambda: not exported.exists(), timeout_s=60, what="the trainer to remove the deleted export's files")
    assert (exported.parent / "sealed").is_dir()


def test_the_tinker_clis_checkpoint_download_exports_a_saved_state(api, tmp_path):
    """`tinker checkpoint download tinker://.../weights/<name>`, unmodified: the CLI loads the state into a new
    model, exports it (save_weights_external), downloads the files through signed URLs, and deletes the export."""
    tc = training_client(api)
    train(tc, [sft_datum(SEQS[0])], 1)
    state = tc.save_state("to-download").result(timeout=300).path
    env = {**os.environ, "TINKER_BASE_URL": api.url, "TINKER_API_KEY": "tml-" + api.token}
    done = subprocess.run([sys.executable, "-m", "tinker.cli", "checkpoint", "download", state, "--output",
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    folder = tmp_path / state.removeprefix("tinker://").replace("/", "_")
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 8
    rest = tinker.RestClient(base_url=api.url, api_key="tml-" + api.token)
    left = rest.list_user_checkpoints(limit=1000).result(timeout=60).checkpoints
    assert not [c for c in left if c.checkpoint_type == "external" and c.checkpoint_id == "external_weights/download"]


def test_a_pickled_sampling_client_joins_its_session_and_samples(api):
    """A SamplingClient pickled (to go to another worker of the user's) joins its sampling session before its
    first sample (the client config turns join_sampling_session on): each copy gets its own number, and samples
    as the original does. Another key cannot join the session."""
    import pickle

    service = tinker.ServiceClient(base_url=api.url, api_key="tml-" + api.token)
    OPEN.append(service)
    base = service.create_sampling_client(base_model=BASE).result(timeout=120)
    prompt, greedy = types.ModelInput.from_ints(SEQS[1][:4]), types.SamplingParams(max_tokens=4, temperature=0.0)
    copies = [pickle.loads(pickle.dumps(base)) for _ in range(2)]
    tokens = [c.sample(prompt, 1, greedy).result(timeout=300).sequences[0].tokens for c in [base, *copies]]
    assert tokens[0] == tokens[1] == tokens[2] and tokens[0]
    assert sorted(c._cloned_sampler_id for c in copies) == [1, 2]  # numbered by the server, apart from the original
    r = httpx.post(api.url + "/api/v1/join_sampling_session", json={"sampling_session_id": base._sampling_session_id},
                   headers={"X-API-Key": "tml-" + new_token(api, "tinker-eve-join")}, timeout=30)
    assert r.status_code == 404, r.text


def test_each_answer_is_announced_on_its_clients_completion_queue(api, redis_url):
    """retrieve_futures (turned on in the client config, so the SDK's samples above waited on it): a sample's
    answer appears on the queue of the client that sent it (seq_id // 1e9), once; a poll from its cursor trims
    what came before and waits no longer than asked; another key's session is a 404."""
    service = tinker.ServiceClient(base_url=api.url, api_key="tml-" + api.token)
    OPEN.append(service)
    base = service.create_sampling_client(base_model=BASE).result(timeout=120)
    assert service.holder.get_client_config().sample_use_retrieve_futures
    session, key = base._sampling_session_id, {"X-API-Key": "tml-" + api.token}

    def sample(seq_id: int) -> str:
        r = httpx.post(api.url + "/api/v1/asample", headers=key, timeout=30, json={
            "sampling_session_id": session, "seq_id": seq_id, "num_samples": 1, "sampling_params": {"max_tokens": 2},
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": SEQS[0][:4]}]}})
        assert r.status_code == 200, r.text
        return r.json()["request_id"]

    def poll(clone: int, cursor: int, timeout: float = 60) -> dict:
        r = httpx.post(api.url + "/api/v1/retrieve_futures", headers=key, timeout=90, json={
            "target": {"sampling_session_id": session, "cloned_sampler_id": clone}, "prev_cursor": cursor,
            "timeout": timeout})
        assert r.status_code == 200, r.text
        return r.json()

    mine, theirs = sample(7), sample(3 * 1_000_000_000 + 7)
    seen, cursor = [], 0
    while len(seen) < 1:
        got = poll(0, cursor)
        seen += got["completions"]
        cursor = got["cursor"]
    assert seen == [{"state": "finished", "request_id": mine}]
    assert poll(3, 0)["completions"] == [{"state": "finished", "request_id": theirs}]
    assert poll(0, cursor, timeout=0) == {"completions": [], "cursor": cursor}  # nothing new: answered at once
    assert redis.Redis.from_url(redis_url).xlen(f"tinker:completions:{session}:0") == 0  # seen, so trimmed
    r = httpx.post(api.url + "/api/v1/retrieve_futures", timeout=30,
                   headers={"X-API-Key": "tml-" + new_token(api, "tinker-eve-poll")},
                   json={"target": {"sampling_session_id": session}, "prev_cursor": 0, "timeout": 0})
    assert r.status_code == 404, r.text


def test_a_sessions_trace_shows_each_request_on_its_models_lane(api):
    """export_session_trace: a signed URL (no key needed to fetch it) to the session's trace, which holds each
    training and sampling request from when the API took it to when its result was written; another key gets
    no URL, and an altered URL is refused."""
    import urllib.request

    service = tinker.ServiceClient(base_url=api.url, api_key="tml-" + api.token)
    OPEN.append(service)
    tc = service.create_lora_training_client(base_model=BASE, rank=4).result(timeout=60)
    train(tc, [sft_datum(SEQS[0])], 1)
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=300)
    sampler.sample(types.ModelInput.from_ints(SEQS[0][:4]), 1, types.SamplingParams(max_tokens=3)).result(timeout=300)
    session = tc.model_id.split(":")[0]
    rest = tinker.RestClient(base_url=api.url, api_key="tml-" + api.token)
    url = rest.export_session_trace(session).result(timeout=60)
    with urllib.request.urlopen(url, timeout=60) as r:
        trace = json.loads(r.read())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in events] == ["forward_backward", "optim_step", "save_weights_for_sampler", "sample"]
    assert all(e["args"]["state"] == "finished" and e["dur"] > 0 for e in events), events
    assert all(a["ts"] + a["dur"] <= b["ts"] for a, b in zip(events[:3], events[1:], strict=True))  # in seq order
    lanes = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert lanes[events[0]["tid"]] == tc.model_id and lanes[events[-1]["tid"]].startswith(f"{session}:sample:")
    assert httpx.get(url.replace("expires=", "expires=1"), timeout=30).status_code == 403
    eve = tinker.RestClient(base_url=api.url, api_key="tml-" + new_token(api, "tinker-eve-trace"))
    with pytest.raises(tinker.NotFoundError):
        eve.export_session_trace(session).result(timeout=60)
