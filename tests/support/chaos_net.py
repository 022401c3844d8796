"""Network faults between the services' hosts: `make chaos-net` -> its scenarios in bench/results/chaos.json

    python -m tests.support.chaos_net [--only rollout_redis_partition_30s] [--tasks 40] [--samples 2]

Each service runs on a host of its own, a network namespace of tests/support/netns.py joined to the others by a
bridge: `data` (Redis and PostgreSQL, reached over TCP at its address: socat forwards each port to the
server's unix socket), `controller`, `rollout` (both rollout workers and the mock LLM), `env` (both env workers),
`api` (the API and the Celery worker), `trainer`, `weights` (the weight server: checkpoints cross its link over
HTTP), and `observer`, where this harness runs. A partition drops every packet
between two hosts on one port, both ways (a u32 filter on each end's link into a queue that holds nothing), so
connections hang as they do when a network splits, rather than being refused; a lossy link drops packets at
random with nftables, and a slow one is a delay proxy in front of the weight server (the kernel has no netem).
Per scenario the report adds
`partitioned_s`, the stall reason the run showed while it lasted, and `recovery_s` from the fault's end to
progress again. Scenario bring-up, accounting and the report are tests/support/chaos.py's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from sqlalchemy.engine import make_url

from infra.local.ports import free_port
from infra.local.servers import PostgresServer, RedisServer
from tests.support.chaos import RESULTS, SERVICE_ENV, Chaos, Scenario, merge_report, passed, run_scenario
from tests.support.netns import NETNS_DIR, ShapedNetwork
from tests.support.procs import wait_until

HOSTS = ["data", "observer", "controller", "rollout", "env", "api", "trainer", "weights"]
WHERE = {"controller": "controller", "rollout-worker": "rollout", "env-worker": "env", "api": "api", "jobs": "api",
         "trainer": "trainer", "weight-server": "weights"}
PORTS = {"redis": 6379, "postgres": 5432}
FAULT_S = 30.0
CUT_SETTLE_S = 1.0  # after a partition is in place, before the progress at its start is read


class NetChaos(Chaos):
    """tests/support/chaos.py's live system, each service on its own host of a bridged network."""

    WEIGHT_LINK_DELAY_MS = 0.0  # > 0: the weight server behind tests/support/delay_proxy.py from the start

    def __init__(self, tmp: Path, tasks: int, samples: int, latency_ms: float, kind: str = "eval"):
        from infra.local.stack import LocalStack, Placement

        self.tmp, self.tasks, self.samples, self.latency_ms, self.kind = tmp, tasks, samples, latency_ms, kind
        self.mock, self.run_id, self.engine = None, "", None
        self.stall_reasons: list[str] = []
        self.outages: list[str] = []  # what the run's REST view said was down, while a fault lasted
        self.side_calls: list[tuple[str, int, float, str]] = []  # REST calls a scenario made: what each answered
        self.side_run = ""
        self.progress_during: list[int] = []  # the run's progress as each fault began and as it ended
        self.net = ShapedNetwork(HOSTS, rate="10gbit").__enter__()
        self.forwarders: list[subprocess.Popen] = []
        self.observer = self.net.entered("observer")
        try:
            self.redis = RedisServer(tmp / "redis", unix_socket=True)
            self.postgres = PostgresServer(tmp / "postgres")
            self.redis.start()
            self.postgres.start()
            data = self.net.address("data")
            pg = make_url(self.postgres.url)
            pg_socket = Path(pg.query["host"]) / f".s.PGSQL.{pg.port or 5432}"
            self._forward(PORTS["redis"], self.redis.socket)
            self._forward(PORTS["postgres"], pg_socket)
            database_url = pg.set(host=data, port=PORTS["postgres"], query={}).render_as_string(hide_password=False)
            self.observer.__enter__()  # from here on this thread (and what it starts) lives on `observer`
            weight_port = free_port()
            weight_url = f"http://{self.net.address('weights')}:{weight_port}"
            behind_proxy = {}
            if self.WEIGHT_LINK_DELAY_MS:  # the server on an inner port, the proxy on the one everyone uses
                inner = free_port()
                behind_proxy = {"WEIGHT_SERVER_PORT": str(inner)}
                self.forwarders.append(subprocess.Popen(
                    [*self.net.exec_prefix("weights"), sys.executable, "-m", "tests.support.delay_proxy", "--listen",
                     f"{self.net.address('weights')}:{weight_port}", "--to", f"127.0.0.1:{inner}", "--delay-ms",
                     str(self.WEIGHT_LINK_DELAY_MS)], cwd=Path(__file__).resolve().parents[2],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

            def placement(name: str, index: int) -> Placement:
                # nsenter, not `ip netns exec`: that one mounts a sysfs of its own, without the cgroups the env
                # worker's sandbox limits processes with
                host = WHERE[name]
                env = ({"PUBLIC_URL": weight_url, "ANNOUNCE_PATH": "false", **behind_proxy} if name == "weight-server"
                       else {"WEIGHT_SERVER_URL": weight_url})  # checkpoints cross the weight server's link
                return Placement(("nsenter", f"--net={NETNS_DIR / self.net.ns(host)}"), self.net.address(host), env)

            self.stack = LocalStack(tmp / "stack", placement=placement, env={
                **SERVICE_ENV, "STALL_AFTER_S": "10",  # the run says why it stalls while a 30 s fault lasts
                "WEIGHT_SERVER_PORT": str(weight_port),
                "REDIS_URL": f"redis://{data}:{PORTS['redis']}/0", "DATABASE_URL": database_url})
        except BaseException:
            self._close_net()
            raise

    def _forward(self, port: int, socket: Path) -> None:
        self.forwarders.append(subprocess.Popen(
            [*self.net.exec_prefix("data"), "socat", f"TCP-LISTEN:{port},bind={self.net.address('data')},fork,reuseaddr",
             f"UNIX-CONNECT:{socket}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def start(self) -> None:
        from shared.platform.db.session import make_engine
        from tests.support.live import start_mock_llm

        if self.kind == "train":
            return self._start_training()
        model_dir = self._tokenizer()
        mock_port = free_port()
        with self.net.entered("rollout"):  # beside the rollout workers: their 127.0.0.1
            self.mock = start_mock_llm(mock_port, self.latency_ms)
        self.stack.start(services=["api", "jobs", "controller", "env-worker", "rollout-worker"],
                         counts={"rollout-worker": 2, "env-worker": 2})
        self.stack.wait_healthy(120)
        self.engine = make_engine(self.postgres.url)  # the harness reads Postgres on its unix socket: no partition
        self._dataset()
        self.run_id = self._start_run(model_dir, f"http://127.0.0.1:{mock_port}/v1")

    # -- faults ------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def partitioned(self, host: str, service: str):
        """No packet between `host` and `data` on the service's port, either way, inside the block. The run's
        progress at the fault's start is read once the cut is in place and CUT_SETTLE_S later: a commit Postgres
        received before the cut still lands, and on a loaded machine the filters take a while to apply."""
        port, data = PORTS[service], self.net.address("data")
        self._drop(self.net.ns(host), f"match ip dst {data}/32 match ip dport {port} 0xffff")
        self._drop(self.net.ns("data"), f"match ip dst {self.net.address(host)}/32 match ip sport {port} 0xffff")
        time.sleep(CUT_SETTLE_S)
        self.progress_during.append(self.progress())
        try:
            yield
        finally:
            self.progress_during.append(self.progress())
            for ns in (self.net.ns(host), self.net.ns("data")):
                self.net.shape(ns, "eth0")  # the plain shaped link again: the filter and its queue go with it

    def link_down(self, host: str, seconds: float) -> None:
        """`host`'s link down for `seconds`: every connection through it stalls, a transfer in progress too."""
        self.progress_during.append(self.progress())
        ip = ["ip", "-n", self.net.ns(host), "link", "set", "eth0"]
        subprocess.run([*ip, "down"], check=True, capture_output=True)
        try:
            self.watch_stall(seconds)
        finally:
            self.progress_during.append(self.progress())
            subprocess.run([*ip, "up"], check=True, capture_output=True)

    def slow_link(self, host: str, rate: str | None) -> None:
        """Both ends of `host`'s link shaped to `rate` (None: back to the network's)."""
        port = f"v{self.net.hosts.index(host)}"
        for ns, dev in ((self.net.ns(host), "eth0"), (self.net.hub, port)):
            if rate is None:
                self.net.shape(ns, dev)
            else:
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                                rate, "burst", "16kb", "latency", "2s"], check=True, capture_output=True)

    def lossy_link(self, host: str, share: float) -> None:
        """Packets into and out of `host` dropped at random, `share` of them each way (nftables' random number
        per packet: real loss, which TCP retransmits), until close."""
        rule = f"numgen random mod 1000 < {round(share * 1000)} counter drop"
        script = (f"table inet chaos {{\n chain in {{ type filter hook input priority 0; iifname \"eth0\" {rule}; }}\n"
                  f" chain out {{ type filter hook output priority 0; oifname \"eth0\" {rule}; }}\n}}\n")
        subprocess.run(["ip", "netns", "exec", self.net.ns(host), "nft", "-f", "-"], input=script.encode(),
                       check=True, capture_output=True)

    @staticmethod
    def _drop(ns: str, match: str) -> None:
        """Packets leaving `ns`'s link that `match` (a u32 match) selects are dropped: classed by an htb root into
        a class whose queue holds none (pfifo limit 0). Built from htb, u32 and pfifo because those are what
        this kernel has: no netem, prio or gact module is loaded here."""
        tc = ["ip", "netns", "exec", ns, "tc"]
        for args in ("qdisc replace dev eth0 root handle 1: htb default 10",
                     "class add dev eth0 parent 1: classid 1:10 htb rate 10gbit",
                     "class add dev eth0 parent 1: classid 1:30 htb rate 10gbit",
                     "qdisc add dev eth0 parent 1:30 handle 30: pfifo limit 0",
                     f"filter add dev eth0 parent 1: protocol ip prio 1 u32 {match} flowid 1:30"):
            subprocess.run([*tc, *args.split()], check=True, capture_output=True)

    def watch_stall(self, seconds: float) -> None:
        """Sleep `seconds`, noting each distinct stall reason the run shows meanwhile (its row, read on the unix
        socket) and each `outage` its REST view names (why its numbers are frozen)."""
        import httpx
        from sqlalchemy import text

        end = time.monotonic() + seconds
        with self.api() as api:
            while time.monotonic() < end:
                with contextlib.suppress(Exception), self.engine.connect() as c:
                    reason = c.execute(text("SELECT stall_reason FROM runs WHERE id = :r"), {"r": self.run_id}).scalar()
                    if reason and reason not in self.stall_reasons:
                        self.stall_reasons.append(reason)
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    outage = api.get(f"/v1/runs/{self.run_id}", timeout=5).json().get("outage")
                    if outage and outage not in self.outages:
                        self.outages.append(outage)
                time.sleep(0.5)

    def observed(self) -> dict:
        out: dict = {**super().observed(), "stall_reasons_during_fault": self.stall_reasons,
                     "outages_during_fault": self.outages, "progress_at_fault_start_end": self.progress_during}
        if self.side_calls:
            out["side_run_calls"] = [{"call": c, "status": s, "at_s": t, "said": m} for c, s, t, m in self.side_calls]
        if self.side_run:
            from tests.support.live import run_status
            out["side_run_status"] = run_status(self.engine, self.side_run)
        if self.kind == "train":
            out["weight_reloads"] = self.reload_outcomes()
        return out

    def reload_outcomes(self) -> dict[str, int]:
        """The rollout workers' weight reloads by outcome (ok, error, checksum_error, ...), from their /metrics."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        counts: dict[str, int] = {}
        for inst in (i for i in self.stack.instances if i.name == "rollout-worker" and i.alive):
            with contextlib.suppress(httpx.HTTPError):
                text = httpx.get(f"{inst.url}/metrics", timeout=5).text
                for family in text_string_to_metric_families(text):
                    for sample in family.samples:
                        if sample.name == "rollout_weight_reloads_total":
                            outcome = sample.labels["outcome"]
                            counts[outcome] = counts.get(outcome, 0) + int(sample.value)
        return counts

    # -- teardown ----------------------------------------------------------------------------------------------
    def close(self) -> None:
        try:
            super().close()
        finally:
            self._close_net()

    def _close_net(self) -> None:
        for proc in self.forwarders:
            proc.kill()
            proc.wait()
        with contextlib.suppress(Exception):
            self.observer.__exit__(None, None, None)
        self.net.close()


def partition(host: str, service: str, seconds: float = FAULT_S) -> Callable[[NetChaos], None]:
    def inject(c: NetChaos) -> None:
        with c.partitioned(host, service):
            c.watch_stall(seconds)
    return inject


def api_partitioned_while_runs_start_and_stop(c: NetChaos) -> None:
    """The API host loses Redis while a user starts and stops runs: run commands reach the controller over Redis,
    so each answers 503 within RUN_COMMAND_WAIT_S saying nothing changed (no run created, none stopped), and
    once the link is back the same calls succeed; the running run goes on throughout."""
    config = {"name": "chaos-net-second", "kind": "eval", "model": str(c.tmp / "model"), "dataset": "chaos-arith",
              "dataset_split": "test", "agent": {"name": "math"}, "env": {"name": "math"}, "max_in_flight": 2,
              "engine": {"type": "openai", "base_url": "http://127.0.0.1:1/v1"}, "max_attempts": 1}
    t0 = time.monotonic()

    def call(what: str, method: str, path: str, **kw):
        resp = api.request(method, path, timeout=60, **kw)
        said = resp.json().get("message" if resp.status_code >= 400 else "status", "")
        c.side_calls.append((what, resp.status_code, round(time.monotonic() - t0, 1), str(said)[:300]))
        return resp

    with c.api() as api:
        with c.partitioned("api", "redis"):
            call("start during the partition", "POST", "/v1/runs", json=config)
            call("pause during the partition", "POST", f"/v1/runs/{c.run_id}/pause")
            c.watch_stall(max(0.0, FAULT_S - (time.monotonic() - t0)))
        resp = call("start after it", "POST", "/v1/runs", json=config)
        if resp.status_code == 201:
            c.side_run = resp.json()["id"]
            call("stop after it", "POST", f"/v1/runs/{c.side_run}/stop")


def weight_transfer_cut(c: NetChaos) -> None:
    """The weight server's link slowed to 256 kbit/s, so a checkpoint takes seconds to cross it, then taken down
    for 5 s just after the trainer published a version: the rollout workers' fetches of it (and the trainer's
    next upload) are cut mid-way. Each must resume or start again: the run trains every version."""
    c.slow_link("weights", "256kbit")
    try:
        version = c.progress()
        wait_until(lambda: c.progress() > version, 180, "a version published over the slow link", interval_s=0.1)
        time.sleep(0.5)
        c.link_down("weights", 5)
    finally:
        c.slow_link("weights", None)


class SlowLossyWeightLinks(NetChaos):
    """The weight server's host on a link with 200 ms of delay each way and 10% of packets lost each way, from
    before the run starts to its end."""

    WEIGHT_LINK_DELAY_MS = 200.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lossy_link("weights", 0.10)

    def observed(self) -> dict:
        """Besides the run: the packets the weight server's link dropped (nftables' counters) and a round trip to
        it (its /healthz, through the delay): the fault was real."""
        import re

        import httpx

        listing = subprocess.run(["ip", "netns", "exec", self.net.ns("weights"), "nft", "list", "table", "inet",
                                  "chaos"], check=True, capture_output=True, text=True).stdout
        dropped = sum(int(n) for n in re.findall(r"counter packets (\d+)", listing))
        server = next(i for i in self.stack.instances if i.name == "weight-server")
        started = time.monotonic()
        with contextlib.suppress(httpx.HTTPError):
            httpx.get(f"{server.url}/healthz", timeout=30)
        return {**super().observed(), "weight_link": {"packets_dropped": dropped,
                                                      "healthz_round_trip_s": round(time.monotonic() - started, 3)}}


def lossy_weight_links(c: NetChaos) -> None:
    """Nothing more to inject: the links were slow and lossy from the start; watch the run's stall reasons."""
    c.progress_during.append(c.progress())
    c.watch_stall(5)
    c.progress_during.append(c.progress())


NET_SCENARIOS = [
    Scenario("rollout_redis_partition_30s", partition("rollout", "redis"),
             "the rollout host (both rollout workers) cut off from Redis for 30 s"),
    Scenario("controller_postgres_partition_30s", partition("controller", "postgres"),
             "the controller cut off from PostgreSQL for 30 s"),
    Scenario("api_redis_partition_30s", api_partitioned_while_runs_start_and_stop,
             "the API host cut off from Redis for 30 s while runs are started and paused over REST"),
    Scenario("trainer_postgres_partition_30s", partition("trainer", "postgres"),
             "the trainer cut off from PostgreSQL for 30 s mid-run", kind="train"),
    Scenario("weight_transfer_cut_5s", weight_transfer_cut,
             "the weight server's link (256 kbit/s) down for 5 s while a version's checkpoint crosses it",
             kind="train"),
    Scenario("weight_links_200ms_10pct_loss", lossy_weight_links,
             "every link of the weight server 200 ms slower each way and losing 10% of packets each way, for the "
             "whole training run", kind="train"),
]
SYSTEMS: dict[str, type[NetChaos]] = {"weight_links_200ms_10pct_loss": SlowLossyWeightLinks}


def run_net_scenario(scenario: Scenario, tasks: int = 40, samples: int = 2, latency_ms: float = 400) -> dict:
    # Scenario threads are not this module's: the whole scenario runs on one thread, entered in `observer`.
    out: dict = {}

    def body() -> None:
        out.update(run_scenario(scenario, tasks, samples, latency_ms, system=SYSTEMS.get(scenario.name, NetChaos)))
    worker = threading.Thread(target=body, name=f"chaos-net-{scenario.name}")
    worker.start()
    worker.join()
    return out


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated scenario names (default: all)")
    ap.add_argument("--tasks", type=int, default=40)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    results = []
    for scenario in [s for s in NET_SCENARIOS if not args.only or s.name in args.only.split(",")]:
        print(f"== {scenario.name}: {scenario.doc}", flush=True)
        results.append(run_net_scenario(scenario, args.tasks, args.samples))
        print(json.dumps(results[-1]), flush=True)
    ok = all(passed(r) for r in results)
    merge_report(results, args.out)
    print(f"wrote {args.out}; every network scenario completed with nothing lost or doubled: {ok}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
