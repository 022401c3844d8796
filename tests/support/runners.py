"""External agent runners: the client side of `"agent_program": {"name": "external"}` runs, as a user's fleet
would run it (the demo, the gateway tests and benchmarks share it)."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import Any

Agent = Callable[[dict, Any], Awaitable[float]]


class Runners:
    """A stand-in for a user's fleet of external runners: `concurrency` loops, each claims a session of the run
    (`POST <claim_url>`, long-polling up to `wait_s`), runs `agent(task, client)` (an OpenAI SDK client on the
    session's base URL; returns the reward) and posts the reward.

    Claims and the agent's calls must not queue behind each other: a claim holds its connection for the whole
    long poll, so claims go through their own connection pool with one connection per loop (no cap), and each
    session's calls and reward go through a second pool, shared by the sessions. (With one pool capped at 100
    connections, 256 loops' claims took every connection and the reward posts waited behind them until every
    session timed out: the stall `make demo-agent` once had.)"""

    def __init__(self, claim_url: str, agent: Agent, concurrency: int, headers: dict | None = None,
                 wait_s: float = 5.0):
        self.claim_url, self.agent, self.concurrency = claim_url, agent, concurrency
        self.headers, self.wait_s = headers or {}, wait_s
        self.stop = threading.Event()
        self.episodes = self.failures = self.mismatches = 0
        self.versions: set[int] = set()
        self.calls: Any = None  # the httpx client every session's calls share (made in main)

    async def claim(self, http) -> dict | None:
        import aiohttp

        try:
            async with http.post(self.claim_url, json={"wait_s": self.wait_s}, headers=self.headers) as resp:
                if resp.status == 200:
                    return await resp.json()
                if 400 <= resp.status < 500:  # our mistake (token, run id): it will not fix itself
                    raise RuntimeError(f"claiming a session failed: HTTP {resp.status} {await resp.text()}")
                if resp.status != 204:
                    print(f"claiming a session failed (retrying): HTTP {resp.status} {await resp.text()}",
                          file=sys.stderr)
                    await asyncio.sleep(1.0)
        except aiohttp.ClientConnectionError:  # the worker / API restarting: try again shortly
            await asyncio.sleep(1.0)
        return None

    async def run_session(self, session: dict) -> None:
        import openai

        # Not closed after the session: it would close the shared connection pool of every session's calls.
        client = openai.AsyncOpenAI(base_url=session["base_url"], api_key="unused", max_retries=0,
                                    http_client=self.calls)
        try:
            reward = await self.agent(session["task"], client)
            posted = await client.post("/reward", body={"reward": reward}, cast_to=dict)
        except openai.APIError:  # e.g. the session timed out meanwhile: the platform records it as a timeout
            self.failures += 1
            return
        self.episodes += 1
        self.mismatches += posted["mismatches"]

    async def seen(self, response) -> None:
        """The policy version that served a call, from the gateway's response header."""
        if "X-Flywheel-Policy-Version" in response.headers:
            self.versions.add(int(response.headers["X-Flywheel-Policy-Version"]))

    async def loop(self, http) -> None:
        while not self.stop.is_set():
            session = await self.claim(http)
            if session is not None:
                await self.run_session(session)

    async def main(self) -> None:
        import aiohttp
        import httpx

        connector = aiohttp.TCPConnector(limit=0)  # one long-poll per loop at most: bounded by `concurrency`
        limits = httpx.Limits(max_connections=self.concurrency)  # one session per loop at a time
        async with aiohttp.ClientSession(connector=connector) as http, httpx.AsyncClient(
                limits=limits, timeout=120.0, event_hooks={"response": [self.seen]}) as self.calls:
            await asyncio.gather(*[self.loop(http) for _ in range(self.concurrency)])

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=lambda: asyncio.run(self.main()), daemon=True, name="runners")
        thread.start()
        return thread
