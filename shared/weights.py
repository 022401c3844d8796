"""Checkpoint hand-off between the weight server and rollout workers.

A version is a folder plus `MANIFEST.json`, which lists every file with its sha256 and size, and every weight
tensor of the version's full weights with its dtype, shape and digest (xxh3-128 of its raw bytes). The
`WeightsPublished.sha256` is the sha256 of the manifest bytes, so verifying the manifest and then each file
(or each tensor) against it verifies the whole version.

A version is one of two kinds:
- `full` (a snapshot): an HF folder (config.json, *.safetensors, tokenizer files);
- `delta`: one file, `DELTA_FILE`, holding only what changed since `base_version` (whose manifest sha256 is
  `base_sha256`, so a chain of manifests is verified from its newest end): per tensor either the changed
  elements (flat indices as gaps + new values) or the whole tensor when that is smaller, as a safetensors blob
  compressed with zstd. Changes are found by comparing bits, so applying the delta to the base reproduces the
  new tensors bit for bit; `WeightUpdate.apply` checks each result against the manifest before it is used.

Publishing is atomic (the weight server writes the manifest, fsyncs and renames the folder into place before it
announces it); fetching is too: files are downloaded into a temp folder, hashed while streaming, and renamed
into place only when every hash matches. A checksum mismatch raises `ChecksumError`; nothing half-downloaded or
unverified is ever loaded. A folder on a shared volume (co-located worker) is read in place: the manifest hash
and each file's size are checked, but file contents are hashed only with `verify_shared_path`, because the
weight server does not re-read a co-located trainer's files by default (VERIFY_STAGING=false records the sha256
the trainer computed from the bytes it wrote on that volume): an in-place read of a full snapshot trusts the
shared volume. A delta read in place needs no file hash: a damaged file fails zstd's content checksum, and what
it decodes to is checked tensor by tensor against the manifest before it is served.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import httpx
from pydantic import BaseModel, Field

from shared.messages.weights import WeightsPublished

if TYPE_CHECKING:
    import numpy as np
    import torch

    from shared.weight_relay import Relay

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
                     timeout_s: float = 600.0, relay: Relay | None = None) -> Path:
    """Return a local folder holding the announced version's files (a snapshot or a delta), verified.

    Co-located (msg.path readable): used in place; the manifest hash and file sizes are checked, file contents
    only with `verify_shared_path` (see the module docstring: by default nobody re-reads a co-located snapshot
    after the trainer hashed it, and a delta is checked by what it decodes to). Otherwise the files are streamed
    over HTTP from msg.uri into `cache_dir/<run>/v<version>`, hashed as they arrive; with `relay`, files hashed
    by pieces come through the relay chain instead (shared/weight_relay.py), each piece checked as it arrives.
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


# -- tensors and deltas ---------------------------------------------------------------------------------------
_INT_OF_SIZE = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


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
    from shared.delta_kernels import changes, changes_on_device

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
        from shared.delta_kernels import PatchError, patch, unpatch

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

        from shared.delta_kernels import PatchError, patch

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


def materialize(msg: WeightsPublished, cache_dir: Path, *, verify_shared_path: bool = False,
                timeout_s: float = 600.0, relay: Relay | None = None) -> Path:
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
