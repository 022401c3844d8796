"""A version's manifest: the `MANIFEST.json` listing every file (sha256, size, relay pieces) and every tensor
(dtype, shape, xxh3-128 digest); `WeightsPublished.sha256` is the sha256 of its bytes, so checking the manifest
and then each file or tensor against it checks the whole version. Kinds, publishing and fetching: see
shared/weights/fetch.py and shared/weights/delta.py."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field

if TYPE_CHECKING:
    import torch

MANIFEST = "MANIFEST.json"
DELTA_FILE = "delta.safetensors.zst"
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"  # PEFT's file names
CHUNK = 1 << 20
PIECE_BYTES = 1 << 20  # the unit a worker verifies and relays (one piece at 1 Gbit/s: 8 ms)


class ChecksumError(ValueError):
    """A checkpoint file or manifest does not match its announced sha256."""


class FileEntry(BaseModel):
    sha256: str
    bytes: int
    pieces: list[str] = Field(
        default_factory=list, description="sha256 of each PIECE_BYTES slice of the file, in order (the last may be "
        "shorter): a worker checks each piece as it arrives, so it can pass verified pieces on before the whole "
        "file is there (empty: written before pieces, or not hashed by pieces; checked as a whole)")
    piece_bytes: int = Field(0, ge=0, description="size of each piece but the last")


class TensorEntry(BaseModel):
    """One tensor of a version's full weights. Its digest is xxh3-128, not sha256: it checks that a delta applied
    to the right base gives the right bytes (the delta file itself is sha256-checked like every file), and at
    ~10 GB/s it keeps that check small next to the copy it verifies."""

    xxh3_128: str = Field(description="xxh3-128 hex digest of the tensor's raw little-endian bytes (as in safetensors)")
    dtype: str = Field(description="torch dtype name, e.g. bfloat16")
    shape: list[int]


class BaseModelRef(BaseModel):
    """The base model a LoRA version's adapter belongs to: what the adapter may be applied to, and nothing else."""

    name: str = Field(description="the run's `model` (folder or hub id)")
    sha256: str = Field(description="`base_model_digest` of its weights")


class CheckpointManifest(BaseModel):
    run_id: str
    version: int
    files: dict[str, FileEntry]
    kind: Literal["full", "delta"] = "full"
    base_version: int | None = Field(None, description="delta: the version it applies to")
    base_sha256: str | None = Field(None, description="delta: sha256 of the base version's MANIFEST.json")
    tensors: dict[str, TensorEntry] = Field(
        default_factory=dict, description="every weight tensor of this version's full weights (empty: unknown, "
        "written before per-tensor hashes; no delta can be based on it)")
    full_bytes: int = Field(0, ge=0, description="size of the full weights this version stands for")
    base_model: BaseModelRef | None = Field(
        None, description="set: a LoRA version, the adapter alone in PEFT layout (ADAPTER_CONFIG + ADAPTER_WEIGHTS) "
        "for this base; unset: the model's full weights")

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files.values())


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a directory's entries (after a rename into it), to disk. A read-only descriptor
    is enough for both on Linux."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """Every file, then every directory, below and including `folder`."""
    paths = [folder, *folder.rglob("*")]
    for p in paths:
        if p.is_file():
            fsync_path(p)
    for p in paths:
        if p.is_dir():
            fsync_path(p)


_BASE_DIGESTS: dict[tuple, str] = {}


def base_model_digest(model: str) -> str:
    """sha256 over the base model's weight files (name and sha256 of each *.safetensors, in name order): what a
    LoRA manifest names its base by. Remembered per file set (path, size, mtime), so each process hashes once."""
    folder = Path(model).expanduser()
    if not folder.is_dir():  # a hub id: the cached snapshot's weight files
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(model, allow_patterns=["*.safetensors"]))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors files: cannot identify the base model")
    key = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    if key not in _BASE_DIGESTS:
        h = hashlib.sha256()
        for f in files:
            h.update(f"{f.name}:{sha256_file(f)}\n".encode())
        _BASE_DIGESTS[key] = h.hexdigest()
    return _BASE_DIGESTS[key]


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def piece_hashes(path: Path, piece_bytes: int = PIECE_BYTES) -> list[str]:
    """sha256 of each `piece_bytes` slice of the file, on a few threads (hashlib drops the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        def one(offset: int) -> str:
            return hashlib.sha256(os.pread(fd, min(piece_bytes, size - offset), offset)).hexdigest()

        with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
            return list(pool.map(one, range(0, size, piece_bytes)))
    finally:
        os.close(fd)


def write_manifest(folder: Path, run_id: str, version: int) -> tuple[CheckpointManifest, str]:
    """Hash every file in `folder` (flat), write MANIFEST.json (fsynced); return it and its sha256."""
    files = {
        p.name: FileEntry(sha256=sha256_file(p), bytes=p.stat().st_size)
        for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST
    }
    manifest = CheckpointManifest(run_id=run_id, version=version, files=files)
    data = manifest.model_dump_json(indent=1).encode()
    with open(folder / MANIFEST, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return manifest, hashlib.sha256(data).hexdigest()


def read_manifest(folder: Path, expected_sha256: str) -> CheckpointManifest:
    return parse_manifest((folder / MANIFEST).read_bytes(), expected_sha256, str(folder / MANIFEST))


def parse_manifest(data: bytes, expected_sha256: str, where: str) -> CheckpointManifest:
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected_sha256:
        raise ChecksumError(f"{where}: sha256 {actual} != announced {expected_sha256}")
    return CheckpointManifest.model_validate(json.loads(data))


def verify_folder(folder: Path, expected_sha256: str, *, full: bool = True) -> CheckpointManifest:
    """Check the manifest hash, then each file's size and (with `full`) its sha256."""
    manifest = read_manifest(folder, expected_sha256)
    for name, entry in manifest.files.items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != entry.bytes:
            raise ChecksumError(f"{path}: missing or size differs from the manifest ({entry.bytes} bytes)")
        if full and sha256_file(path) != entry.sha256:
            raise ChecksumError(f"{path}: sha256 differs from the manifest")
    return manifest





def tensor_entry(t: torch.Tensor) -> TensorEntry:
    """dtype, shape and xxh3-128 digest of the raw bytes of `t` (moved to CPU)."""
    import torch
    import xxhash

    t = t.detach().cpu().contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy()
    return TensorEntry(xxh3_128=xxhash.xxh3_128_hexdigest(data), dtype=str(t.dtype).removeprefix("torch."),
                       shape=list(t.shape))


def tensor_entries(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorEntry]:
    """`tensor_entry` of each tensor, on a few threads (xxhash releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return dict(zip(tensors, pool.map(tensor_entry, tensors.values()), strict=True))


def same_layout(a: Mapping[str, TensorEntry], b: Mapping[str, TensorEntry]) -> bool:
    """Same tensor names, dtypes and shapes: a delta between the two is possible."""
    return a.keys() == b.keys() and all((a[k].dtype, a[k].shape) == (b[k].dtype, b[k].shape) for k in a)

