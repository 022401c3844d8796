"""API tokens (admin scope): create (the plain token is shown once; only its sha256 is stored), list, revoke."""

from __future__ import annotations

import uuid
from typing import Annotated, Literal

from fastapi import APIRouter
from pydantic import Field
from sqlalchemy import func, select, update

from services.api.auth import hash_token, needs, new_token
from services.api.deps import DB
from services.api.errors import ApiError, StrictBody, errors
from services.api.schemas import Page, TokenCreated, TokenPublic
from shared.contracts.db.models import ApiToken

router = APIRouter(prefix="/tokens", tags=["tokens"])


class TokenRequest(StrictBody):
    name: Annotated[str, Field(min_length=1, max_length=200)]
    scopes: Annotated[list[Literal["read", "write", "admin"]], Field(min_length=1, max_length=3)] = ["read"]


def token_out(t: ApiToken) -> dict:
    return {"id": t.id, "name": t.name, "scopes": list(t.scopes), "created_at": t.created_at,
            "revoked_at": t.revoked_at}


@router.post("", status_code=201, response_model=TokenCreated, responses=errors(400, 422))
@needs("admin")
def create_token(body: TokenRequest, session: DB) -> dict:
    token = new_token()
    row = ApiToken(name=body.name, token_sha256=hash_token(token), scopes=sorted(set(body.scopes)))
    session.add(row)
    session.commit()
    return token_out(row) | {"token": token}


@router.get("", response_model=Page[TokenPublic])
@needs("admin")
def list_tokens(session: DB) -> dict:
    items = [token_out(t) for t in session.execute(select(ApiToken).order_by(ApiToken.created_at)).scalars()]
    return {"data": items, "count": len(items)}


@router.delete("/{token_id}", response_model=TokenPublic, responses=errors(404, 422))
@needs("admin")
def revoke_token(token_id: uuid.UUID, session: DB) -> dict:
    row = session.execute(
        update(ApiToken).where(ApiToken.id == token_id).values(revoked_at=func.coalesce(ApiToken.revoked_at, func.now()))
        .returning(ApiToken.id)
    ).first()
    if row is None:
        raise ApiError(404, f"token {token_id} does not exist", field="token_id")
    session.commit()
    return token_out(session.get(ApiToken, token_id))
