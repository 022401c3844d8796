"""Weight deltas (shared/weights/delta.py): encode what changed, apply it to the base, and refuse any result that is
not bit for bit the version the manifest describes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.weights.delta import WeightUpdate, delta_parts, encode_delta
from shared.weights.manifest import DELTA_FILE, CheckpointManifest, ChecksumError, tensor_entries


def _versions():
    g = torch.Generator().manual_seed(0)
    base = {"sparse": torch.randn(64, 64, generator=g).bfloat16(), "dense": torch.randn(8, generator=g).bfloat16(),
            "same": torch.randn(4, 4, generator=g).bfloat16(), "scalar": torch.tensor(1.5).bfloat16()}
    new = {k: v.clone() for k, v in base.items()}
    new["sparse"].view(-1)[[3, 700, 4095]] += 0.25
    new["sparse"].view(-1)[10] = float("nan")
    new["sparse"].view(-1)[11] = -0.0 if base["sparse"].view(-1)[11] == 0 else -new["sparse"].view(-1)[11]
    new["dense"] *= 2
    new["scalar"] += 1
    return base, new


def _update(tmp_path, base, new, delta: bytes | None = None, new_entries=None) -> WeightUpdate:
    (tmp_path / DELTA_FILE).write_bytes(delta if delta is not None else encode_delta(base, new))
    m0 = CheckpointManifest(run_id="r", version=1, files={}, tensors=tensor_entries(base))
    m1 = CheckpointManifest(run_id="r", version=2, files={}, kind="delta", base_version=1,
                            tensors=new_entries or tensor_entries(new))
    return WeightUpdate.load(tmp_path, m1, m0)


def test_applying_a_delta_reproduces_every_changed_tensor_bit_for_bit(tmp_path):
    base, new = _versions()
    update = _update(tmp_path, base, new)
    assert update.names == ["dense", "scalar", "sparse"]  # "same" is not sent
    assert "dense/dense" in update.parts and "idx/sparse" in update.parts
    out = update.apply(base)
    for name, t in out.items():
        assert torch.equal(t.view(torch.int16), new[name].view(torch.int16)), name  # NaN and -0.0 included
    # a wider float dtype holding the base exactly (an fp32 engine serving bf16 weights) gives the same result
    wide = update.apply({k: v.float() for k, v in base.items()})
    assert all(torch.equal(wide[n].view(torch.int16), out[n].view(torch.int16)) for n in out)


def test_in_place_application_patches_the_tensors_or_undoes_everything(tmp_path):
    base, new = _versions()
    update = _update(tmp_path, base, new)
    live = {k: v.clone() for k, v in base.items()}
    assert update.fits_in_place(live) and not update.fits_in_place({k: v.float() for k, v in live.items()})
    update.apply_in_place(live)
    assert all(torch.equal(live[n].view(torch.int16), new[n].view(torch.int16)) for n in new)
    wrong = {k: v.clone() for k, v in base.items()}
    wrong["sparse"].view(-1)[0] += 1  # not the base: the last tensor checked fails after the others changed
    before = {k: v.clone() for k, v in wrong.items()}
    with pytest.raises(ChecksumError, match="sparse"):
        update.apply_in_place(wrong)
    assert all(torch.equal(wrong[n].view(torch.int16), before[n].view(torch.int16)) for n in wrong)


def test_a_delta_applied_to_other_weights_is_refused(tmp_path):
    base, new = _versions()
    update = _update(tmp_path, base, new)
    wrong = dict(base, sparse=base["sparse"].clone())
    wrong["sparse"].view(-1)[0] += 1
    with pytest.raises(ChecksumError, match="sparse: applying delta v2"):
        update.apply(wrong)


def test_a_manifest_that_disagrees_with_the_delta_is_refused(tmp_path):
    base, new = _versions()
    claimed = tensor_entries(new)
    claimed["same"] = claimed["same"].model_copy(update={"xxh3_128": "0" * 32})  # changed, says the manifest
    with pytest.raises(ChecksumError, match="unchanged"):
        _update(tmp_path, base, new, new_entries=claimed)


def test_malformed_delta_is_a_checksum_error_not_a_crash(tmp_path):
    import numpy as np
    import zstandard
    from safetensors.numpy import save

    base, new = _versions()
    bad = save({"idx/sparse": np.array([10**6], dtype=np.int32), "val/sparse": np.array([1], dtype=np.int16)})
    only_sparse = tensor_entries(base) | {"sparse": tensor_entries(new)["sparse"]}
    update = _update(tmp_path, base, new, delta=zstandard.ZstdCompressor().compress(bad), new_entries=only_sparse)
    with pytest.raises(ChecksumError, match="does not fit"):
        update.apply(base)
    with pytest.raises(ChecksumError, match="cannot be decoded"):
        _update(tmp_path, base, new, delta=b"not zstd")


def test_gaps_are_stored_in_the_narrowest_integer_that_holds_them(tmp_path):
    base = {"near": torch.zeros(1000, dtype=torch.bfloat16), "far": torch.zeros(200_000, dtype=torch.bfloat16)}
    new = {k: v.clone() for k, v in base.items()}
    new["near"][[5, 900]] = 1.0
    new["far"][[7, 150_000]] = 1.0  # a gap of 149,993: more than uint16 holds
    parts = delta_parts(base, new)
    assert parts["idx/near"].dtype == np.uint16 and parts["idx/far"].dtype == np.int32
    update = _update(tmp_path, base, new)
    live = {k: v.clone() for k, v in base.items()}
    update.apply_in_place(live)
    assert all(torch.equal(live[n].view(torch.int16), new[n].view(torch.int16)) for n in new)


def test_any_flipped_byte_of_a_delta_file_is_refused_when_it_is_read(tmp_path):
    """A co-located worker reads a delta in place without hashing the file: the zstd frame's content checksum is
    what stops a damaged one before anything is decoded from it (without it, a flip in a literal decodes to other
    values, caught only once the result is hashed)."""
    import random

    base, new = _versions()
    for k in range(len(base["sparse"].view(-1))):  # enough changes for a frame with literals worth damaging
        new["sparse"].view(-1)[k] += 0.5 * (k % 3 == 0)
    good = encode_delta(base, new)
    want = _update(tmp_path, base, new, delta=good).parts
    refused = 0
    for pos in random.Random(0).sample(range(len(good)), min(80, len(good))):
        bad = bytearray(good)
        bad[pos] ^= 0x10
        try:
            got = _update(tmp_path, base, new, delta=bytes(bad)).parts
        except ChecksumError as e:
            assert "cannot be decoded" in str(e)
            refused += 1
            continue
        # read without complaint: only a bit the format ignores (the frame header's unused bit) may have flipped
        assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want), pos
    assert refused >= 75


def test_a_diff_on_the_weights_device_gives_the_same_parts_and_digests_as_the_host():
    """A CUDA trainer's publisher compares its last and new versions on the GPU (`on_device`, the default for
    tensors off the CPU); the parts and the changed tensors' digests are those of the host path, so a worker
    cannot tell where the diff ran. Forced here on CPU tensors, the same torch code a GPU runs."""
    base, new = _versions()
    wide_base = {"far": torch.zeros(200_000, dtype=torch.float32)}
    wide_new = {"far": wide_base["far"].clone()}
    wide_new["far"][[7, 150_000]] = 1.0
    for b, n in ((base, new), (wide_base, wide_new)):
        host_digests, device_digests = {}, {}
        host = delta_parts(b, n, digests=host_digests, on_device=False)
        device = delta_parts(b, n, digests=device_digests, on_device=True)
        assert host.keys() == device.keys() and host_digests == device_digests
        for key in host:
            assert host[key].dtype == device[key].dtype and np.array_equal(host[key], device[key]), key
