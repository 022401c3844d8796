"""Rollout workers relay checkpoint files to each other, so the weight server sends each version's bytes once
whatever the number of workers.

Per file of a version the weight server keeps a chain of the workers fetching it. Each worker streams the file
from the one before it, checks every piece against the manifest before it writes, loads or serves it to the
next. A source that dies, stalls or sends a piece that does not verify is reported and routed around, and the
download resumes at the first piece not yet verified (HTTP Range).

More: docs/weight-sync.md#fetching-and-verifying-a-version
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
from fastapi import APIRouter, Header, HTTPException
from fastapi.responses import StreamingResponse

from shared.contracts.messages import WeightsPublished
from shared.platform.logs import get_logger
from shared.weights.manifest import ChecksumError, FileEntry

log = get_logger(__name__)


class SourceFailed(Exception):
    """A relaying worker could not give what it was asked for (gone, stalled, or sent bad bytes)."""


class RelayedFile:
    """One file this worker fetches and serves: `verified` bytes from its start are on disk and checked.
    Readers share the writer's descriptor (positional reads), so renaming the file into the version's folder
    or deleting it later does not disturb a transfer in progress."""

    def __init__(self, path: Path, entry: FileEntry):
        self.entry, self.size = entry, entry.bytes
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.verified = 0
        self.aborted = False
        self.cond = threading.Condition()

    def write_piece(self, data: bytes) -> None:
        """Check the next piece against the manifest, write it, and let readers have it."""
        index = self.verified // self.entry.piece_bytes
        if hashlib.sha256(data).hexdigest() != self.entry.pieces[index]:
            raise ChecksumError(f"piece {index} (bytes {self.verified}..{self.verified + len(data)}) differs from "
                                "the manifest")
        os.pwrite(self.fd, data, self.verified)
        with self.cond:
            self.verified += len(data)
            self.cond.notify_all()

    def next_piece_bytes(self) -> int:
        return min(self.entry.piece_bytes, self.size - self.verified)

    def abort(self) -> None:
        with self.cond:
            self.aborted = True
            self.cond.notify_all()

    def close(self) -> None:
        self.abort()
        os.close(self.fd)

    def read_from(self, offset: int, stall_s: float) -> Iterator[bytes]:
        """Verified bytes from `offset` to the end, waiting for the download to bring them; stops early (the
        reader sees a short body) when the download is aborted or brings nothing for `stall_s`."""
        pos = offset
        while pos < self.size:
            with self.cond:
                self.cond.wait_for(lambda p=pos: self.verified > p or self.aborted, timeout=stall_s)
                end = self.verified
            if end <= pos:
                return
            while pos < end:
                data = os.pread(self.fd, min(end - pos, 1 << 20), pos)
                if not data:
                    return
                pos += len(data)
                yield data


class Relay:
    """This worker's side: fetch files through the chain, and serve what it holds to the workers after it.

    `url`: where other workers reach this worker's HTTP port (its /v1/relay routes). Keeps the files of the
    newest `keep` versions per run servable."""

    def __init__(self, url: str, *, stall_s: float = 10.0, keep: int = 2):
        self.url, self.stall_s, self.keep = url.rstrip("/"), stall_s, keep
        self.files: dict[tuple[str, int, str], RelayedFile] = {}
        self.lock = threading.Lock()
        self.registered = threading.Condition(self.lock)

    def held(self, run_id: str, version: int, name: str, wait_s: float = 0.0) -> RelayedFile | None:
        """The file, once this worker has begun fetching it: a worker is put in the chain when it asks for its
        source, a moment before its download starts, so a request for a file of its newest version (or newer)
        may come first and wait up to `wait_s`."""
        with self.registered:
            newest = max((v for r, v, _ in self.files if r == run_id), default=version)
            if version >= newest:  # an older version's file it lacks, it will not fetch: no wait
                self.registered.wait_for(lambda: (run_id, version, name) in self.files, timeout=wait_s)
            return self.files.get((run_id, version, name))

    def _register(self, msg: WeightsPublished, name: str, path: Path, entry: FileEntry) -> RelayedFile:
        f = RelayedFile(path, entry)
        with self.lock:
            old = self.files.pop((msg.run_id, msg.version, name), None)
            self.files[(msg.run_id, msg.version, name)] = f
            self.registered.notify_all()
            versions = sorted({v for r, v, _ in self.files if r == msg.run_id})
            stale = [k for k in self.files if k[0] == msg.run_id and k[1] in versions[:-self.keep]]
            gone = [self.files.pop(k) for k in stale]
        for g in [old, *gone]:
            if g is not None:
                g.close()
        return f

    def fetch(self, client: httpx.Client, msg: WeightsPublished, name: str, entry: FileEntry, path: Path) -> None:
        """Download `name` of the announced version into `path`, piece by piece through the chain, each piece
        verified. ChecksumError when the weight server itself sends bytes that do not verify."""
        f = self._register(msg, name, path, entry)
        failed: str | None = None
        sources_tried = 0
        while f.verified < f.size:
            source = self._source(client, msg, name, failed)
            url = f"{source}/v1/relay/{msg.run_id}/{msg.version}/{name}" if source else f"{msg.uri.rstrip('/')}/{name}"
            try:
                self._pull(client, url, f)
                failed = None
            except (httpx.HTTPError, ChecksumError, SourceFailed) as e:
                if source is None:
                    f.abort()
                    raise
                sources_tried += 1
                log.warning("relay %s failed for v%d %s at byte %d (%s); routing around it", source, msg.version,
                            name, f.verified, e or type(e).__name__)
                failed = source
                if sources_tried > 64:
                    f.abort()
                    raise SourceFailed(f"{name}: {sources_tried} sources failed") from e

    def _source(self, client: httpx.Client, msg: WeightsPublished, name: str, failed: str | None) -> str | None:
        params = {"peer": self.url} | ({"failed": failed} if failed else {})
        r = client.get(f"{msg.uri.rstrip('/')}/sources/{name}", params=params).raise_for_status()
        return r.json()["source"]

    def _pull(self, client: httpx.Client, url: str, f: RelayedFile) -> None:
        start = f.verified
        headers = {"Range": f"bytes={start}-"} if start else {}
        with client.stream("GET", url, headers=headers, timeout=httpx.Timeout(30, read=self.stall_s)) as resp:
            if resp.status_code != (206 if start else 200):
                raise SourceFailed(f"{url} answered {resp.status_code}")
            buf = bytearray()
            for chunk in resp.iter_raw():
                buf += chunk
                while f.verified < f.size and len(buf) >= (n := f.next_piece_bytes()):
                    f.write_piece(bytes(buf[:n]))
                    del buf[:n]
        if f.verified < f.size:
            raise SourceFailed(f"{url} ended at byte {f.verified} of {f.size}")


def relay_router(relay: Relay) -> APIRouter:
    """`GET /v1/relay/<run>/<version>/<name>` (an optional `Range: bytes=<start>-`): the verified bytes of a
    file this worker holds or is fetching, streamed as they arrive; 404 when it has not begun fetching such a
    file within its stall time."""
    router = APIRouter()

    @router.get("/v1/relay/{run_id}/{version}/{name}")
    def serve(run_id: str, version: int, name: str, range: str | None = Header(None)) -> StreamingResponse:
        f = relay.held(run_id, version, name, wait_s=relay.stall_s)
        if f is None:
            raise HTTPException(404, f"this worker holds no {name} of run {run_id} v{version}")
        start = 0
        if range:
            unit, _, spec = range.partition("=")
            first, _, last = spec.partition("-")
            if unit.strip() != "bytes" or not first.isdigit() or last:
                raise HTTPException(416, f"Range {range!r}: only 'bytes=<start>-' is served")
            start = int(first)
        if start > f.size:
            raise HTTPException(416, f"Range starts at {start}, past the end ({f.size} bytes)")
        headers = {"content-length": str(f.size - start)}
        if start:
            headers["content-range"] = f"bytes {start}-{f.size - 1}/{f.size}"
        return StreamingResponse(f.read_from(start, relay.stall_s), status_code=206 if start else 200,
                                 headers=headers, media_type="application/octet-stream")

    return router
