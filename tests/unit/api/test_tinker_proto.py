"""The server's protobuf SampleResponse, read back by the `tinker` SDK's own decoder: sampled tokens and their
logprobs, top-k logprobs per sampled and per prompt position, prompt logprobs with unscored positions."""

from __future__ import annotations

import math

import pytest

from services.api.tinker_proto import encode_samples

response_conv = pytest.importorskip("tinker.proto.response_conv")


def test_sample_response_as_the_sdk_reads_it():
    result = {"type": "sample",
              "sequences": [{"tokens": [7, 3], "logprobs": [-0.5, -1.25], "stop_reason": "stop",
                             "topk": [[[7, -0.5], [2, -1.5]], [[1, -0.25], [3, -1.25]]]},
                            {"tokens": [4], "logprobs": [-2.0], "stop_reason": "length", "topk": [[[9, -0.75]]]}],
              "prompt_logprobs": [None, -3.5, -0.125],
              "topk_prompt_logprobs": [None, [[5, -0.5], [6, -1.0], [8, -2.0]], [[2, -0.125]]],
              "prompt_cache_hit_tokens": 2}
    out = response_conv.deserialize_sample_response(encode_samples(result))
    assert out.prompt_cache_hit_tokens == 2
    first, second = out.sequences
    assert first.tokens == [7, 3] and first.logprobs == [-0.5, -1.25] and first.stop_reason == "stop"
    assert second.stop_reason == "length"
    assert first.topk_logprobs == [[(7, -0.5), (2, -1.5)], [(1, -0.25), (3, -1.25)]]
    assert second.topk_logprobs == [[(9, -0.75)]]
    assert out.prompt_logprobs == [None, -3.5, -0.125]
    # rows shorter than the longest are filled with the SDK's sentinel, which its reader drops again
    assert out.topk_prompt_logprobs == [None, [(5, -0.5), (6, -1.0), (8, -2.0)], [(2, -0.125)]]


def test_a_plain_sample_carries_no_logprob_extras():
    out = response_conv.deserialize_sample_response(encode_samples(
        {"sequences": [{"tokens": [1], "logprobs": [-0.1], "stop_reason": "length"}]}))
    assert out.prompt_logprobs is None and out.topk_prompt_logprobs is None
    assert out.sequences[0].topk_logprobs is None
    assert math.isclose(out.sequences[0].logprobs[0], -0.1, rel_tol=1e-6)


def test_target_prompt_logprobs_and_alt_tokens_as_the_sdk_reads_them():
    dense = {"sequences": [{"tokens": [1], "logprobs": [-0.1], "stop_reason": "length"}],
             "target_prompt_logprobs": [[-0.5, 0.0], [-1.25, -2.0]],
             "prompt_alt_tokens": [[[4, -0.25], [9, -1.5]], [[4, -0.75], [4, -0.75]]]}
    out = response_conv.deserialize_sample_response(encode_samples(dense))
    assert out.target_prompt_logprobs.shape == [2, 2] and out.target_prompt_logprobs.sparse_crow_indices is None
    assert out.target_prompt_logprobs.to_numpy().tolist() == [[-0.5, 0.0], [-1.25, -2.0]]
    assert out.prompt_alt_tokens.tokens.to_numpy().tolist() == [[4, 9], [4, 4]]
    assert out.prompt_alt_tokens.tokens.dtype == "int64"
    assert out.prompt_alt_tokens.logprobs.to_numpy().tolist() == [[-0.25, -1.5], [-0.75, -0.75]]

    # a sparse request is answered sparse, listing the cells it asked for
    sparse = dense | {"target_prompt_logprobs": [[None, -0.5, None], [None, None, None], [-3.0, None, -0.125]],
                      "target_sparse": True}
    out = response_conv.deserialize_sample_response(encode_samples(sparse))
    got = out.target_prompt_logprobs
    assert got.shape == [3, 3] and got.sparse_crow_indices == [0, 1, 1, 3] and got.sparse_col_indices == [1, 0, 2]
    assert list(got.data) == [-0.5, -3.0, -0.125]
