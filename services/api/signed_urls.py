"""Signed download URLs (the Tinker SDK's get_external_weights_urls): a URL carries its expiry and an HMAC of
its path and expiry, so whoever holds it downloads that file until then with no key, and nobody can make one
for another file or a later time. The signing key is made once per deployment and kept in Redis
(`signing:url_key`), so every API replica signs and checks alike."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

from shared.platform.bus import SyncRedis

KEY = "signing:url_key"


def signing_key(redis: SyncRedis) -> bytes:
    """The deployment's key: the first replica to ask makes it (SET NX), every later ask reads it."""
    redis.set(KEY, secrets.token_hex(32), nx=True)
    raw = redis.get(KEY)
    return bytes.fromhex(raw.decode() if isinstance(raw, bytes) else raw)


def signature(key: bytes, path: str, expires: int) -> str:
    return hmac.new(key, f"{path}\n{expires}".encode(), hashlib.sha256).hexdigest()


def sign(key: bytes, path: str, ttl_s: int, now: float | None = None) -> tuple[int, str]:
    """(expires, signature) of `path`, valid `ttl_s` seconds from now."""
    expires = int(now if now is not None else time.time()) + ttl_s
    return expires, signature(key, path, expires)


def check(key: bytes, path: str, expires: int, given: str, now: float | None = None) -> str | None:
    """Why the signed URL is refused (None: it is good): a signature of another path or expiry, or past it."""
    if not hmac.compare_digest(signature(key, path, expires), given):
        return "the signature does not match this URL (it was altered, or signed by another deployment)"
    if (now if now is not None else time.time()) >= expires:
        return f"the signed URL expired at {expires} (unix time)"
    return None
