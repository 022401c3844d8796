"""The streams and keys tables (shared/contracts/streams.py: STREAM_TABLE, KEY_TABLE) name every stream the module
defines and every key it builds, and docs/architecture.md holds exactly what `python -m shared.contracts.streams`
prints: the tables have one source."""

from __future__ import annotations

import inspect
from pathlib import Path

from shared.contracts import streams

REPO = Path(__file__).resolve().parents[2]
MARK, END = "<!-- streams table: python -m shared.contracts.streams -->\n", "<!-- end streams table -->"


def test_every_stream_is_in_the_table():
    named = {row.stream for row in streams.STREAM_TABLE}
    constants = {v for k, v in vars(streams).items() if k.isupper() and isinstance(v, str) and "*" not in v
                 and not k.startswith("GROUP_") and k != "OTHER_KEYS"}
    assert constants <= named, f"streams without a row in the table: {constants - named}"
    for fn in (streams.env_inbox, streams.env_replies, streams.command_reply, streams.job_reply):
        assert any(n.startswith(fn("").rstrip(".")) for n in named)
    assert all(row.pattern.split(" ")[0] in {"work", "request/reply", "command", "broadcast"}
               for row in streams.STREAM_TABLE)


def test_every_key_the_module_builds_is_in_the_key_table():
    named = {row.key for row in streams.KEY_TABLE}
    # every `*_key` function, called with placeholders named after its parameters (worker_id -> <worker id>)
    built = {fn(*(f"<{p.replace('_', ' ')}>" for p in inspect.signature(fn).parameters))
             for name, fn in vars(streams).items() if name.endswith("_key") and callable(fn)}
    assert len(built) >= 4
    assert built <= named, f"keys without a row in the table: {built - named}"
    assert streams.heartbeat_pattern("env-worker") == "heartbeat:env-worker:*"


def test_the_architecture_doc_holds_the_generated_tables():
    doc = (REPO / "docs/architecture.md").read_text()
    assert MARK in doc and END in doc, "docs/architecture.md lost its generated streams table markers"
    held = doc.split(MARK, 1)[1].split(END, 1)[0]
    assert held == streams.markdown(), ("docs/architecture.md's streams table differs from shared/contracts/"
                                        "streams.py: paste the output of `python -m shared.contracts.streams`")
    assert "| `run.control` | broadcast (controllers), work queue (trainer) |" in held
