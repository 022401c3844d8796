"""Weight deltas: one file, `DELTA_FILE`, holding only what changed since `base_version` (whose manifest sha256
is `base_sha256`, so a chain of manifests is verified from its newest end): per tensor either the changed
elements (flat indices as gaps + new values) or the whole tensor when that is smaller, as a safetensors blob
compressed with zstd. Changes are found by comparing bits, so applying the delta to the base reproduces the new
tensors bit for bit; `WeightUpdate.apply` checks each result against the manifest before it is used."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch

from shared.weights.manifest import (
    DELTA_FILE,
    CheckpointManifest,
    ChecksumError,
    TensorEntry,
    same_layout,
    tensor_entry,
)

_INT_OF_SIZE = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


def _bits(t: torch.Tensor) -> np.ndarray:
    """The same bytes as flat integers (a numpy view, CPU): compares bits (a NaN equals itself, -0.0 differs
    from 0.0). numpy, because torch's CPU elementwise kernels are far slower on these sizes."""
    import torch

    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(getattr(torch, _INT_OF_SIZE[flat.element_size()])).numpy()


def delta_parts(base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor],
                digests: dict[str, TensorEntry] | None = None, on_device: bool | None = None) -> dict[str, np.ndarray]:
    """What changed from `base` to `new` (same layout): per changed tensor either `idx/<name>` (gaps between
    changed flat indices, the first from 0: uint8 when every gap fits, else uint16/int32/int64) + `val/<name>`
    (their new bits), or `dense/<name>` (the whole tensor's bits) when that is no larger; unchanged tensors are
    absent. With `digests`, each changed tensor's `tensor_entry` is added to it, computed right after its diff
    while its bits are still in cache. Tensors are compared on a few threads (the kernels release the GIL).

    `on_device`: compare with torch where the tensors live (`changes_on_device`: a CUDA trainer's last and new
    versions are compared on its GPU and only the changes are copied to the host) instead of numpy on the host;
    the same parts either way. Default: on the device when the tensors are not on the CPU."""
    from concurrent.futures import ThreadPoolExecutor

    def diff(name: str) -> dict[str, np.ndarray]:
        device = on_device if on_device is not None else new[name].device.type != "cpu"
        parts = _diff_one(name, base[name], new[name], device)
        if parts and digests is not None:
            digests[name] = tensor_entry(new[name])
        return parts

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return {key: arr for parts in pool.map(diff, new) for key, arr in parts.items()}


def _diff_one(name: str, base: torch.Tensor, new: torch.Tensor, on_device: bool) -> dict[str, np.ndarray]:
    from shared.weights.kernels import changes, changes_on_device

    found = changes_on_device(base, new) if on_device else changes(_bits(base), _bits(new))
    if found is None:
        return {}
    gaps, vals = found
    if gaps.nbytes + vals.nbytes >= new.numel() * new.element_size():
        return {f"dense/{name}": _bits(new)}
    return {f"idx/{name}": gaps, f"val/{name}": vals}


def compress_delta(parts: Mapping[str, np.ndarray], level: int = 1) -> bytes:
    """`delta_parts` as the bytes of DELTA_FILE: a safetensors blob compressed with zstd at `level` (negative:
    zstd's fast levels), on every core. The frame carries zstd's checksum of its content, so a damaged file
    fails to decode rather than decoding to other bytes."""
    import zstandard
    from safetensors.numpy import save

    return zstandard.ZstdCompressor(level=level, threads=-1, write_checksum=True).compress(save(dict(parts)))


def encode_delta(base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], level: int = 1) -> bytes:
    """`compress_delta(delta_parts(base, new), level)`."""
    return compress_delta(delta_parts(base, new), level)


def changed_names(parts: Mapping[str, np.ndarray]) -> set[str]:
    """The tensors a delta's parts change."""
    return {key.split("/", 1)[1] for key in parts}


class WeightUpdate:
    """A delta version ready to apply to its base: the changed tensors and the manifests to check against."""

    def __init__(self, manifest: CheckpointManifest, base: CheckpointManifest, parts: dict[str, np.ndarray]):
        self.manifest, self.base, self.parts = manifest, base, parts
        self.names = sorted(changed_names(parts))

    @property
    def version(self) -> int:
        return self.manifest.version

    @classmethod
    def load(cls, folder: Path, manifest: CheckpointManifest, base: CheckpointManifest) -> WeightUpdate:
        """Decode `folder`'s delta (its file already verified) and check it fits `base`: same tensors, and every
        tensor the delta leaves alone has the base's hash in the new manifest. ChecksumError otherwise."""
        import zstandard
        from safetensors.numpy import load

        if manifest.kind != "delta" or manifest.base_version != base.version:
            raise ChecksumError(f"v{manifest.version} is not a delta on v{base.version}")
        if not base.tensors or not same_layout(manifest.tensors, base.tensors):
            raise ChecksumError(f"v{manifest.version}: tensors differ in names, dtypes or shapes from base "
                                f"v{base.version}")
        try:
            with open(folder / DELTA_FILE, "rb") as f:
                parts = load(zstandard.ZstdDecompressor().decompress(f.read()))  # one buffer: sized by the frame
        except Exception as e:  # zstd or safetensors: not a delta this code wrote
            raise ChecksumError(f"v{manifest.version}: {DELTA_FILE} cannot be decoded: {e}") from None
        update = cls(manifest, base, parts)
        unknown = set(update.names) - manifest.tensors.keys()
        if unknown:
            raise ChecksumError(f"v{manifest.version}: delta names tensors the manifest lacks: {sorted(unknown)[:5]}")
        changed = set(update.names)
        moved = [n for n in manifest.tensors if n not in changed and manifest.tensors[n] != base.tensors[n]]
        if moved:
            raise ChecksumError(f"v{manifest.version}: the delta leaves {moved[:5]} unchanged but the manifest "
                                "says they changed")
        return update

    def apply(self, current: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The new value of every changed tensor (CPU, the manifest's dtype), each checked against the manifest.
        `current` holds the base version's tensors (any device; a wider float dtype that holds them exactly is
        fine). ChecksumError, before anything is returned, when a result differs: `current` was not the base."""
        from concurrent.futures import ThreadPoolExecutor

        missing = [n for n in self.names if n not in current and f"dense/{n}" not in self.parts]
        if missing:
            raise ChecksumError(f"v{self.version}: the weights being updated have no tensors {missing[:5]}")
        # the patch kernel and xxhash drop the GIL
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            return dict(zip(self.names, pool.map(lambda n: self._apply_one(n, current), self.names), strict=True))

    def fits_in_place(self, current: Mapping[str, torch.Tensor]) -> bool:
        """`current` can take `apply_in_place`: every changed tensor is there, on CPU, contiguous, in the
        manifest's dtype."""
        return all(n in current and current[n].device.type == "cpu" and current[n].is_contiguous()
                   and str(current[n].dtype) == f"torch.{self.manifest.tensors[n].dtype}" for n in self.names)

    def apply_in_place(self, current: Mapping[str, torch.Tensor]) -> None:
        """Write the changes straight into `current`'s tensors (see `fits_in_place`) and check each result
        against the manifest: no copy of the weights. On any mismatch every change is undone, so `current`
        holds the base again, and ChecksumError is raised. Nothing may read `current` meanwhile. Tensors are
        patched and hashed on a few threads (the patch kernel and xxhash release the GIL)."""
        from concurrent.futures import ThreadPoolExecutor

        undo: list = []  # one callable per patched tensor, appended once its patch is written
        try:
            with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
                for _ in pool.map(lambda name: self._patch_one(name, current, undo), self.names):
                    pass  # an error leaves the `with` only once the pool has finished every patch
        except BaseException:
            for put_back in reversed(undo):
                put_back()
            raise

    def _patch_one(self, name: str, current: Mapping[str, torch.Tensor], undo: list) -> None:
        from shared.weights.kernels import PatchError, patch, unpatch

        entry, bits = self.manifest.tensors[name], _bits(current[name])  # a view: writes go through
        try:
            if f"dense/{name}" in self.parts:
                old, new = bits.copy(), self.parts[f"dense/{name}"]
                bits[:] = new
                undo.append(lambda: bits.__setitem__(slice(None), old))
            else:
                gaps = self.parts[f"idx/{name}"]
                replaced = patch(bits, gaps, self.parts[f"val/{name}"])
                undo.append(lambda: unpatch(bits, gaps, replaced))
        except (PatchError, ValueError) as e:
            raise ChecksumError(f"{name}: delta v{self.version} does not fit the tensor: {e}") from None
        if tensor_entry(current[name]) != entry:
            raise ChecksumError(f"{name}: applying delta v{self.version} gives other bytes than its manifest "
                                f"states (the weights were not v{self.base.version})")

    def _apply_one(self, name: str, current: Mapping[str, torch.Tensor]) -> torch.Tensor:
        import numpy as np
        import torch

        from shared.weights.kernels import PatchError, patch

        entry = self.manifest.tensors[name]
        dtype = getattr(torch, entry.dtype)
        try:
            if f"dense/{name}" in self.parts:
                bits = np.require(self.parts[f"dense/{name}"], requirements="W")
            else:
                bits = _bits(current[name].detach().to("cpu", dtype)).copy()
                patch(bits, self.parts[f"idx/{name}"], self.parts[f"val/{name}"])
            t = torch.from_numpy(bits).view(dtype).reshape(entry.shape)
        except (PatchError, RuntimeError, ValueError) as e:  # a malformed delta: wrong sizes or indices
            raise ChecksumError(f"{name}: delta v{self.version} does not fit the tensor: {e}") from None
        if tensor_entry(t) != entry:
            raise ChecksumError(f"{name}: applying delta v{self.version} gives other bytes than its manifest "
                                f"states (the weights it was applied to were not v{self.base.version})")
        return t


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in `folder`."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors files")
    state: dict = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


