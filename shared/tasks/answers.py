"""Where a response holds its answer: after `</think>`, inside the last \\boxed{...}. The built-in agents read it
to decide when they are done; the rewards grade it."""

from __future__ import annotations

THINK_END = "</think>"


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start)
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def final_answer_text(response: str) -> str | None:
    """The part of a response that may hold the answer: after </think> when thinking was used.

    An unterminated <think> block has no answer (the model never finished thinking)."""
    if THINK_END in response:
        return response.rsplit(THINK_END, 1)[1]
    if "<think>" in response:
        return None
    return response
