"""What the API signs, under keys the deployment makes once and keeps in Redis (`signing:<purpose>`), so every
API replica signs and checks alike:

- download URLs (get_external_weights_urls): a URL carries its expiry and an HMAC of its path and expiry, so
  whoever holds it downloads that file until then with no key, and nobody can make one for another file or a
  later time;
- JWTs (the Tinker SDK's `/auth/token` exchange): HS256, naming the flywheel token they stand for by its
  sha256, short-lived; the token behind one is checked again at each use, so revoking it ends its JWTs too."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
import uuid
from urllib.parse import urlencode

import jwt

from shared.platform.bus import SyncRedis

JWT_ISSUER = "flywheel"


def deployment_key(redis: SyncRedis, purpose: str) -> bytes:
    """The deployment's key for `purpose`: the first replica to ask makes it (SET NX), every later ask reads it."""
    name = f"signing:{purpose}"
    raw = redis.get(name)  # made already: one round trip (JWTs are checked on every request)
    if raw is None:
        redis.set(name, secrets.token_hex(32), nx=True)
        raw = redis.get(name)
    return bytes.fromhex(raw.decode() if isinstance(raw, bytes) else raw)


# -- signed download URLs ---------------------------------------------------------------------------------------
def signature(key: bytes, path: str, expires: int) -> str:
    return hmac.new(key, f"{path}\n{expires}".encode(), hashlib.sha256).hexdigest()


def sign(key: bytes, path: str, ttl_s: int, now: float | None = None) -> tuple[int, str]:
    """(expires, signature) of `path`, valid `ttl_s` seconds from now."""
    expires = int(now if now is not None else time.time()) + ttl_s
    return expires, signature(key, path, expires)


def signed_url(key: bytes, base_url: str, path: str, ttl_s: int) -> tuple[str, int]:
    """`base_url`/`path` signed for `ttl_s` seconds, and when it expires."""
    expires, sig = sign(key, path, ttl_s)
    return f"{base_url.rstrip('/')}/{path}?" + urlencode({"expires": expires, "signature": sig}), expires


def check(key: bytes, path: str, expires: int, given: str, now: float | None = None) -> str | None:
    """Why the signed URL is refused (None: it is good): a signature of another path or expiry, or past it."""
    if not hmac.compare_digest(signature(key, path, expires), given):
        return "the signature does not match this URL (it was altered, or signed by another deployment)"
    if (now if now is not None else time.time()) >= expires:
        return f"the signed URL expired at {expires} (unix time)"
    return None


# -- JWTs -------------------------------------------------------------------------------------------------------
def mint_jwt(key: bytes, owner: str, name: str, org: str, ttl_s: int, now: float | None = None) -> str:
    """A JWT for the flywheel token whose sha256 is `owner` (named `name`), valid `ttl_s` seconds. Its claims are
    those the Tinker SDK's `whoami` reads: `sub` (the user URN), `org_id`, `email` (empty: tokens have none)."""
    iat = int(now if now is not None else time.time())
    claims = {"iss": JWT_ISSUER, "sub": f"tml:user:{name}", "org_id": org, "email": "", "owner": owner,
              "iat": iat, "exp": iat + ttl_s, "jti": uuid.uuid4().hex}
    return jwt.encode(claims, key, algorithm="HS256")


def read_jwt(key: bytes, token: str) -> dict:
    """The claims of a JWT this deployment minted and that has not expired; ValueError saying why not."""
    try:
        return jwt.decode(token, key, algorithms=["HS256"], issuer=JWT_ISSUER,
                          options={"require": ["exp", "iat", "owner"]})
    except jwt.ExpiredSignatureError:
        raise ValueError("the JWT has expired: exchange the key for a new one (/api/v1/auth/token)") from None
    except jwt.InvalidTokenError as e:
        raise ValueError(f"the JWT is not one this server minted, or is malformed ({e})") from None
