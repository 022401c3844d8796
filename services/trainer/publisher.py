"""Client of the weight server: publish one exported HF folder as version v of a run.

Each version is sent as a delta on the version before it when the weight server's plan asks for one and this
publisher still holds that version's export, otherwise as the full folder. Either way the manifest states
every tensor's digest. Co-located (WEIGHTS_DIR set): exported into a staging folder on the weight server's
volume and published by path. Remote: uploaded over HTTP with sha256s. A 4xx is not transient and raises.

More: docs/weight-sync.md#publishing-from-the-trainer
"""

from __future__ import annotations

import hashlib
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx

from shared.contracts.messages import WeightsPublished
from shared.platform.logs import get_logger
from shared.platform.retry import RetryPolicy
from shared.weights.delta import compress_delta, delta_parts, read_safetensors
from shared.weights.kernels import warm_up_in_background
from shared.weights.manifest import (
    CHUNK,
    DELTA_FILE,
    BaseModelRef,
    TensorEntry,
    base_model_digest,
    fsync_path,
    sha256_file,
    tensor_entries,
)

log = get_logger(__name__)


class WeightServerError(Exception):
    """The weight server answered 5xx: it may succeed when tried again."""


TRANSIENT = (httpx.TransportError, WeightServerError)


@dataclass
class _Published:
    """The last version this publisher sent for a run: the base of the next delta."""

    version: int
    sha256: str  # of its manifest, as the weight server announced it
    tensors: dict
    entries: dict[str, TensorEntry]


class WeightPublisher:
    def __init__(self, url: str, weights_dir: Path | None, timeout_s: float = 600.0, zstd_level: int = 1):
        self.url, self.weights_dir, self.timeout_s = url.rstrip("/"), weights_dir, timeout_s
        self.zstd_level = zstd_level  # of delta files; negative: zstd's fast levels
        self.last: dict[str, _Published] = {}
        self.last_kind: str | None = None  # "full" or "delta": what the latest publish sent (for benchmarks)
        self.last_timings: dict[str, float] = {}  # seconds per stage of the latest publish (for benchmarks)
        self.http = httpx.Client(timeout=timeout_s)  # one keep-alive connection: a new client costs ~30 ms a call
        warm_up_in_background()  # the delta kernels, compiled before the first delta and off its clock

    def staging_folder(self, run_id: str, version: int) -> Path:
        """Where to export version `version` before publishing it."""
        base = self.weights_dir / ".staging" if self.weights_dir else Path("/tmp/flywheel-staging")
        folder = base / f"{run_id}-v{version}-{uuid.uuid4().hex[:6]}"
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def publish_adapter(self, run_id: str, version: int, engine, base_model: str, metrics: dict[str, float],
                        dtype: str = "auto", best_metric: str | None = None, pinned: bool = False) -> WeightsPublished:
        """A LoRA engine's adapter as `version`, tied to the base model it was trained on (a run's step, a Tinker
        model's sampler weights)."""
        folder = self.staging_folder(run_id, version)
        tensors = engine.export_adapter(folder, dtype)
        return self.publish(run_id, version, folder, metrics, best_metric, tensors=tensors,
                            base_model=BaseModelRef(name=base_model, sha256=base_model_digest(base_model)),
                            pinned=pinned)

    def publish(self, run_id: str, version: int, folder: Path, metrics: dict[str, float],
                best_metric: str | None = None, tensors: dict | None = None,
                base_model: BaseModelRef | None = None, pinned: bool = False) -> WeightsPublished:
        """Publish the exported HF `folder` (consumed) as `version`: as a delta when possible, else in full.
        `tensors`: the exported weights, when the folder was written without them (the trainer's export_hf
        with weights=False): written to model.safetensors only if a full snapshot is sent. `base_model`: the
        folder is a LoRA adapter (PEFT layout) for this base; always sent whole (every element of an adapter
        changes at each step, and it is small: a delta would save nothing). `pinned`: the weight server's
        retention keeps the version until `unpin`."""
        if tensors is None:
            tensors = read_safetensors(folder)
        written = any(folder.glob("*.safetensors"))
        full_bytes = sum(p.stat().st_size for p in folder.iterdir() if p.is_file()) + (
            0 if written else sum(t.numel() * t.element_size() for t in tensors.values()))  # ~ the file's size
        clock = _Stopwatch()
        plan = self._retry(lambda c: c.get(f"{self.url}/v1/runs/{run_id}/versions/{version}/plan"))
        clock.lap("plan_s")
        last = self.last.pop(run_id, None)
        body = {"metrics": metrics, "best_metric": best_metric, "full_bytes": full_bytes, "pinned": pinned}
        digests: dict[str, str] = {}  # file name -> sha256, for files hashed before they were written
        if base_model is not None:
            body["base_model"] = base_model.model_dump()
        if (base_model is None and last is not None and plan["base_version"] == last.version
                and plan["base_sha256"] == last.sha256 and _layout(tensors) == {n: (e.dtype, e.shape) for n, e in last.entries.items()}):
            entries, delta, digests = self._write_delta(run_id, version, last, tensors, clock)
            shutil.rmtree(folder, ignore_errors=True)
            folder = delta
            body |= {"kind": "delta", "base_version": last.version}
        else:
            entries = tensor_entries(tensors)
            clock.lap("hash_s")
            if not written:
                from safetensors.torch import save_file

                save_file({n: t.cpu() for n, t in tensors.items()}, str(folder / "model.safetensors"),
                          metadata={"format": "pt"})
        body["tensors"] = {n: e.model_dump() for n, e in entries.items()}
        files = sorted(p.name for p in folder.iterdir() if p.is_file())
        if self.weights_dir:
            for name in files:  # durable before the server renames it into place
                fsync_path(folder / name)
            # Declared hashes let a server with VERIFY_STAGING=false skip re-reading; one that verifies compares.
            body |= {"staging_path": str(folder),
                     "files": {n: digests.get(n) or sha256_file(folder / n) for n in files}}
        else:
            body["files"] = {n: self._upload(f"{self.url}/v1/runs/{run_id}/versions/{version}/files/{n}", folder / n)
                             for n in files}
        clock.lap("write_s")
        msg = WeightsPublished.model_validate(
            self._retry(lambda c: c.post(f"{self.url}/v1/runs/{run_id}/versions/{version}/publish", json=body)))
        clock.lap("server_s")
        shutil.rmtree(folder, ignore_errors=True)
        self.last_timings = clock.laps
        self.last[run_id] = _Published(version, msg.sha256, tensors, entries)
        self.last_kind = body.get("kind", "full")
        return msg

    def _write_delta(self, run_id: str, version: int, last: _Published, tensors: dict,
                     clock: _Stopwatch) -> tuple[dict[str, TensorEntry], Path, dict[str, str]]:
        """The manifest's tensor entries of `tensors` (changed ones hashed, the others carried over from `last`),
        a staging folder holding the delta from `last` to `tensors`, and its file's sha256 (from memory)."""
        changed: dict[str, TensorEntry] = {}
        parts = delta_parts(last.tensors, tensors, digests=changed)
        clock.lap("diff_s")  # hashing the changed tensors included
        data = compress_delta(parts, self.zstd_level)
        clock.lap("compress_s")
        folder = self.staging_folder(run_id, version)
        (folder / DELTA_FILE).write_bytes(data)  # fsynced by the caller
        return last.entries | changed, folder, {DELTA_FILE: hashlib.sha256(data).hexdigest()}

    def export(self, run_id: str, name: str, folder: Path) -> dict[str, int]:
        """Upload `folder`'s files (consumed) as the run's export `name`, replacing one of that name: the
        weight server keeps it apart from the run's versions. File name -> bytes."""
        base = f"{self.url}/v1/exports/{run_id}/{name}"
        files = sorted(p.name for p in folder.iterdir() if p.is_file())
        for file in files:
            self._upload(f"{base}/files/{file}", folder / file)
        sizes = self._retry(lambda c: c.post(f"{base}/commit", json={"files": files}))["files"]
        shutil.rmtree(folder, ignore_errors=True)
        return sizes

    def unpin(self, run_id: str, version: int) -> list[int]:
        """Let the weight server's retention remove `version` again; the versions its pass deleted."""
        return self._retry(lambda c: c.delete(f"{self.url}/v1/runs/{run_id}/versions/{version}/pin"))["deleted"]

    def delete_export(self, run_id: str, name: str) -> None:
        self._retry(lambda c: c.delete(f"{self.url}/v1/exports/{run_id}/{name}"), json=False)

    def _upload(self, url: str, path: Path) -> str:
        digest = sha256_file(path)

        def chunks():
            with open(path, "rb") as f:
                while chunk := f.read(CHUNK):
                    yield chunk

        self._retry(lambda c: c.put(url, params={"sha256": digest}, content=chunks()))
        return digest

    def _retry(self, request, json: bool = True) -> dict | None:
        """One request, retried on transient errors within `timeout_s` in all (each attempt bounded by it too);
        its JSON answer (`json`), else None."""
        policy = RetryPolicy(TRANSIENT, budget_s=self.timeout_s, attempt_timeout_s=self.timeout_s,
                             first_wait_s=0.5, max_wait_s=10.0, what="publish")

        def attempt() -> dict | None:
            resp = request(self.http)
            if resp.status_code >= 500:
                raise WeightServerError(f"{resp.status_code} {resp.text[:300]}")
            resp.raise_for_status()
            return resp.json() if json else None

        try:
            return policy.call(attempt)
        except TRANSIENT as e:
            raise TimeoutError(f"weight server {self.url} unavailable: {e!r}") from e


class _Stopwatch:
    """Seconds between successive `lap` calls, by name: where a publish spends its time."""

    def __init__(self):
        self.laps: dict[str, float] = {}
        self.t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self.t
        self.t = now


def _layout(tensors: dict) -> dict[str, tuple[str, list[int]]]:
    """Name -> (dtype, shape) as a TensorEntry states them: a delta needs the same layout as its base."""
    return {n: (str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in tensors.items()}
