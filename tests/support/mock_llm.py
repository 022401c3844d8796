"""An OpenAI-compatible mock LLM for benchmarks and tests: fixed latency, boxed answers, token ids, logprobs.

    python -m tests.support.mock_llm --port 8100 --latency-ms 50 [--tokenizer DIR] [--answer correct|TEXT]

Speaks the protocol in the ports doc: POST /v1/completions (also /completions) with {"prompt": [ids] or
text, "max_tokens", ...} -> choices[0].{text, token_ids, logprobs.token_logprobs, finish_reason} and a
top-level "weight_version". `--answer correct` (default) decodes the prompt (needs `--tokenizer` when the
prompt is token ids), finds "What is A op B" and answers \\boxed{result}; anything else is answered with
`--fallback`. Any other `--answer` text is returned verbatim. A bare ASGI app (no framework) so that the
mock's own CPU use stays small next to the system under test.

`--tool-calls NAME` (bench/long.py's multi-turn workload) answers every request with a response of a sampled
length ending in one Qwen-format call of tool NAME (`<tool_call>{"name", "arguments": {"query"}}</tool_call>`),
a share `--malformed` of them not valid JSON. Lengths are lognormal with mean `--mean-tokens` and shape
`--length-sigma` (sigma 1: the median is 0.6 x the mean, p99 6 x: a long tail), at least the call's own length
(about 40 tokens), cut at the request's max_tokens
(finish_reason "length"; the call is kept so the episode runs its turns). The text before the call is a slice
of random words and the logprobs vary, so neither compresses better in storage than a sampled model's would.
Each draw is seeded by `--seed` and the prompt, so a rerun gives the same episode the same replies whatever
order the requests arrive in.

Hot reload speaks the vLLM dev-mode routes the openai engine calls, with vLLM's bodies (POST /pause?mode=wait,
/collective_rpc {"method"} -> {"results": [one worker's return]}, /reset_prefix_cache, /update_weight_version
{"new_version"}, /resume): pause waits for requests in flight and holds new ones until resume; the weights
themselves are not read (the answers do not depend on them): every extension method "succeeds" as
FlywheelWorkerExtension's would ({"ok": true}; flywheel_packed_modules: no fused layers), and every reply
carries the version last set, so reloads, deltas and the staleness bookkeeping run as they would against vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

ARITHMETIC = re.compile(r"What is (-?\d+) ([+\-*]) (-?\d+)")
CONTROL_ROUTES = ("/pause", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version", "/resume")


QUERY_WORDS = ("river", "mountain", "harbor", "engine", "library", "orchard", "glacier", "market", "signal",
               "bridge", "forest", "canal", "furnace", "lantern", "meadow", "tower")
RECORDS = 64  # numbered records per query word
# Words of the filler text before each call. Drawn at random, not repeated phrases: Postgres compresses each stored
# value (TOAST), and a filler that repeats itself would let a whole chat history compress to almost nothing.
WORDS = ("the", "a", "of", "to", "and", "in", "is", "that", "for", "it", "was", "on", "with", "as", "by", "at", "from",
         "this", "which", "record", "year", "entry", "source", "check", "next", "result", "passage", "search",
         "found", "says", "lists", "filed", "number", "notes", "before", "after", "other", "first", "last", "so",
         "we", "I", "need", "look", "compare", "date", "name", "value", "page", "file", "table", "line", "match",
         "maybe", "not", "yet", "also", "then", "because", "since", "if", "only", *QUERY_WORDS,
         *(str(n) for n in range(0, 2000, 37)))


@dataclass(frozen=True)
class ToolCalls:
    """The tool-calling response shape: lengths lognormal(mean, sigma), a `malformed` share of broken calls."""

    tool: str = "search"
    mean_tokens: float = 128.0
    sigma: float = 1.0
    malformed: float = 0.1
    seed: int = 0

    def draw(self, key: int) -> tuple[int, bool, str]:
        """(length in tokens before the max_tokens cut, malformed?, search query) for the request keyed `key`.
        Queries name one of RECORDS records (bench/long.py's corpus), so tool outputs vary as real searches do."""
        rng = random.Random(self.seed * 1_000_003 + key)
        mu = math.log(self.mean_tokens) - self.sigma ** 2 / 2  # so that E[length] = mean_tokens
        length = max(1, round(rng.lognormvariate(mu, self.sigma)))
        query = f"{rng.choice(QUERY_WORDS)} record {rng.randrange(RECORDS)}"
        return length, rng.random() < self.malformed, query

    def call_text(self, malformed: bool, query: str) -> str:
        body = json.dumps({"name": self.tool, "arguments": {"query": query}})
        if malformed:
            body = body[:-1]  # a missing closing brace: json.loads fails, the agent sends invalid_tool_call
        return f"<tool_call>\n{body}\n</tool_call>"


def prompt_key(prompt: list[int] | str) -> int:
    """A cheap, order-independent seed per request: the prompt's length and its last tokens."""
    tail = prompt[-64:] if isinstance(prompt, list) else [ord(c) for c in prompt[-64:]]
    return zlib.crc32(json.dumps([len(prompt), tail]).encode())


class MockLLM:
    def __init__(self, latency_s: float = 0.05, answer: str = "correct", fallback: str = "\\boxed{0}",
                 tokenizer: str | None = None, weight_version: int = 0, tool_calls: ToolCalls | None = None):
        self.latency_s, self.answer, self.fallback = latency_s, answer, fallback
        self.tool_calls = tool_calls
        self._filler: list[int] = []  # token ids of a long random text, encoded once; replies are slices of it
        self.weight_version = weight_version
        self.tokenizer = _load_tokenizer(tokenizer) if tokenizer else None
        self.requests = 0
        self.in_flight = 0
        self._running, self._drained = asyncio.Event(), asyncio.Event()  # bound to a loop at first use
        self._running.set()

    def reply_text(self, prompt: list[int] | str) -> str:
        if self.answer != "correct":
            return self.answer
        text = prompt if isinstance(prompt, str) else (self.tokenizer.decode(prompt) if self.tokenizer else "")
        m = ARITHMETIC.findall(text)
        if not m:
            return self.fallback
        a, op, b = m[-1]
        value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        return f"The answer is \\boxed{{{value}}}."

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is not None:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        return [ord(c) % 256 for c in text]

    async def complete(self, body: dict) -> dict:
        await self._running.wait()
        self.in_flight += 1
        try:
            await asyncio.sleep(self.latency_s)
            return self._reply(body)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._drained.set()

    async def control(self, path: str, body: dict) -> dict:
        """The reload routes: pause (returns once requests in flight are done), version update, resume."""
        if path == "/pause":
            self._running.clear()
            if self.in_flight:
                self._drained.clear()
                await self._drained.wait()
        elif path == "/collective_rpc":
            return {"results": [{} if body.get("method") == "flywheel_packed_modules" else {"ok": True}]}
        elif path == "/update_weight_version":
            self.weight_version = int(body["new_version"])
        elif path == "/resume":
            self._running.set()
        return {"ok": True, "weight_version": self.weight_version}

    def tool_reply(self, prompt: list[int] | str, max_tokens: int | None) -> tuple[list[int], list[float], bool]:
        """(token ids, logprobs, cut by max_tokens?): random filler of the drawn length ending in the tool call."""
        tc = self.tool_calls
        key = prompt_key(prompt)
        length, malformed, query = tc.draw(key)
        call = self.encode(tc.call_text(malformed, query))
        # never shorter than the call: a turn without one would end the episode early (the env grades it)
        n = max(length, len(call))
        n = min(n, max_tokens) if max_tokens else n
        rng = random.Random(f"{tc.seed}:{key}")
        if len(self._filler) < 4 * n:  # grow on demand: the tail is long
            words = random.Random(tc.seed)
            self._filler = self.encode(" ".join(words.choice(WORDS) for _ in range(max(20_000, 4 * n))))
        start = rng.randrange(len(self._filler) - n)
        filler = self._filler[start:start + n]
        # a budget shorter than the call itself cuts the call, as it would a real model's
        ids = filler[:n - len(call)] + call if n >= len(call) else call[:n]
        # varied like a sampled model's (a constant would compress to nothing in Postgres too)
        logprobs = [round(-rng.expovariate(2.0), 6) for _ in ids]
        return ids, logprobs, max(length, len(call)) > n

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else "".join(map(chr, ids))

    def _reply(self, body: dict) -> dict:
        self.requests += 1
        max_tokens = int(body.get("max_tokens") or 0) or None
        if self.tool_calls is not None:
            ids, logprobs, truncated = self.tool_reply(body.get("prompt", ""), max_tokens)
            text = self.decode(ids)
        else:
            text = self.reply_text(body.get("prompt", ""))
            full = self.encode(text)
            ids = full[: max_tokens or len(full)]
            truncated, logprobs = len(ids) < len(full), [-0.05] * len(ids)
            if truncated:
                text = self.decode(ids)
        return {
            "id": f"cmpl-{self.requests}", "object": "text_completion", "model": body.get("model", "mock"),
            "weight_version": self.weight_version,
            "choices": [{"index": 0, "text": text, "token_ids": ids, "finish_reason": "length" if truncated else "stop",
                         "logprobs": {"token_logprobs": logprobs}}],
            "usage": {"prompt_tokens": len(body.get("prompt") or []), "completion_tokens": len(ids)},
        }

    async def __call__(self, scope, receive, send) -> None:
        """ASGI entry point."""
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if method == "POST" and path in ("/v1/completions", "/completions", *CONTROL_ROUTES):
            raw = b""
            while True:
                msg = await receive()
                raw += msg.get("body", b"")
                if not msg.get("more_body"):
                    break
            try:
                body = json.loads(raw) if raw else {}
            except json.JSONDecodeError as e:
                return await _send(send, 400, {"error": {"message": f"body is not JSON: {e}"}})
            if path in CONTROL_ROUTES:
                return await _send(send, 200, await self.control(path, body))
            return await _send(send, 200, await self.complete(body))
        if method == "GET" and path in ("/v1/models", "/health", "/healthz"):
            return await _send(send, 200, {"object": "list", "data": [{"id": "mock", "object": "model"}]})
        await _send(send, 404, {"error": {"message": f"no route {method} {path}"}})


async def _send(send, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _load_tokenizer(path: str):
    from tokenizers import Tokenizer

    p = Path(path)
    return Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))


def main() -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--latency-ms", type=float, default=50.0, help="fixed latency per request, milliseconds")
    ap.add_argument("--answer", default="correct", help="'correct' or a fixed response text")
    ap.add_argument("--fallback", default="\\boxed{0}", help="response when the prompt is not arithmetic")
    ap.add_argument("--tokenizer", default=None, help="tokenizer.json or a folder holding one")
    ap.add_argument("--weight-version", type=int, default=0)
    ap.add_argument("--tool-calls", default=None, metavar="TOOL",
                    help="answer every request with a call of this tool (the multi-turn workload)")
    ap.add_argument("--mean-tokens", type=float, default=128.0, help="--tool-calls: mean response length, tokens")
    ap.add_argument("--length-sigma", type=float, default=1.0, help="--tool-calls: lognormal shape (the tail)")
    ap.add_argument("--malformed", type=float, default=0.1, help="--tool-calls: share of calls that are not JSON")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tool_calls = ToolCalls(args.tool_calls, args.mean_tokens, args.length_sigma, args.malformed, args.seed) \
        if args.tool_calls else None
    app = MockLLM(args.latency_ms / 1000, args.answer, args.fallback, args.tokenizer, args.weight_version,
                  tool_calls=tool_calls)
    # uvloop + httptools: with uvicorn's pure-Python h11 the mock itself took a core at ~200 requests/s.
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False, loop="uvloop",
                http="httptools", backlog=4096, timeout_keep_alive=60)


if __name__ == "__main__":
    main()
