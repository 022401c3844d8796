"""Tools the built-in tool-use envs offer: a sandboxed Python interpreter, BM25 search over a local corpus, and
`finish` (rLLM's: the call that ends the episode with a final answer, graded by the env).

A tool has a `name`, a JSON `schema` (OpenAI function format, what Qwen's chat template lists in <tools>) and
`__call__(**arguments) -> str` (the observation the agent sees). Tools never raise on bad arguments: the
error becomes the observation, so a model's malformed call costs it a turn, not the worker.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

from services.env_worker.sandbox import DEFAULT_MODE, SandboxLimits, run_python, sandbox_mode


class PythonTool:
    name = "python"
    schema = {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python 3 code in a sandbox and return its stdout (print what you need).",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        },
    }

    def __init__(self, limits: SandboxLimits | None = None, sandbox: str = DEFAULT_MODE, image: str | None = None):
        self.limits = limits or SandboxLimits(wall_s=5, cpu_s=5, memory_bytes=512 << 20)
        self.sandbox, self.image = sandbox_mode(sandbox), image
        if self.sandbox == "container" and not image:
            raise ValueError("the python tool with sandbox 'container' needs `image` (env.args.image)")

    def __call__(self, code: str = "", **_: Any) -> str:
        if not isinstance(code, str) or not code.strip():
            return "Error: the python tool needs a non-empty 'code' string argument"
        result = run_python(code, limits=self.limits, mode=self.sandbox, image=self.image)
        if result.ok:
            return result.stdout or "(no output; use print())"
        return f"Error: {result.error}\n{result.stdout}{result.stderr[-2000:]}".strip()


class FinishTool:
    """Ends the episode: ToolEnv grades `response` as the final answer instead of running anything."""

    name = "finish"
    schema = {
        "type": "function",
        "function": {
            "name": "finish",
            "description": "Submit your final answer and end the task. Put the answer in `response` the way the "
                           "task asks for it (e.g. \\boxed{...} for math).",
            "parameters": {"type": "object", "properties": {"response": {"type": "string"}},
                           "required": ["response"]},
        },
    }

    @staticmethod
    def final_response(arguments: Any) -> str:
        """The answer a finish call submits ("" when the call is malformed: graded as no answer)."""
        response = arguments.get("response") if isinstance(arguments, dict) else None
        return response if isinstance(response, str) else ""


_TOKEN = re.compile(r"\w+")


def tokenize(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


class Bm25Index:
    """BM25 (rank-bm25 Okapi) over a list of {"title"?, "text"} documents."""

    def __init__(self, docs: list[dict]):
        from rank_bm25 import BM25Okapi

        if not docs:
            raise ValueError("search corpus is empty: give documents as [{'title': ..., 'text': ...}, ...]")
        self.docs = docs
        self.bm25 = BM25Okapi([tokenize(f"{d.get('title', '')} {d['text']}") for d in docs])

    def search(self, query: str, k: int = 3) -> list[dict]:
        scores = self.bm25.get_scores(tokenize(query))
        best = sorted(range(len(self.docs)), key=lambda i: -scores[i])[:k]
        return [self.docs[i] for i in best if scores[i] > 0]


_index_cache: dict[str, Bm25Index] = {}
_index_lock = threading.Lock()


def load_corpus_index(path: str) -> Bm25Index:
    """Index a jsonl corpus file once per process (envs of many sessions share it)."""
    with _index_lock:
        if path not in _index_cache:
            lines = Path(path).read_text().splitlines()
            _index_cache[path] = Bm25Index([json.loads(line) for line in lines if line.strip()])
        return _index_cache[path]


class SearchTool:
    name = "search"
    schema = {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the local knowledge base; returns the best matching passages.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    }

    def __init__(self, index: Bm25Index, k: int = 3):
        self.index, self.k = index, k

    def __call__(self, query: str = "", **_: Any) -> str:
        if not isinstance(query, str) or not query.strip():
            return "Error: the search tool needs a non-empty 'query' string argument"
        hits = self.index.search(query, self.k)
        if not hits:
            return "No results."
        return "\n".join(f"[{i + 1}] {h.get('title', '')}: {h['text']}" for i, h in enumerate(hits))
