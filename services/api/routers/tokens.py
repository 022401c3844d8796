"""API tokens (admin scope): create (the plain token is shown once; only its sha256 is stored), list, revoke."""

from __future__ import annotations

import uuid
from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, Field
from sqlalchemy import func, select, update

from services.api.auth import hash_token, needs, new_token
from services.api.deps import DB
from shared.db.models import ApiToken

router = APIRouter(prefix="/tokens", tags=["tokens"])


class TokenRequest(BaseModel):
    name: Annotated[str, Field(min_length=1, max_length=200)]
    scopes: Annotated[list[Literal["read", "write", "admin"]], Field(min_length=1, max_length=3)] = ["read"]


def token_out(t: ApiToken) -> dict:
    return {"id": str(t.id), "name": t.name, "scopes": list(t.scopes), "created_at": t.created_at.isoformat(),
            "revoked_at": t.revoked_at.isoformat() if t.revoked_at else None}


@router.post("", status_code=201)
@needs("admin")
def create_token(body: TokenRequest, session: DB) -> dict:
    token = new_token()
    row = ApiToken(name=body.name, token_sha256=hash_token(token), scopes=sorted(set(body.scopes)))
    session.add(row)
    session.commit()
    return token_out(row) | {"token": token}


@router.get("")
@needs("admin")
def list_tokens(session: DB) -> dict:
    rows = session.execute(select(ApiToken).order_by(ApiToken.created_at)).scalars()
    return {"items": [token_out(t) for t in rows]}


@router.delete("/{token_id}")
@needs("admin")
def revoke_token(token_id: uuid.UUID, session: DB) -> dict:
    row = session.execute(
        update(ApiToken).where(ApiToken.id == token_id).values(revoked_at=func.coalesce(ApiToken.revoked_at, func.now()))
        .returning(ApiToken.id)
    ).first()
    if row is None:
        raise HTTPException(404, f"token {token_id} does not exist")
    session.commit()
    return token_out(session.get(ApiToken, token_id))
