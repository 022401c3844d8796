"""The child process of a managed agent program (see agent_program.py). Not for direct use.

Reads {"program", "args", "task", "base_url", "result_path"} as JSON on stdin, calls the program with the
task, writes {"reward", "info", ...} to result_path. OPENAI_BASE_URL / OPENAI_API_KEY point at the session's
gateway, so `openai.AsyncOpenAI()` with no arguments talks to the policy. The program may take `client` (an
AsyncOpenAI for the session) and/or `base_url` keyword arguments; the run config's `agent_program.args` are
passed as further keyword arguments.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import sys


def normalize(value) -> dict:
    """A reward, or a dict with `reward` (and optional `info`, `is_correct`, `rewards` per agent name)."""
    if isinstance(value, bool | int | float):
        out = {"reward": float(value)}
    elif isinstance(value, dict) and isinstance(value.get("reward"), bool | int | float):
        out = {"reward": float(value["reward"]), "info": dict(value.get("info") or {})}
        if "is_correct" in value:
            out["is_correct"] = bool(value["is_correct"])
        if isinstance(value.get("rewards"), dict):
            out["rewards"] = {str(k): float(v) for k, v in value["rewards"].items()}
    else:
        raise TypeError(f"the agent program returned {type(value).__name__}; return a number (the reward) or a "
                        "dict {'reward': float, 'info': {...}}")
    if not math.isfinite(out["reward"]):
        raise ValueError(f"the agent program returned a non-finite reward {out['reward']}")
    json.dumps(out)  # info must be JSON: fail here, with the traceback, not in the worker
    return out


def limit_self(limits: dict) -> None:
    """Before any user code: address space and CPU seconds (hard limits: the program cannot raise them)."""
    import resource

    if limits.get("memory_bytes"):
        resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"], limits["memory_bytes"]))
    if limits.get("cpu_s"):
        resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 5))


async def main() -> int:
    spec = json.loads(sys.stdin.read())
    limit_self(spec.get("limits") or {})
    from shared.contracts.registry import resolve

    fn = resolve("agent_program", spec["program"])
    params = inspect.signature(fn).parameters
    kwargs = dict(spec.get("args") or {})
    client = None
    if "client" in params:
        import openai

        client = openai.AsyncOpenAI(base_url=spec["base_url"], api_key="flywheel", max_retries=0)
        kwargs["client"] = client
    if "base_url" in params:
        kwargs["base_url"] = spec["base_url"]
    value = fn(dict(spec["task"]), **kwargs)
    if inspect.isawaitable(value):
        value = await value
    result = normalize(value)
    if client is not None:
        await client.close()
    with open(spec["result_path"], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
