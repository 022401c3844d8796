"""Client of the weight server: publish one exported HF folder as version v of a run.

Co-located (WEIGHTS_DIR set): the folder is exported straight into a staging folder on the weight server's
volume and published by path (the server moves the files, no copy). Remote: every file is uploaded over
HTTP with its sha256, then published. Transient HTTP errors are retried within `timeout_s`; a 4xx (bad
request, checksum mismatch) is not transient and raises."""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path

import httpx

from shared.logs import get_logger
from shared.messages import WeightsPublished
from shared.weights import CHUNK, fsync_path, sha256_file

log = get_logger(__name__)


class WeightPublisher:
    def __init__(self, url: str, weights_dir: Path | None, timeout_s: float = 600.0):
        self.url, self.weights_dir, self.timeout_s = url.rstrip("/"), weights_dir, timeout_s

    def staging_folder(self, run_id: str, version: int) -> Path:
        """Where to export version `version` before publishing it."""
        base = self.weights_dir / ".staging" if self.weights_dir else Path("/tmp/flywheel-staging")
        folder = base / f"{run_id}-v{version}-{uuid.uuid4().hex[:6]}"
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def publish(self, run_id: str, version: int, folder: Path, metrics: dict[str, float],
                best_metric: str | None = None) -> WeightsPublished:
        files = sorted(p.name for p in folder.iterdir() if p.is_file())
        body = {"metrics": metrics, "best_metric": best_metric}
        if self.weights_dir:
            for name in files:  # durable before the server renames it into place
                fsync_path(folder / name)
            # Declared hashes let a server with VERIFY_STAGING=false skip re-reading; one that verifies compares.
            body |= {"staging_path": str(folder), "files": {n: sha256_file(folder / n) for n in files}}
        else:
            body["files"] = {n: self._upload(run_id, version, folder / n) for n in files}
        msg = WeightsPublished.model_validate(
            self._retry(lambda c: c.post(f"{self.url}/v1/runs/{run_id}/versions/{version}/publish", json=body)))
        shutil.rmtree(folder, ignore_errors=True)
        return msg

    def post_publish(self, run_id: str, version: int, folder: Path, files: dict[str, str],
                     metrics: dict[str, float]) -> WeightsPublished:
        """Publish a staged folder whose file hashes are already known (co-located only)."""
        body = {"metrics": metrics, "staging_path": str(folder), "files": files}
        return WeightsPublished.model_validate(
            self._retry(lambda c: c.post(f"{self.url}/v1/runs/{run_id}/versions/{version}/publish", json=body)))

    def _upload(self, run_id: str, version: int, path: Path) -> str:
        digest = sha256_file(path)

        def chunks():
            with open(path, "rb") as f:
                while chunk := f.read(CHUNK):
                    yield chunk

        url = f"{self.url}/v1/runs/{run_id}/versions/{version}/files/{path.name}"
        self._retry(lambda c: c.put(url, params={"sha256": digest}, content=chunks()))
        return digest

    def _retry(self, request) -> dict:
        deadline, delay = time.monotonic() + self.timeout_s, 0.5
        while True:
            try:
                with httpx.Client(timeout=self.timeout_s) as client:
                    resp = request(client)
                if resp.status_code < 500:
                    resp.raise_for_status()
                    return resp.json()
                error: Exception = httpx.HTTPStatusError(resp.text, request=resp.request, response=resp)
            except httpx.TransportError as e:
                error = e
            if time.monotonic() + delay > deadline:
                raise TimeoutError(f"weight server {self.url} unavailable: {error!r}")
            log.warning("publish retry in %.1fs: %r", delay, error)
            time.sleep(delay)
            delay = min(delay * 2, 10.0)
