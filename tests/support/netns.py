"""Machines behind a real, rate-limited network link, on one host: Linux network namespaces joined by a bridge,
every link shaped with `tc tbf` (root only). The weight-sync bench and its tests run the weight server in one
namespace and each rollout worker in its own, so checkpoint bytes cross a link as they do between machines.

    with ShapedNetwork(["server", "w0", "w1"], rate="1gbit") as net:
        net.exec("w0", ["curl", ...])                 # a command inside w0's namespace
        net.address("server")                         # 10.213.<subnet>.10, reachable from every other host
        with net.entered("server"): httpx.get(...)    # this thread's sockets live in server's namespace

Layout: a hub namespace holds the bridge; each host namespace holds one end of a veth pair (`eth0`, its
address in 10.213.<subnet>.0/24, the subnet picked per network), the hub the other end, attached to the bridge.
`tbf` shapes what leaves an interface, so both ends of each veth are shaped: a host's uploads and its
downloads. Nothing is created in the caller's namespace: deleting the namespaces removes every link. Every
name starts with `fwlink-<pid>-`; `remove_leftovers()` deletes those of processes that no longer exist.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

PREFIX = "fwlink-"
CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/var/run/netns")


def ip(*args: str, check: bool = True) -> str:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True).stdout


def namespaces() -> list[str]:
    """Every network namespace `ip netns` knows, by name."""
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def remove_leftovers() -> list[str]:
    """Delete the namespaces (and with them their links) that a dead process of this module left behind."""
    gone = []
    for name in namespaces():
        m = re.match(rf"{PREFIX}(\d+)-", name)
        if m and not _alive(int(m.group(1))):
            ip("netns", "del", name, check=False)
            gone.append(name)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_networks = 0


class ShapedNetwork:
    """Hosts named `hosts`, each in its own namespace, every link shaped to `rate` (a tc rate: 1gbit, 10gbit)
    with `tbf burst <burst> latency <latency>`. Addresses: 10.213.<subnet>.10, .11, ... in `hosts` order."""

    def __init__(self, hosts: Sequence[str], rate: str = "1gbit", burst: str = "256kb", latency: str = "50ms"):
        global _networks
        if os.geteuid() != 0:
            raise PermissionError("ShapedNetwork needs root (ip netns, veth, tc)")
        _networks += 1
        self.tag = f"{PREFIX}{os.getpid()}-{_networks}"
        self.subnet = (os.getpid() * 7 + _networks) % 250 + 1
        self.hosts, self.rate, self.burst, self.latency = list(hosts), rate, burst, latency
        self.hub = f"{self.tag}-hub"
        self.created: list[str] = []

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def address(self, host: str) -> str:
        return f"10.213.{self.subnet}.{10 + self.hosts.index(host)}"

    def __enter__(self) -> ShapedNetwork:
        remove_leftovers()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _create(self) -> None:
        self._add_ns(self.hub)
        ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        ip("-n", self.hub, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts):
            ns, port = self.ns(host), f"v{i}"
            self._add_ns(ns)
            ip("-n", self.hub, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("-n", self.hub, "link", "set", port, "master", "br0", "up")
            ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            self.shape(self.hub, port)
            self.shape(ns, "eth0")

    def _add_ns(self, name: str) -> None:
        ip("netns", "add", name)
        self.created.append(name)
        ip("-n", name, "link", "set", "lo", "up")

    def shape(self, ns: str, dev: str) -> None:
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                        self.rate, "burst", self.burst, "latency", self.latency], check=True, capture_output=True)

    def set_rate(self, rate: str) -> None:
        """Reshape every link to `rate` (both ends of each veth)."""
        self.rate = rate
        for i, host in enumerate(self.hosts):
            self.shape(self.hub, f"v{i}")
            self.shape(self.ns(host), "eth0")

    def close(self) -> None:
        for name in reversed(self.created):  # a namespace's veth ends (and their peers) go with it
            ip("netns", "del", name, check=False)
        self.created = []

    # -- using it ---------------------------------------------------------------------------------------------
    def exec_prefix(self, host: str) -> list[str]:
        """Prepend to a command line to run it inside `host`'s namespace."""
        return ["ip", "netns", "exec", self.ns(host)]

    def exec(self, host: str, cmd: Sequence[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run([*self.exec_prefix(host), *cmd], **kw)

    def tx_bytes(self, host: str) -> int:
        """Bytes `host` has sent on its link (its eth0's counter)."""
        out = ip("-n", self.ns(host), "-s", "-j", "link", "show", "eth0")
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    @contextlib.contextmanager
    def entered(self, host: str) -> Iterator[None]:
        """The calling thread's network namespace is `host`'s inside the block (Linux keeps it per thread):
        sockets opened there, and processes started from this thread, belong to it."""
        with open("/proc/thread-self/ns/net", "rb") as home, open(NETNS_DIR / self.ns(host), "rb") as target:
            _setns(target.fileno())
            try:
                yield
            finally:
                _setns(home.fileno())


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")
