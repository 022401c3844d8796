"""The scripts the containers run: `flywheel-healthcheck URL` (exit 0 on a 2xx answer, 1 on an error status
or no answer: what docker and podman read as healthy / unhealthy), and the podman host set-up and stand-in
images' entrypoints (valid shell).

    pytest -q tests/component/test_container_scripts.py
"""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from infra.local.ports import free_port


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path == "/healthz" else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def check(url: str) -> int:
    return subprocess.run([sys.executable, "-m", "infra.healthcheck", url], capture_output=True, timeout=30).returncode


def test_healthy_unhealthy_and_unreachable(server):
    assert check(f"{server}/healthz") == 0
    assert check(f"{server}/stopping") == 1
    assert check(f"http://127.0.0.1:{free_port()}/healthz") == 1  # nothing listens there


def test_podman_host_scripts_parse():
    """The host set-up and the stand-in images' entrypoints are valid shell (run for real by make compose-smoke)."""
    compose_dir = Path(__file__).resolve().parents[2] / "infra" / "compose"
    scripts = [compose_dir / "podman-host.sh", *sorted((compose_dir / "standins").glob("*.sh"))]
    assert len(scripts) == 3
    for script in scripts:
        shell = "bash" if script.name == "podman-host.sh" else "sh"
        out = subprocess.run([shell, "-n", str(script)], capture_output=True, text=True)
        assert out.returncode == 0, f"{script}: {out.stderr}"
