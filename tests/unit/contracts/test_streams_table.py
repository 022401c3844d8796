"""The stream table in shared/streams.py names every stream the module defines, and README.md carries the same
table (producer, consumer group, message type, when acknowledged)."""

from __future__ import annotations

from pathlib import Path

from shared import streams

REPO = Path(__file__).resolve().parents[3]


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
    readme = table_rows((REPO / "README.md").read_text())
    assert [r for r in readme if r.split("`")[1] in named] == rows
