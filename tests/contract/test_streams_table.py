"""The stream table in shared/streams.py names every stream the module defines, its key table every plain key
the module builds, and README.md carries the same tables (producer, consumer group, message type, when
acknowledged; writer, reader, what)."""

from __future__ import annotations

import inspect
from pathlib import Path

from shared import streams

REPO = Path(__file__).resolve().parents[2]


def table_rows(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip().startswith("| `")]


def test_every_stream_is_in_the_table_and_the_readme_has_the_same_table():
    rows = table_rows(streams.__doc__)
    named = {row.split("`")[1] for row in rows}
    constants = {v for k, v in vars(streams).items() if k.isupper() and isinstance(v, str) and "*" not in v
                 and not k.startswith("GROUP_")}
    assert constants <= named, f"streams without a row in the table: {constants - named}"
    for fn in (streams.env_inbox, streams.env_replies):
        assert any(n.startswith(fn("").rstrip(".")) for n in named)
    # the Streams section only: the "Who owns what" table after it has a `trajectories` row of its own (the table)
    readme = table_rows((REPO / "README.md").read_text().split("### Streams", 1)[1].split("### Who owns what", 1)[0])
    assert [r for r in readme if r.split("`")[1] in named] == rows


def test_every_key_the_module_builds_is_in_the_key_table():
    named = {row.split("`")[1] for row in table_rows(streams.__doc__)}
    # every `*_key` function, called with placeholders named after its parameters (worker_id -> <worker id>)
    built = {fn(*(f"<{p.replace('_', ' ')}>" for p in inspect.signature(fn).parameters))
             for name, fn in vars(streams).items() if name.endswith("_key") and callable(fn)}
    assert len(built) >= 4
    assert built <= named, f"keys without a row in the table: {built - named}"
    assert streams.heartbeat_pattern("env-worker") == "heartbeat:env-worker:*"
