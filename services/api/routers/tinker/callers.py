"""Who calls: the SDK's `X-API-Key: tml-<flywheel token>` (or the JWT it exchanged that key for) checked into a Caller (the `Key` dependency), the
caller's Tinker store, the `Wire` base of every request body, and the look-ups of the caller's sessions and models
that every part of the protocol makes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict

from services.api import signing
from services.api.auth import Principal, hash_token, principal_of_hash, required_scope
from services.api.errors import ApiError
from services.api.tinker_store import TinkerStore

KEY_PREFIX = "tml-"
KEY_HINT = "send 'X-API-Key: tml-<flywheel token>' (TINKER_API_KEY=tml-$API_TOKEN, or tml- + a token of `flywheel tokens create`)"


@dataclass(frozen=True)
class Caller:
    principal: Principal
    owner: str  # sha256 of the flywheel token: what the caller's sessions, models and futures are filed under


JWT_PREFIX = "eyJ"  # a JWT's header, base64url of '{"': what the SDK takes for one
# RFC 6750: a JWT refused for itself (expired, not ours, its token revoked); the SDK exchanges its key for a new
# JWT and replays the request once
INVALID_JWT = {"WWW-Authenticate": 'Bearer error="invalid_token"'}


def tinker_caller(request: Request) -> Caller:
    key = (request.headers.get("x-api-key") or "").strip()
    if not key:
        raise ApiError(401, "missing X-API-Key", hint=KEY_HINT)
    if key.startswith(JWT_PREFIX):
        try:
            owner = signing.read_jwt(jwt_key(request), key)["owner"]
        except ValueError as e:
            raise ApiError(401, str(e), hint=KEY_HINT, headers=INVALID_JWT) from None
        principal = principal_of_hash(request, owner)
        if principal is None:
            raise ApiError(401, "the token this JWT stands for is revoked", hint=KEY_HINT, headers=INVALID_JWT)
    elif key.startswith(KEY_PREFIX):
        owner = hash_token(key.removeprefix(KEY_PREFIX))
        principal = principal_of_hash(request, owner)
        if principal is None:
            raise ApiError(401, "invalid or revoked key", hint=KEY_HINT)
    else:
        raise ApiError(401, "this server takes Tinker keys of the form tml-<flywheel token>, or the JWTs it "
                       "exchanges them for", hint=KEY_HINT)
    scope = required_scope(request)
    if not principal.can(scope):
        raise ApiError(403, f"token {principal.name!r} lacks the {scope!r} scope this operation needs",
                       hint="create a token with that scope: `flywheel tokens create NAME --scope SCOPE`")
    return Caller(principal, owner)


def jwt_key(request: Request) -> bytes:
    return signing.deployment_key(request.app.state.redis, "jwt_key")


def url_key(request: Request) -> bytes:
    return signing.deployment_key(request.app.state.redis, "url_key")


async def check_signed_url(request: Request, path: str, expires: int, signature: str, hint: str) -> None:
    """A download by signed URL (no key: the URL is the credential): 403 when it is not this path's or expired."""
    why = await run_in_threadpool(lambda: signing.check(url_key(request), path, expires, signature))
    if why:
        raise ApiError(403, f"download refused: {why}", hint=hint)


Key = Annotated[Caller, Depends(tinker_caller)]


def store(request: Request) -> TinkerStore:
    return TinkerStore(request.app.state.redis)


class Wire(BaseModel):
    """A request body as the SDK sends it: fields this server does not use (`type`, newer ones) are ignored."""
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


def owned_session(request: Request, caller: Caller, session_id: str, field: str) -> dict:
    record = store(request).session(caller.owner, session_id)
    if record is None:
        raise ApiError(404, f"session {session_id} does not exist", field=field,
                       hint="create one with POST /api/v1/create_session (the SDK's ServiceClient does)")
    return record


def owned_model(request: Request, caller: Caller, model_id: str, field: str = "model_id", *,
                training: bool = True) -> dict:
    """The key's model; with `training`, one that can be trained on (not the holder of a copy_weights copy)."""
    model = store(request).model(caller.owner, model_id)
    if model is None or (model.get("run_id") is None and model.get("copy_of") is None):
        raise ApiError(404, f"model {model_id} does not exist", field=field,
                       hint="create one with create_lora_training_client (POST /api/v1/create_model)")
    if training and model.get("copy_of"):
        raise ApiError(400, f"model {model_id} holds a copy of {model['copy_of']} and cannot be trained on",
                       field=field, hint="train a model made from the copy: create_training_client_from_state")
    return model
