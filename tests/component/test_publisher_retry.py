"""The publisher's requests to the weight server: 5xx and connection errors are retried within the budget,
then TimeoutError; a 4xx is the caller's fault and raised at once."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from services.trainer.publisher import WeightPublisher


def _server(statuses: list[int]):
    """Answers GET with the next status of `statuses` (the last one repeats); counts the requests."""
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            status = statuses[min(len(seen), len(statuses) - 1)]
            seen.append(status)
            body = json.dumps({"status": status}).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen


@pytest.fixture
def serve():
    servers = []

    def start(statuses):
        server, seen = _server(statuses)
        servers.append(server)
        return WeightPublisher(f"http://127.0.0.1:{server.server_port}", None, timeout_s=3.0), seen

    yield start
    for s in servers:
        s.shutdown()


def test_server_errors_are_retried_until_success(serve):
    publisher, seen = serve([503, 502, 200])
    assert publisher._retry(lambda c: c.get(f"{publisher.url}/x")) == {"status": 200}
    assert seen == [503, 502, 200]


def test_client_errors_are_not_retried(serve):
    publisher, seen = serve([409])
    with pytest.raises(httpx.HTTPStatusError):
        publisher._retry(lambda c: c.get(f"{publisher.url}/x"))
    assert seen == [409]


def test_unreachable_server_gives_up_within_the_budget():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    publisher = WeightPublisher(f"http://127.0.0.1:{port}", None, timeout_s=1.5)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="unavailable"):
        publisher._retry(lambda c: c.get(f"{publisher.url}/x"))
    assert time.monotonic() - start < 1.5 + 0.5
