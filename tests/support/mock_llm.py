"""An OpenAI-compatible mock LLM for benchmarks and tests: fixed latency, boxed answers, token ids, logprobs.

    python -m tests.support.mock_llm --port 8100 --latency-ms 50 [--tokenizer DIR] [--answer correct|TEXT]

Speaks the protocol in the ports doc: POST /v1/completions (also /completions) with {"prompt": [ids] or
text, "max_tokens", ...} -> choices[0].{text, token_ids, logprobs.token_logprobs, finish_reason} and a
top-level "weight_version". `--answer correct` (default) decodes the prompt (needs `--tokenizer` when the
prompt is token ids), finds "What is A op B" and answers \\boxed{result}; anything else is answered with
`--fallback`. Any other `--answer` text is returned verbatim. A bare ASGI app (no framework) so that the
mock's own CPU use stays small next to the system under test.

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
import re
from pathlib import Path

ARITHMETIC = re.compile(r"What is (-?\d+) ([+\-*]) (-?\d+)")
CONTROL_ROUTES = ("/pause", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version", "/resume")


class MockLLM:
    def __init__(self, latency_s: float = 0.05, answer: str = "correct", fallback: str = "\\boxed{0}",
                 tokenizer: str | None = None, weight_version: int = 0):
        self.latency_s, self.answer, self.fallback = latency_s, answer, fallback
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

    def _reply(self, body: dict) -> dict:
        self.requests += 1
        text = self.reply_text(body.get("prompt", ""))
        full = self.encode(text)
        ids = full[: int(body.get("max_tokens") or len(full))]
        truncated = len(ids) < len(full)
        if truncated:
            text = self.tokenizer.decode(ids) if self.tokenizer is not None else "".join(map(chr, ids))
        return {
            "id": f"cmpl-{self.requests}", "object": "text_completion", "model": body.get("model", "mock"),
            "weight_version": self.weight_version,
            "choices": [{"index": 0, "text": text, "token_ids": ids, "finish_reason": "length" if truncated else "stop",
                         "logprobs": {"token_logprobs": [-0.05] * len(ids)}}],
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
    args = ap.parse_args()
    app = MockLLM(args.latency_ms / 1000, args.answer, args.fallback, args.tokenizer, args.weight_version)
    # uvloop + httptools: with uvicorn's pure-Python h11 the mock itself took a core at ~200 requests/s.
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False, loop="uvloop",
                http="httptools", backlog=4096, timeout_keep_alive=60)


if __name__ == "__main__":
    main()
