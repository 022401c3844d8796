"""tests/support/netns.py, which the weight-sync bench runs on: the shaping is real (bytes cross a link at the rate
asked for, not at memory speed), and every namespace and link it made is gone afterwards, after an error too,
and after a process that made them died."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.support.netns import PREFIX, ShapedNetwork, ip, namespaces, remove_leftovers
from tests.support.procs import start_service

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and tc need root")


def _links() -> set[str]:
    return {line.split(":")[1].strip() for line in ip("-o", "link", "show").splitlines()}


def _serve(net: ShapedNetwork, host: str, folder, port: int = 8000) -> subprocess.Popen:
    proc = start_service("http.server", within=net.exec_prefix(host), args=[str(port), "-d", str(folder)],
                         log=subprocess.DEVNULL)
    url = f"http://{net.address(host)}:{port}/"
    for _ in range(100):
        if net.exec("w0", ["curl", "-sf", "-o", "/dev/null", url]).returncode == 0:
            return proc
        time.sleep(0.1)
    proc.kill()
    raise TimeoutError("http.server did not come up")


def _get_seconds(net: ShapedNetwork, url: str) -> float:
    out = net.exec("w0", ["curl", "-sf", "-o", "/dev/null", "-w", "%{time_total} %{size_download}", url],
                   capture_output=True, text=True, check=True).stdout.split()
    assert int(out[1]) == 50 << 20
    return float(out[0])


def test_a_shaped_link_carries_50mb_at_1gbit_no_faster_than_the_rate(tmp_path):
    (tmp_path / "blob").write_bytes(os.urandom(50 << 20))
    links_before = _links()
    with ShapedNetwork(["server", "w0"], rate="1gbit") as net:
        server = _serve(net, "server", tmp_path)
        try:
            url = f"http://{net.address('server')}:8000/blob"
            seconds = min(_get_seconds(net, url) for _ in range(2))
            sent = net.tx_bytes("server")
        finally:
            server.kill()
            server.wait()
        made = set(net.created)
        assert len(made) == 3 and made <= set(namespaces())
    # 50 MB = 419 Mbit: >= 0.42 s at 1 Gbit/s; a copy that never crossed the shaper takes a few ms
    assert seconds >= 0.35, f"50 MB in {seconds:.3f} s: the link is not shaped to 1 Gbit/s"
    assert sent >= 2 * (50 << 20), "the bytes did not leave the server's namespace on its link"
    assert not made & set(namespaces()), "namespaces left behind"
    assert _links() == links_before, "links left in this namespace"


def test_everything_is_removed_after_an_error_inside(tmp_path):
    with pytest.raises(RuntimeError), ShapedNetwork(["server", "w0", "w1"], rate="10gbit") as net:
        tag = net.tag
        assert sum(n.startswith(tag) for n in namespaces()) == 4
        raise RuntimeError("boom")
    assert not [n for n in namespaces() if n.startswith(tag)]


def test_leftovers_of_a_dead_process_are_removed():
    code = ("from tests.support.netns import ShapedNetwork; import os; n = ShapedNetwork(['a'], '1gbit').__enter__(); "
            "print(n.tag, flush=True); os._exit(0)")  # dies without cleaning up
    tag = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert tag.startswith(PREFIX) and [n for n in namespaces() if n.startswith(tag)]
    removed = remove_leftovers()
    assert {f"{tag}-hub", f"{tag}-a"} <= set(removed)
    assert not [n for n in namespaces() if n.startswith(tag)]
