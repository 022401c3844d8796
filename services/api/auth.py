"""Bearer-token auth. A token is API_TOKEN (every scope) or a row of `api_tokens` (sha256 of the token, scopes).

Scopes nest: admin > write > read. The scope a route needs follows from its method (GET/HEAD: read, others:
write) unless its endpoint is marked with `@needs(scope)`; so a new route is protected without anyone
remembering to."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import select

from services.api.errors import ApiError
from shared.contracts.db.models import ApiToken

SCOPES = ("read", "write", "admin")
_RANK = {s: i for i, s in enumerate(SCOPES)}


def needs(scope: str):
    """Mark an endpoint whose scope its method does not tell (a read-only POST, admin routes)."""
    assert scope in SCOPES

    def mark(endpoint):
        endpoint.required_scope = scope
        return endpoint

    return mark


@dataclass(frozen=True)
class Principal:
    name: str
    scopes: frozenset[str]

    def can(self, scope: str) -> bool:
        return any(_RANK[s] >= _RANK[scope] for s in self.scopes if s in _RANK)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return "fw_" + secrets.token_urlsafe(32)


def required_scope(request: Request) -> str:
    marked = getattr(request.scope.get("endpoint"), "required_scope", None)
    if marked:
        return marked
    return "read" if request.method in ("GET", "HEAD", "OPTIONS") else "write"


# Declares the bearer scheme in the OpenAPI (so tools can test auth); errors are ours, in the one error shape.
BEARER = HTTPBearer(auto_error=False, description="API_TOKEN, or a token made with POST /v1/tokens")
CHALLENGE = {"WWW-Authenticate": "Bearer"}


def _bearer(credentials: HTTPAuthorizationCredentials | None) -> str:
    if credentials is None or not credentials.credentials.strip():
        raise ApiError(401, "missing bearer token", hint="send 'Authorization: Bearer <token>' (the dashboard: "
                       "enter the token top right, or open /ui/?token=<token>)", headers=CHALLENGE)
    return credentials.credentials.strip()


def principal_for(request: Request, token: str) -> Principal | None:
    return principal_of_hash(request, hash_token(token))


def principal_of_hash(request: Request, token_sha256: str) -> Principal | None:
    """Whose token has this sha256 (None: no live token has): API_TOKEN, or a row not revoked."""
    admin_token = request.app.state.config.api_token
    if admin_token and hmac.compare_digest(token_sha256.encode(), hash_token(admin_token).encode()):
        return Principal("API_TOKEN", frozenset({"admin"}))
    with request.app.state.sessions() as s:
        row = s.execute(
            select(ApiToken.name, ApiToken.scopes)
            .where(ApiToken.token_sha256 == token_sha256, ApiToken.revoked_at.is_(None))
        ).first()
    return Principal(row.name, frozenset(row.scopes)) if row else None


def authorize(request: Request,
              credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)]) -> Principal:
    """Router dependency of every /v1 route: 401 without a valid token, 403 without the route's scope."""
    principal = principal_for(request, _bearer(credentials))
    if principal is None:
        raise ApiError(401, "invalid or revoked token", hint="check FLYWHEEL_TOKEN / API_TOKEN", headers=CHALLENGE)
    scope = required_scope(request)
    if not principal.can(scope):
        raise ApiError(403, f"token {principal.name!r} lacks the {scope!r} scope this route needs",
                       hint="create a token with that scope: `flywheel tokens create NAME --scope SCOPE`")
    return principal
