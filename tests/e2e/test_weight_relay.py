"""Relayed weight sync (services/rollout_worker/weight_relay.py) between real processes on separate network namespaces behind
shaped links: the weight server sends a version's bytes once however many workers fetch it, every worker ends
with a verified copy, a relay that dies mid-transfer or sends bad bytes is routed around, a late joiner still
gets the version. The weight server and the relaying workers (tests/fixtures/relay_peer.py: the rollout
worker's fetch path alone) each run in their own namespace; Redis and Postgres are reached on unix sockets."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import Response
from sqlalchemy import create_engine
from trainer_testlib import WeightServer

from infra.local.servers import PostgresServer, RedisServer
from shared.contracts.db.models import Run
from shared.contracts.messages import WeightsPublished
from shared.weights.manifest import PIECE_BYTES, verify_folder
from tests.support.netns import ShapedNetwork
from tests.support.procs import start_service

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and tc need root")
REPO = Path(__file__).resolve().parents[2]
PEERS = ["a", "b", "c", "late"]


@pytest.fixture(scope="module")
def net():
    """server + 4 worker hosts at 100 Mbit/s (24 MB take ~2 s per link: time to kill a relay mid-transfer),
    the weight server running in `server`, on private unix-socket Redis and Postgres."""
    from shared.platform.db.migrate import upgrade
    from shared.platform.settings import ServiceSettings

    # not under pytest's tmp folders (owner-only): the embedded Postgres runs as its own user
    folder = Path(tempfile.mkdtemp(prefix="fw-relay-"))
    folder.chmod(0o755)
    redis_server, pg = RedisServer(folder / "redis", unix_socket=True), PostgresServer(folder / "pg")
    try:
        redis_server.start()
        pg.start()
        database_url = ServiceSettings(database_url=pg.url).database_url
        upgrade(database_url)
        with ShapedNetwork(["server", *PEERS], rate="100mbit") as net:
            with net.entered("server"):  # the server process starts in, and is polled from, its namespace
                ws = WeightServer(redis_server.url, database_url, folder / "weights", ANNOUNCE_PATH="false")
                ws.env["PUBLIC_URL"] = f"http://{net.address('server')}:{ws.port}"
                ws.start()
            net.ws, net.database_url, net.folder = ws, database_url, folder
            try:
                yield net
            finally:
                ws.stop()
    finally:
        pg.stop()
        redis_server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def _publish(net, size: int) -> tuple[WeightsPublished, bytes]:
    run_id = uuid.uuid4()
    with create_engine(net.database_url).begin() as c:
        c.execute(Run.__table__.insert().values(id=run_id, name="relay", kind="train", status="running",
                                                config={}, policy_version=0, summary={}))
    data = os.urandom(size)
    with net.entered("server"):
        url = f"{net.ws.url}/v1/runs/{run_id}/versions/1"
        httpx.put(f"{url}/files/blob", content=data, params={"sha256": hashlib.sha256(data).hexdigest()},
                  timeout=60).raise_for_status()
        r = httpx.post(f"{url}/publish", json={"files": {"blob": ""}}, timeout=60).raise_for_status()
    return WeightsPublished.model_validate(r.json()), data


class Peer:
    def __init__(self, net, host: str, msg: WeightsPublished, go: Path | None = None):
        self.host, self.url = host, f"http://{net.address(host)}:9000"
        self.cache = net.folder / f"cache-{host}-{uuid.uuid4().hex[:6]}"
        self.proc = start_service("tests/fixtures/relay_peer.py", within=net.exec_prefix(host),
                                  host=net.address(host), port="9000", cache_dir=str(self.cache),
                                  announcement=msg.model_dump_json(), pythonpath=str(REPO), stall_s="3",
                                  go_file=str(go) if go else None)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def serving(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while "SERVING\n" not in self.lines:
            assert self.proc.poll() is None, f"{self.host} exited:\n{''.join(self.lines)}"
            assert time.monotonic() < deadline, f"{self.host} did not start:\n{''.join(self.lines)}"
            time.sleep(0.01)

    def fetched(self, timeout_s: float = 60) -> Path:
        deadline = time.monotonic() + timeout_s
        while not any(line.startswith("FETCHED ") for line in self.lines):
            assert self.proc.poll() is None, f"{self.host} exited:\n{''.join(self.lines)}"
            assert time.monotonic() < deadline, f"{self.host} did not finish:\n{''.join(self.lines)}"
            time.sleep(0.02)
        return Path(next(line for line in self.lines if line.startswith("FETCHED ")).split(" ", 1)[1].strip())

    def received(self) -> int:
        """Bytes of the file it is fetching that are on its disk so far."""
        return sum(p.stat().st_size for p in self.cache.rglob("blob"))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


def _sources(net, msg: WeightsPublished, peers: list[str]) -> list[str | None]:
    """Ask for a source on behalf of each peer URL in order: fixes the chain's order before they start."""
    with net.entered("server"):
        return [httpx.get(f"{net.ws.url}/v1/runs/{msg.run_id}/versions/1/sources/blob", params={"peer": p})
                .raise_for_status().json()["source"] for p in peers]


def test_the_server_sends_a_version_once_to_a_chain_and_a_late_joiner_still_gets_it(net):
    msg, data = _publish(net, 24 << 20)
    urls = [f"http://{net.address(h)}:9000" for h in ("a", "b", "c")]
    assert _sources(net, msg, urls) == [None, urls[0], urls[1]]  # a from the server, b from a, c from b
    sent = net.tx_bytes("server")
    go = net.folder / f"go-{msg.run_id}"
    peers = [Peer(net, h, msg, go) for h in ("a", "b", "c")]
    try:
        for p in peers:
            p.serving()
        go.touch()
        start = time.monotonic()
        folders = [p.fetched() for p in peers]
        elapsed = time.monotonic() - start
        for folder in folders:
            verify_folder(folder, msg.sha256, full=True)
            assert (folder / "blob").read_bytes() == data
        first_egress = net.tx_bytes("server") - sent
        # 24 MB once (+ 3 manifests and TCP/HTTP framing), not three times
        assert len(data) <= first_egress <= 1.2 * len(data), first_egress
        # bytes flowed down the chain piece by piece: one link's time (2 s), not three hops one after another
        one_hop = len(data) * 8 / 100e6
        assert elapsed < 2 * one_hop, f"{elapsed:.2f} s to reach 3 workers; one link takes {one_hop:.2f} s"
        late = Peer(net, "late", msg)  # joins after every copy is done: fed by the chain's tail
        try:
            verify_folder(late.fetched(), msg.sha256, full=True)
        finally:
            late.kill()
        assert net.tx_bytes("server") - sent - first_egress < PIECE_BYTES  # the late joiner's bytes came from c
        assert any(line.startswith("FETCHED") for line in late.lines)
    finally:
        for p in peers:
            p.kill()


def test_a_relay_that_dies_mid_transfer_is_routed_around(net):
    msg, data = _publish(net, 24 << 20)
    urls = [f"http://{net.address(h)}:9000" for h in ("a", "b", "c")]
    _sources(net, msg, urls)  # chain: server -> a -> b -> c
    sent = net.tx_bytes("server")
    go = net.folder / f"go-{msg.run_id}"
    peers = {h: Peer(net, h, msg, go) for h in ("a", "b", "c")}
    try:
        for p in peers.values():
            p.serving()
        go.touch()
        deadline = time.monotonic() + 60
        while peers["c"].received() < 4 << 20:  # c is receiving from b
            assert time.monotonic() < deadline, "c never started receiving"
            time.sleep(0.01)
        assert peers["c"].received() < len(data)
        peers["b"].kill()  # mid-relay
        folder = peers["c"].fetched()
        verify_folder(folder, msg.sha256, full=True)
        assert (folder / "blob").read_bytes() == data
        assert any("routing around" in line for line in peers["c"].lines), "".join(peers["c"].lines)
        verify_folder(peers["a"].fetched(), msg.sha256, full=True)
        assert net.tx_bytes("server") - sent <= 1.2 * len(data)  # c resumed from a, not from the server
        # b is out of the chain: the next worker to ask is sent to c, the chain's live tail
        assert _sources(net, msg, [f"http://{net.address('late')}:9000"]) == [urls[2]]
    finally:
        for p in peers.values():
            p.kill()


def test_a_relay_that_sends_bad_bytes_is_routed_around(net):
    msg, data = _publish(net, 4 << 20)
    liar_url = f"http://{net.address('b')}:9001"
    app = FastAPI()

    @app.get("/v1/relay/{run_id}/{version}/{name}")
    def garbage(run_id: str, version: int, name: str) -> Response:  # the right length, the wrong bytes
        return Response(os.urandom(len(data)), media_type="application/octet-stream")

    server = uvicorn.Server(uvicorn.Config(app, host=net.address("b"), port=9001, log_level="warning"))
    with net.entered("b"):  # the socket is bound in b's namespace; the thread serving it may live anywhere
        sock = server.config.bind_socket()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        assert _sources(net, msg, [liar_url]) == [None]  # the liar heads the chain
        peer = Peer(net, "c", msg)
        try:
            folder = peer.fetched()
            verify_folder(folder, msg.sha256, full=True)
            assert (folder / "blob").read_bytes() == data
            assert any("differs from the manifest" in line for line in peer.lines), "".join(peer.lines)
        finally:
            peer.kill()
        # dropped from the chain: the next worker is sent to c, which fetched from the server
        assert _sources(net, msg, [f"http://{net.address('late')}:9000"]) == [peer.url]
    finally:
        server.should_exit = True
        thread.join(10)
