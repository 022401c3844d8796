"""Wire format: each stream entry has three fields, `t` (message type), `v` (schema version) and `d`
(msgpack of the model). Token ids and logprobs are packed binary arrays (`TokenIds`, `Logprobs`), never
per-token JSON. A new field must be optional so older readers and writers keep working; a breaking change
bumps `SCHEMA_VERSION` of that type, and readers reject versions they do not know (dead-lettered); a message
that uses nothing of a newer version is stamped with the older one (`Message.wire_version`).

Readers also refuse entries larger than a process-wide limit (`set_max_entry_bytes`, 16 MiB by default;
services take it from MAX_ENTRY_BYTES) before unpacking them, so one huge entry cannot multiply into
gigabytes of Python objects inside a worker."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import msgpack
import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, PlainSerializer, ValidationError


class MessageDecodeError(ValueError):
    """The entry is not a message this reader understands; the reason says why. Dead-letter it."""


def _ids_in(v: Any) -> list[int]:
    if isinstance(v, bytes | bytearray | memoryview):
        return np.frombuffer(v, dtype="<i4").tolist()
    return list(v)


def _floats_in(v: Any) -> list[float]:
    if isinstance(v, bytes | bytearray | memoryview):
        return np.frombuffer(v, dtype="<f4").tolist()
    return list(v)


def _ids_out(v: list[int]) -> bytes:
    return np.asarray(v, dtype="<i4").tobytes()


def _floats_out(v: list[float]) -> bytes:
    return np.asarray(v, dtype="<f4").tobytes()


# Lists in Python, little-endian int32 / float32 bytes on the wire.
TokenIds = Annotated[list[int], BeforeValidator(_ids_in), PlainSerializer(_ids_out, return_type=bytes)]
Logprobs = Annotated[list[float], BeforeValidator(_floats_in), PlainSerializer(_floats_out, return_type=bytes)]


class Message(BaseModel):
    """Base of every stream message. Subclasses set TYPE and SCHEMA_VERSION, and MIN_SCHEMA_VERSION when this
    reader still reads older versions (their fields a subset of this one's, read with the same meaning)."""

    model_config = ConfigDict(extra="ignore")  # newer writers may add optional fields
    TYPE: ClassVar[str] = ""
    SCHEMA_VERSION: ClassVar[int] = 1
    MIN_SCHEMA_VERSION: ClassVar[int | None] = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.TYPE:
            MESSAGE_TYPES[cls.TYPE] = cls

    def wire_version(self) -> int:
        """The version this message is stamped with: the oldest whose readers read everything it carries
        (SCHEMA_VERSION, unless the type says which versions its newer fields came with). So a reader not yet
        upgraded still reads what needs nothing new, and refuses what does: a rolling upgrade loses nothing."""
        return self.SCHEMA_VERSION


MESSAGE_TYPES: dict[str, type[Message]] = {}

DEFAULT_MAX_ENTRY_BYTES = 16 * 1024 * 1024
_max_entry_bytes = DEFAULT_MAX_ENTRY_BYTES


def set_max_entry_bytes(limit: int) -> None:
    """Largest entry `decode` accepts in this process, bytes (all field values together)."""
    global _max_entry_bytes
    if limit < 1:
        raise ValueError(f"max entry size must be a positive number of bytes, got {limit}")
    _max_entry_bytes = limit


def entry_bytes(fields: dict) -> int:
    return sum(len(v) for v in fields.values() if isinstance(v, bytes | bytearray | memoryview | str))


def encode(msg: Message) -> dict[bytes, bytes]:
    body = msgpack.packb(msg.model_dump(mode="python"), use_bin_type=True)
    return {b"t": msg.TYPE.encode(), b"v": str(msg.wire_version()).encode(), b"d": body}


def decode(fields: dict[bytes, bytes], expect: type[Message] | None = None) -> Message:
    size = entry_bytes(fields)
    if size > _max_entry_bytes:
        raise MessageDecodeError(
            f"entry of {size} bytes exceeds the {_max_entry_bytes}-byte limit (MAX_ENTRY_BYTES; raise it if "
            "messages this large are legitimate)"
        )
    try:
        mtype = fields[b"t"].decode()
        version = int(fields[b"v"])
        body = fields[b"d"]
    except (KeyError, ValueError, UnicodeDecodeError, AttributeError) as e:
        raise MessageDecodeError(f"entry lacks the t/v/d fields of a message: {e!r}") from e
    cls = MESSAGE_TYPES.get(mtype)
    if cls is None:
        raise MessageDecodeError(f"unknown message type {mtype!r}")
    if expect is not None and cls is not expect:
        raise MessageDecodeError(f"expected {expect.TYPE!r} on this stream, got {mtype!r}")
    if not (cls.MIN_SCHEMA_VERSION or cls.SCHEMA_VERSION) <= version <= cls.SCHEMA_VERSION:
        raise MessageDecodeError(f"{mtype} schema version {version} unsupported (reader has {cls.SCHEMA_VERSION})")
    try:
        data = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types for corrupt input
        raise MessageDecodeError(f"body is not valid msgpack: {e!r}") from e
    if not isinstance(data, dict):
        raise MessageDecodeError(f"body must be a map, got {type(data).__name__}")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise MessageDecodeError(f"{mtype} failed validation: {e}") from e
