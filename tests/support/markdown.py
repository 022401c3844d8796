"""Markdown as the docs tests read it: fenced code blocks, and GitHub's heading anchors."""

from __future__ import annotations

import re

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def slugs(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered (code
    blocks left out)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", FENCE.sub("", text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out
