"""asample's target_prompt_logprobs, read into dense rows of ids: the SDK's dense and sparse layouts, and a clear
400 naming the field for each way a tensor can be wrong."""

from __future__ import annotations

import pytest

from services.api.errors import ApiError
from services.api.routers.tinker.sampling import TensorWire, target_rows

tinker_types = pytest.importorskip("tinker.types")
torch = pytest.importorskip("torch")


def wire(td) -> TensorWire:  # what the SDK sends: its TensorData as JSON
    return TensorWire(data=list(td.data), dtype=td.dtype, shape=td.shape, sparse_crow_indices=td.sparse_crow_indices,
                      sparse_col_indices=td.sparse_col_indices)


def test_dense_and_sparse_tensors_from_the_sdk_read_as_the_same_rows():
    ids = torch.tensor([[5, -1], [-1, -1], [7, 2]], dtype=torch.int64)
    expected = ids.tolist()
    assert target_rows(wire(tinker_types.TensorData.from_torch(ids)), 4) == expected
    assert target_rows(wire(tinker_types.TensorData.from_torch_sparse(ids, pad_value=-1)), 4) == expected


@pytest.mark.parametrize(("change", "field", "words"), [
    ({"dtype": "float32"}, "target_prompt_logprobs.dtype", "int64"),
    ({"shape": [2, 2]}, "target_prompt_logprobs.shape", "needs [3, K]"),
    ({"shape": [3, 21], "data": [0] * 63}, "target_prompt_logprobs.shape", "K <= 20"),
    ({"data": [0] * 5}, "target_prompt_logprobs.data", "5 values"),
    ({"data": [-1] * 6}, "target_prompt_logprobs.data", "at least one token id"),
    ({"data": [-2, 0, 0, 0, 0, 0]}, "target_prompt_logprobs.data", "ids are >= 0"),
    ({"sparse_crow_indices": [0, 1, 1, 2]}, "target_prompt_logprobs.sparse_col_indices", "without the other"),
    ({"data": [4, 5], "sparse_crow_indices": [0, 1, 1, 2], "sparse_col_indices": [0, 2]},
     "target_prompt_logprobs.sparse_crow_indices", "CSR layout"),
    ({"data": [4, 5], "sparse_crow_indices": [0, 2, 1, 2], "sparse_col_indices": [0, 1]},
     "target_prompt_logprobs.sparse_crow_indices", "CSR layout"),
])
def test_a_wrong_tensor_is_a_400_naming_the_field(change, field, words):
    good = {"data": [1, 2, 3, 4, 5, 6], "dtype": "int64", "shape": [3, 2]}
    with pytest.raises(ApiError) as e:
        target_rows(TensorWire(**good | change), 4)
    item = e.value.items[0]
    assert e.value.status_code == 400 and item.field == field and words in item.message, item
