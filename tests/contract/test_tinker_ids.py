"""The Tinker ids the API, trainer and rollout worker agree on: a training model's id, its checkpoints' paths and a
sampled sequence's id."""

from shared.contracts.tinker_run import (
    checkpoint_path,
    parse_checkpoint_path,
    parse_sequence_id,
    sequence_id,
    session_of_model,
    training_model_id,
)


def test_a_training_model_id_names_its_session():
    session = "1f0c2a6e-9d1b-4c5e-8f00-6a7b8c9d0e1f"
    model_id = training_model_id(session, 3)
    assert model_id == f"{session}:train:3"  # what the SDK derives itself: it must match
    assert session_of_model(model_id) == session
    assert session_of_model(training_model_id("a:b", 0)) == "a:b"


def test_a_checkpoint_path_round_trips_and_others_are_refused():
    model_id = training_model_id("s", 1)
    assert parse_checkpoint_path(checkpoint_path(model_id, "weights", "step-2")) == (model_id, "weights", "step-2")
    for bad in ("tinker://s:train:1/bogus/x", "tinker://s:train:1/weights/", "s:train:1/weights/x",
                "tinker://s:train:1/weights/x/y"):
        assert parse_checkpoint_path(bad) is None, bad


def test_a_sequence_id_names_its_request_and_sample_and_others_are_refused():
    request_id = "0b6f6c1e-2a4d-4f7e-9c3b-5d8e7f6a1b2c"  # a future's id
    assert parse_sequence_id(sequence_id(request_id, 3)) == (request_id, 3)
    for bad in ("no-index", ":3", "req:", "req:-1", "req:x"):
        assert parse_sequence_id(bad) is None, bad
