"""FastAPI dependencies as named type aliases: the DB session, the config, the principal."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from services.api.auth import Principal, authorize
from services.api.settings import ApiSettings


def get_session(request: Request) -> Iterator[Session]:
    with request.app.state.sessions() as session:
        yield session


def get_config(request: Request) -> ApiSettings:
    return request.app.state.config


DB = Annotated[Session, Depends(get_session)]
Config = Annotated[ApiSettings, Depends(get_config)]
User = Annotated[Principal, Depends(authorize)]
