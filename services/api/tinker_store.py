"""The Tinker protocol's state, in Redis, every record tagged with the key (owner) that made it: sessions (with
the runs, models and samplers made in each), training models and futures. An owner is the sha256 of the flywheel token behind the `tml-` key, so a record
is found only by the key that made it; another key's record reads as absent (404), never as forbidden. The one
exception: a checkpoint its owner published (`tinker:published:<path>`) reads for every key.
A future of work done here (create_model) is resolved at once; one of the trainer's (`tinker.requests`) holds
`try_again` until the trainer writes its result. Futures are kept a day.
More: docs/tinker.md"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from shared.contracts.messages import TinkerCheckpoint, TinkerFuture
from shared.contracts.streams import tinker_key
from shared.contracts.tinker_run import FUTURE_TTL_S, MODEL_TTL_S, checkpoint_path
from shared.platform.bus import SyncRedis

TRACE_MAXLEN = 100_000  # the requests a session's trace keeps (the newest)
AUDIT_MAXLEN = 100_000  # the events an owner's audit log keeps (the newest)


class TinkerStore:
    def __init__(self, redis: SyncRedis):
        self.redis = redis

    def _put(self, kind: str, key: str, record: dict[str, Any], ttl_s: int) -> None:
        self.redis.set(tinker_key(kind, key), json.dumps(record), ex=ttl_s)

    def _get(self, kind: str, key: str, owner: str) -> dict[str, Any] | None:
        raw = self.redis.get(tinker_key(kind, key))
        record = json.loads(raw) if raw else None
        return record if record is not None and record.get("owner") == owner else None

    def create_session(self, owner: str, tags: list[str], metadata: dict[str, Any], **labels: str | None) -> str:
        """`labels`: what the session is shown and searched by (owner_name, display_name, project_id)."""
        session_id, now = str(uuid.uuid4()), time.time()
        self._put("session", session_id, {"owner": owner, "tags": tags, "user_metadata": metadata,
                                          "created_at": now, "finished": None, **labels}, MODEL_TTL_S)
        index = tinker_key("owner_sessions", owner)  # the owner's sessions by creation time, for list_sessions
        self.redis.pipeline().zadd(index, {session_id: now}).expire(index, MODEL_TTL_S).execute()
        return session_id

    def sessions(self, owner: str, offset: int, limit: int | None) -> list[str]:
        """The owner's sessions that still exist, newest first; expired ones leave the index as they are met."""
        index = tinker_key("owner_sessions", owner)
        ids = [i.decode() if isinstance(i, bytes) else i for i in self.redis.zrevrange(index, 0, -1)]
        pipe = self.redis.pipeline()
        for session_id in ids:
            pipe.exists(tinker_key("session", session_id))
        live = [i for i, exists in zip(ids, pipe.execute(), strict=True) if exists]
        if len(live) < len(ids):
            self.redis.zrem(index, *(set(ids) - set(live)))
        return live[offset:None if limit is None else offset + limit]

    def session_records(self, owner: str) -> list[tuple[str, dict[str, Any]]]:
        """The owner's live sessions with their records, newest first."""
        ids = self.sessions(owner, 0, None)
        raws = self.redis.mget([tinker_key("session", i) for i in ids]) if ids else []
        return [(i, json.loads(raw)) for i, raw in zip(ids, raws, strict=True) if raw]

    def session(self, owner: str, session_id: str) -> dict[str, Any] | None:
        return self._get("session", session_id, owner)

    def touch_session(self, session_id: str) -> None:
        self.redis.expire(tinker_key("session", session_id), MODEL_TTL_S)

    def finish_session(self, owner: str, session_id: str, reason: str, detail: str | None) -> None:
        record = self.session(owner, session_id)
        if record is not None and record["finished"] is None:  # first reason wins, as the SDK documents
            record["finished"] = {"reason": reason, "detail": detail, "at": time.time()}
            self._put("session", session_id, record, MODEL_TTL_S)

    def set_session_project(self, owner: str, session_id: str, project_id: str) -> None:
        """The session's project, set in one transaction (a finish meanwhile is not undone)."""
        self._update_owned(tinker_key("session", session_id), owner, {"project_id": project_id})

    def audit(self, owners: set[str], event: str, details: dict[str, Any]) -> None:
        """Record `event` in the audit log of each owner (`tinker:audit:<owner>`, a stream: its entry ids are the
        events' times in ms, so a day is an XRANGE)."""
        pipe = self.redis.pipeline(transaction=False)
        for owner in owners:
            pipe.xadd(tinker_key("audit", owner), {"event": event, "details": json.dumps(details)},
                      maxlen=AUDIT_MAXLEN, approximate=True)
        pipe.execute()

    def audit_log(self, owner: str, start_ms: int, end_ms: int) -> list[tuple[int, str, dict[str, Any]]]:
        """The owner's events from `start_ms` up to (not including) `end_ms`: (time in ms, event, details)."""
        rows = self.redis.xrange(tinker_key("audit", owner), str(start_ms), str(end_ms - 1))
        return [(int(entry_id.split(b"-")[0]), fields[b"event"].decode(), json.loads(fields[b"details"]))
                for entry_id, fields in rows]

    def _update_owned(self, key: str, owner: str, fields: dict[str, Any]) -> None:
        """Set `fields` of the owner's record at `key` (its TTL kept), in one transaction."""
        self._owned_transaction(key, owner, lambda pipe, record: pipe.set(key, json.dumps(record | fields),
                                                                          keepttl=True))

    def _owned_transaction(self, key: str, owner: str, write: Callable[[Any, dict[str, Any]], Any]
                           ) -> dict[str, Any] | None:
        """The owner's record at `key` as read (None: absent or another's), and `write(pipe, record)` queued on
        it, in one transaction: a record changed meanwhile is read again, one removed meanwhile is not written
        back."""

        def transact(pipe) -> dict[str, Any] | None:
            raw = pipe.get(key)
            record = json.loads(raw) if raw else None
            pipe.multi()
            if record is None or record.get("owner") != owner:
                return None
            write(pipe, record)
            return record

        return self.redis.transaction(transact, key, value_from_callable=True)

    def file_under_session(self, session_id: str, kind: str, member: str) -> None:
        """`member` (a run, model or sampler id) in the session's set of `kind` ("runs", "models", "samplers"):
        a set beside the session record, so that concurrent creates never drop each other's."""
        key = tinker_key(f"session_{kind}", session_id)
        self.redis.pipeline().sadd(key, member).expire(key, MODEL_TTL_S).execute()

    def session_members(self, session_id: str, kind: str) -> list[str]:
        return sorted(r.decode() if isinstance(r, bytes) else r
                      for r in self.redis.smembers(tinker_key(f"session_{kind}", session_id)))

    def put_model(self, owner: str, model_id: str, record: dict[str, Any], *, only_new: bool = False) -> bool:
        """False when `only_new` and the model exists (SET NX: two creates of one id cannot both win)."""
        return bool(self.redis.set(tinker_key("model", model_id), json.dumps({"owner": owner, **record}),
                                   ex=MODEL_TTL_S, nx=only_new))

    def drop_model(self, model_id: str) -> None:
        self.redis.delete(tinker_key("model", model_id))

    def model(self, owner: str, model_id: str) -> dict[str, Any] | None:
        return self._get("model", model_id, owner)

    def complete(self, owner: str, result: dict[str, Any], model_id: str | None = None) -> str:
        """A future resolved to `result` (work done here, such as create_model); its request id."""
        request_id = str(uuid.uuid4())
        record = TinkerFuture(owner=owner, model_id=model_id, result=result, answered_at=time.time())
        self._put("future", request_id, record.model_dump(), FUTURE_TTL_S)
        return request_id

    def traced(self, session_id: str) -> list[tuple[dict[str, str], dict[str, Any] | None]]:
        """The session's traced requests, oldest first, each with its future's record (None once expired)."""
        starts = [{k.decode() if isinstance(k, bytes) else k: v.decode() if isinstance(v, bytes) else v
                   for k, v in fields.items()} for _, fields in self.redis.xrange(tinker_key("trace", session_id))]
        raws = self.redis.mget([tinker_key("future", s["request_id"]) for s in starts]) if starts else []
        return [(s, json.loads(raw) if raw else None) for s, raw in zip(starts, raws, strict=True)]

    def pending(self, owner: str, model_id: str | None, session_id: str, name: str, target: str) -> str:
        """A future of work sent to a trainer or a rollout worker: `try_again` until the result is written. With
        it, in one round trip, the request's start on its session's trace (`tinker:trace:<session>`, a stream
        bounded to TRACE_MAXLEN): what export_session_trace draws, each request's end read from its future."""
        request_id, now = str(uuid.uuid4()), time.time()
        record = TinkerFuture(owner=owner, model_id=model_id,
                              result={"type": "try_again", "request_id": request_id, "queue_state": "active"})
        trace, pipe = tinker_key("trace", session_id), self.redis.pipeline()
        pipe.set(tinker_key("future", request_id), record.model_dump_json(), ex=FUTURE_TTL_S)
        pipe.xadd(trace, {"request_id": request_id, "name": name, "target": target, "t": repr(now)},
                  maxlen=TRACE_MAXLEN, approximate=True)
        pipe.expire(trace, MODEL_TTL_S)
        pipe.execute()
        return request_id

    def put_sampler(self, owner: str, sampler_id: str, session_id: str, record: dict[str, Any]) -> None:
        """A sampling session: the run whose engine serves it, the weight version, the base model's name."""
        self._put("sampler", sampler_id, {"owner": owner, "session_id": session_id, **record}, MODEL_TTL_S)
        self.file_under_session(session_id, "samplers", sampler_id)

    def sampler(self, owner: str, sampler_id: str) -> dict[str, Any] | None:
        return self._get("sampler", sampler_id, owner)

    def join_sampler(self, sampler_id: str) -> int:
        """A new client of the sampling session (a SamplingClient unpickled elsewhere): its number, 1, 2, ...
        (the session's first client is 0), unique among the session's clients."""
        key = tinker_key("sampler_clients", sampler_id)
        counter, _ = self.redis.pipeline().incr(key).expire(key, MODEL_TTL_S).execute()
        return int(counter)

    def checkpoint(self, owner: str, path: str) -> dict[str, Any] | None:
        """A checkpoint the trainer recorded (TinkerCheckpoint), if this owner made it and it has not expired."""
        record = self._get("checkpoint", path, owner)
        return record if record is not None and _live(record, time.time()) else None

    def readable_checkpoint(self, owner: str, path: str) -> dict[str, Any] | None:
        """A live checkpoint this owner made, or one its maker published (any key may load or sample it)."""
        raw = self.redis.get(tinker_key("checkpoint", path))
        record = json.loads(raw) if raw else None
        if record is None or not _live(record, time.time()):
            return None
        return record if record.get("owner") == owner or path in self.published([path]) else None

    def publish(self, path: str, public: bool) -> None:
        """Mark the checkpoint public (`tinker:published:<path>`, read by the trainer's load) or private again;
        the caller checks it is the owner's."""
        key = tinker_key("published", path)
        if public:
            self.redis.set(key, "1")
        else:
            self.redis.delete(key)

    def put_copy(self, owner: str, source: dict[str, Any], model_id: str, expires_at: float | None) -> str:
        """A copy of checkpoint record `source` as `owner`'s, under model `model_id`: the same weights (version
        on the weight server), created now; its path."""
        copy = TinkerCheckpoint.model_validate(source | {"owner": owner, "model_id": model_id,
                                                         "created_at": time.time(), "expires_at": expires_at})
        path = checkpoint_path(model_id, copy.kind, copy.name)
        self.redis.set(tinker_key("checkpoint", path), copy.model_dump_json())
        return path

    def remember_copy(self, owner: str, idempotency_key: str, path: str, ttl_s: int) -> None:
        self.redis.set(tinker_key("copy", f"{owner}:{idempotency_key}"), path, ex=ttl_s)

    def copy_made(self, owner: str, idempotency_key: str) -> str | None:
        raw = self.redis.get(tinker_key("copy", f"{owner}:{idempotency_key}"))
        return raw.decode() if isinstance(raw, bytes) else raw

    def published(self, paths: list[str]) -> set[str]:
        pipe = self.redis.pipeline()
        for path in paths:
            pipe.exists(tinker_key("published", path))
        return {path for path, public in zip(paths, pipe.execute(), strict=True) if public}

    def expire_checkpoint(self, owner: str, path: str, expires_at: float | None) -> None:
        """Set when the checkpoint expires (now: deleted; None: never). Read and rewritten in one transaction: a
        record the trainer removes meanwhile is not written back."""
        self._update_owned(tinker_key("checkpoint", path), owner, {"expires_at": expires_at})

    def checkpoints(self, owner: str, model_id: str | None = None, *, expired: bool = False) -> list[dict[str, Any]]:
        """The owner's checkpoints (of one model, or all), oldest first; with `expired`, those deleted or past
        their ttl that the trainer has not removed yet too."""
        prefix = f"tinker://{model_id}/" if model_id else "tinker://"
        records, now = [], time.time()
        for key in self.redis.scan_iter(match=tinker_key("checkpoint", prefix) + "*", count=500):
            raw = self.redis.get(key)
            record = json.loads(raw) if raw else None
            if record is not None and record.get("owner") == owner and (expired or _live(record, now)):
                records.append(record)
        return sorted(records, key=lambda r: r["created_at"])

    def future(self, owner: str, request_id: str) -> dict[str, Any] | None:
        return self._get("future", request_id, owner)

    def cancel_sample(self, owner: str, request_id: str, answer: dict[str, Any]) -> dict[str, Any] | None:
        """The owner's future as it was read (None: absent or another's). Were it a sample not answered yet, it
        now answers `answer` and is marked `tinker:cancelled:<id>` for the rollout worker, in one transaction:
        a worker's answer written meanwhile is kept."""
        key = tinker_key("future", request_id)

        def cancel(pipe, record: dict[str, Any]) -> None:
            if record["model_id"] is None and record["result"].get("type") == "try_again":
                pipe.set(key, json.dumps(record | {"result": answer}), ex=FUTURE_TTL_S)
                pipe.set(tinker_key("cancelled", request_id), "1", ex=FUTURE_TTL_S)

        return self._owned_transaction(key, owner, cancel)


def _live(checkpoint: dict[str, Any], now: float) -> bool:
    return TinkerCheckpoint.model_validate(checkpoint).live(now)
