"""Fetching a version between the weight server and rollout workers.

A version is a folder plus `MANIFEST.json` (every file's sha256 and size, every tensor's digest); the
announced sha256 of the manifest verifies the whole version. `full` is an HF folder; `delta` one file of what
changed since `base_version`, reproducing the new tensors bit for bit. Fetching is atomic: files go to a temp
folder, are hashed while streaming and renamed into place only when every hash matches; nothing
half-downloaded or unverified is ever loaded (`ChecksumError`).

More: docs/weight-sync.md#fetching-and-verifying-a-version
"""


from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import httpx

from shared.contracts.messages.weights import WeightsPublished

if TYPE_CHECKING:
    pass

from shared.weights.delta import WeightUpdate, read_safetensors
from shared.weights.manifest import (
    CHUNK,
    MANIFEST,
    CheckpointManifest,
    ChecksumError,
    FileEntry,
    parse_manifest,
    read_manifest,
    verify_folder,
)


class FileRelay(Protocol):
    """Fetches one file of a version piece by piece from the peer before this worker in the file's chain
    (the rollout worker's weight relay)."""

    def fetch(self, client: httpx.Client, msg: WeightsPublished, name: str, entry: FileEntry, dest: Path) -> None: ...


def fetch_manifest(msg: WeightsPublished, timeout_s: float = 60.0) -> CheckpointManifest:
    """The announced version's manifest, verified (read in place when co-located, else over HTTP)."""
    if msg.path and Path(msg.path, MANIFEST).is_file():
        return read_manifest(Path(msg.path), msg.sha256)
    url = f"{msg.uri.rstrip('/')}/{MANIFEST}"
    return parse_manifest(httpx.get(url, timeout=timeout_s).raise_for_status().content, msg.sha256, url)


def version_source(msg: WeightsPublished, version: int, sha256: str) -> WeightsPublished:
    """Where another version of the same run lives on the same weight server (a delta's base): the
    announcement it would have had, found from `msg`'s uri (.../versions/<v>) and path (.../v<v>)."""
    uri = f"{msg.uri.rstrip('/').rsplit('/', 1)[0]}/{version}"
    path = str(Path(msg.path).parent / f"v{version}") if msg.path else None
    return msg.model_copy(update={"version": version, "uri": uri, "path": path, "sha256": sha256, "bytes": 0})



def fetch_checkpoint(msg: WeightsPublished, cache_dir: Path, *, verify_shared_path: bool = False,
                     timeout_s: float = 600.0, relay: FileRelay | None = None) -> Path:
    """Return a local folder holding the announced version's files (a snapshot or a delta), verified.

    Co-located (msg.path readable): used in place; the manifest hash and file sizes are checked, file contents
    only with `verify_shared_path` (see the module docstring: by default nobody re-reads a co-located snapshot
    after the trainer hashed it, and a delta is checked by what it decodes to). Otherwise the files are streamed
    over HTTP from msg.uri into `cache_dir/<run>/v<version>`, hashed as they arrive; with `relay`, files hashed
    by pieces come through the relay chain instead (services/rollout_worker/weight_relay.py), each piece checked as it arrives.
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
                if relay is not None and entry.pieces:
                    relay.fetch(client, msg, name, entry, tmp / name)
                else:
                    _download(client, f"{msg.uri.rstrip('/')}/{name}", tmp / name, entry)
        try:
            os.replace(tmp, dest)
        except OSError:
            if not dest.is_dir():
                raise
            # another process sharing this cache (rollout workers on one host) put the same version there first
            shutil.rmtree(tmp, ignore_errors=True)
            verify_folder(dest, msg.sha256, full=False)
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




def materialize(msg: WeightsPublished, cache_dir: Path, *, verify_shared_path: bool = False,
                timeout_s: float = 600.0, relay: FileRelay | None = None) -> Path:
    """A full HF folder of the announced version: the snapshot itself, or the nearest snapshot before it with
    every delta since applied (each result checked against its manifest's tensor hashes), written atomically
    to `cache_dir/<run>/v<version>.full` (the run's previous such folder is removed)."""
    manifest = fetch_manifest(msg)
    if manifest.kind == "full":
        return fetch_checkpoint(msg, cache_dir, verify_shared_path=verify_shared_path, timeout_s=timeout_s,
                                relay=relay)
    dest = cache_dir / msg.run_id / f"v{msg.version}.full"
    if dest.is_dir():
        return dest
    chain = [(msg, manifest)]
    while chain[-1][1].kind == "delta":
        m = chain[-1][1]
        src = version_source(msg, m.base_version, m.base_sha256)
        chain.append((src, fetch_manifest(src)))
    snap_msg, base = chain.pop()
    snap = fetch_checkpoint(snap_msg, cache_dir, verify_shared_path=verify_shared_path, timeout_s=timeout_s,
                            relay=relay)
    state = read_safetensors(snap)
    for src, m in reversed(chain):
        update = WeightUpdate.load(fetch_checkpoint(src, cache_dir, timeout_s=timeout_s, relay=relay), m, base)
        state.update(update.apply(state))
        base = m
    return _write_full(snap, state, dest)


def _write_full(snapshot: Path, state: dict, dest: Path) -> Path:
    from safetensors.torch import save_file

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        for p in snapshot.iterdir():  # config, tokenizer, generation config: the same for every version
            if p.is_file() and p.suffix != ".safetensors" and p.name != MANIFEST:
                shutil.copyfile(p, tmp / p.name)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in dest.parent.glob("v*.full"):
        if old != dest:
            shutil.rmtree(old, ignore_errors=True)
    return dest
