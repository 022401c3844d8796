"""Checkpoint hand-off between the weight server and rollout workers.

A checkpoint is a folder in HF format (config.json, *.safetensors, tokenizer files) plus `MANIFEST.json`,
which lists every file with its sha256 and size. The `WeightsPublished.sha256` is the sha256 of the manifest
bytes, so verifying the manifest and then each file against it verifies the whole checkpoint.

Publishing is atomic (`write_manifest` + `os.replace` of the folder by the weight server); fetching is too:
files are downloaded into a temp folder, hashed while streaming, and renamed into place only when every hash
matches. A checksum mismatch raises `ChecksumError`; nothing half-downloaded is ever loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import httpx
from pydantic import BaseModel

from shared.messages.weights import WeightsPublished

MANIFEST = "MANIFEST.json"
CHUNK = 1 << 20


class ChecksumError(ValueError):
    """A checkpoint file or manifest does not match its announced sha256."""


class FileEntry(BaseModel):
    sha256: str
    bytes: int


class CheckpointManifest(BaseModel):
    run_id: str
    version: int
    files: dict[str, FileEntry]

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


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


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
    data = (folder / MANIFEST).read_bytes()
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected_sha256:
        raise ChecksumError(f"{folder / MANIFEST}: sha256 {actual} != announced {expected_sha256}")
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


def fetch_checkpoint(msg: WeightsPublished, cache_dir: Path, *, verify_shared_path: bool = False,
                     timeout_s: float = 600.0) -> Path:
    """Return a local folder holding the announced checkpoint, verified.

    Co-located (msg.path readable): used in place; the manifest hash and file sizes are checked (the weight
    server hashed the files when it published), full hashing only with `verify_shared_path`. Otherwise the
    files are streamed over HTTP from msg.uri into `cache_dir/<run>/v<version>`, hashed as they arrive.
    """
    if msg.path and Path(msg.path, MANIFEST).is_file():
        verify_folder(Path(msg.path), msg.sha256, full=verify_shared_path)
        return Path(msg.path)
    dest = cache_dir / msg.run_id / f"v{msg.version}"
    if dest.is_dir():
        verify_folder(dest, msg.sha256, full=False)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".v{msg.version}-", dir=dest.parent))
    try:
        with httpx.Client(timeout=timeout_s) as client:
            manifest_bytes = client.get(f"{msg.uri.rstrip('/')}/{MANIFEST}").raise_for_status().content
            (tmp / MANIFEST).write_bytes(manifest_bytes)
            manifest = read_manifest(tmp, msg.sha256)
            for name, entry in manifest.files.items():
                _download(client, f"{msg.uri.rstrip('/')}/{name}", tmp / name, entry)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _download(client: httpx.Client, url: str, path: Path, entry: FileEntry) -> None:
    h = hashlib.sha256()
    with client.stream("GET", url) as resp, open(path, "wb") as f:
        resp.raise_for_status()
        for chunk in resp.iter_bytes(CHUNK):
            h.update(chunk)
            f.write(chunk)
    if h.hexdigest() != entry.sha256:
        raise ChecksumError(f"{url}: downloaded sha256 differs from the manifest")
