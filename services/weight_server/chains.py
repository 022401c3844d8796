"""Relay chains: per file of a version, the rollout workers fetching it, in the order they asked. Each is told
to fetch from the worker before it (the first from the weight server), so the server sends the file once
whatever the number of workers; the protocol is in services/rollout_worker/weight_relay.py. Held in memory: after a restart the
chains start again empty (workers then fetch from the server and relay anew)."""

from __future__ import annotations

import threading

from prometheus_client import Counter

ROUTED_AROUND = Counter("weight_server_relays_dropped_total", "Relaying workers reported failed and dropped")


class RelayChains:
    def __init__(self, versions_kept: int = 8):
        self.chains: dict[tuple[str, int, str], list[str]] = {}
        self.versions_kept = versions_kept
        self.lock = threading.Lock()

    def source(self, run_id: str, version: int, name: str, peer: str, failed: str | None = None) -> str | None:
        """Where `peer` fetches `name` of `version` from: the worker before it in the chain, or None (the
        weight server). `failed`: the source `peer` had, which did not deliver; it leaves the chain."""
        with self.lock:
            key = (run_id, version, name)
            if key not in self.chains:
                self._forget_old(run_id, version)
            chain = self.chains.setdefault(key, [])
            if failed and failed != peer and failed in chain:
                chain.remove(failed)
                ROUTED_AROUND.inc()
            if peer not in chain:
                chain.append(peer)
            i = chain.index(peer)
            return chain[i - 1] if i else None

    def _forget_old(self, run_id: str, version: int) -> None:
        versions = sorted({v for r, v, _ in self.chains if r == run_id} | {version})
        old = set(versions[:-self.versions_kept])
        for key in [k for k in self.chains if k[0] == run_id and k[1] in old]:
            del self.chains[key]
