"""stable_reinforce's provenance, as the `tinker` SDK encodes it: the sampled runs of each datum's targets are read
from its spans (a datum without provenance, or whose spans do not tile its targets, is a 400 naming it), and each
sampled run is trained against its sample's recorded logprobs, the tokens checked."""

from __future__ import annotations

import pytest

from services.api.errors import ApiError
from services.api.routers.tinker.provenance import with_recorded_logprobs
from services.api.tinker_proto import (
    ForwardBackwardRequest,
    SampledSpan,
    WireError,
    decode_datums,
    sampled_spans,
)
from shared.contracts.tinker_run import LOSS_INPUTS

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

# a turn: prompt 5 6 (sequence a's prompt) then sampled 7 8 (a's tokens 0..1); the input drops the last token,
# the targets the first
SEQ = [5, 6, 7, 8]


def request(spans: bool = True, tile: int = 0):
    datum = types.Datum(model_input=types.ModelInput.from_ints(SEQ[:-1]),
                        loss_fn_inputs={"target_tokens": SEQ[1:], "logprobs": [0.0, -0.3, -0.4],
                                        "advantages": [0.0, 1.0, 1.0]})
    if spans:
        datum = datum.with_provenance(
            model_input=[types.PromptProvenanceSpan(sequence_id="r1:0", length=2),
                         types.SampledProvenanceSpan(sequence_id="r1:0", length=1)],
            loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id="r1:0", offset=1, length=1),
                            types.SampledProvenanceSpan(sequence_id="r1:0", length=2)])
    fwd = types.ForwardBackwardInput(data=[datum], loss_fn="stable_reinforce")
    msg = ForwardBackwardRequest()
    body = forward_backward_request_to_proto(types.ForwardBackwardRequest(forward_backward_input=fwd,
                                                                          model_id="s:train:0", seq_id=0))
    msg.ParseFromString(body.SerializeToString())
    if tile:  # a span one token longer than the targets
        msg.data[0].loss_fn_input_spans[1].sampled_tokens.length += tile
    return msg


def test_the_sampled_runs_of_each_datums_targets_are_read_from_its_spans():
    msg = request()
    data = decode_datums(msg, LOSS_INPUTS)
    assert sampled_spans(msg, data) == [[SampledSpan("r1:0", start=1, offset=0, length=2)]]


@pytest.mark.parametrize("case", ["no spans", "not tiling"])
def test_a_datum_without_provenance_that_tiles_its_targets_is_refused_naming_it(case):
    msg = request(spans=case != "no spans", tile=1 if case == "not tiling" else 0)
    data = decode_datums(msg, LOSS_INPUTS)
    with pytest.raises(WireError) as e:
        sampled_spans(msg, data)
    assert e.value.field == "forward_backward_input.data[0].loss_fn_input_spans"
    assert "provenance" in e.value.message and "with_provenance" in e.value.hint


def test_sampled_positions_take_the_recorded_logprobs_and_alone_weigh():
    msg = request()
    data = decode_datums(msg, LOSS_INPUTS)
    spans = sampled_spans(msg, data)
    out = with_recorded_logprobs(data, spans, {"r1:0": ([7, 8, 2], [-0.25, -0.5, -1.0])})
    assert out[0].logprobs == [0.0, -0.25, -0.5]  # the client's -0.3, -0.4 replaced by what the sampler recorded
    assert out[0].weights == [0.0, 1.0, 1.0]

    with pytest.raises(ApiError) as e:  # not the sample's tokens
        with_recorded_logprobs(data, spans, {"r1:0": ([7, 9], [-0.25, -0.5])})
    assert e.value.status_code == 400 and "as it was sampled" in e.value.items[0].message
    with pytest.raises(ApiError) as e:  # not a sample of this key's (or not stored)
        with_recorded_logprobs(data, spans, {})
    assert "not a stored sample of this key's" in e.value.items[0].message
    assert e.value.items[0].field == "forward_backward_input.data[0].loss_fn_input_spans[0]"
