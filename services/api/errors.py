"""One shape for every error the API returns (4xx and 5xx alike):

    {"message": "dataset: dataset 'x' does not exist", "detail": [{"field": "dataset", "message": "...", "hint": "..."}]}

`message` is one readable line (what the CLI prints); `detail` lists each problem with the input `field` at
fault (dotted, `query.limit` / `path.run_id` for non-body inputs; null for the request as a whole) and a `hint`
saying how to fix it when there is one. Routes raise `ApiError`; FastAPI's validation errors, plain
HTTPExceptions (404 for unknown paths, 405) and database refusals are converted here."""

from __future__ import annotations

import difflib
import re
from typing import Annotated, Any, get_args

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from sqlalchemy.exc import DataError, IntegrityError
from starlette.exceptions import HTTPException

from services.api.schemas import ErrorBody, ErrorItem
from shared.clients.run_commands import RunRefused


def _integral(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("expected an integer, got a boolean")
    return int(value) if isinstance(value, float) and value.is_integer() else value


# A JSON integer: 3 or 3.0 (JSON Schema's `integer` admits both), never true/false or "3".
Int = Annotated[int, BeforeValidator(_integral)]


def int_in(ge: int, le: int) -> Any:
    """Int within bounds, for Optional fields (bounds must precede the validator to reach the schema)."""
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_integral)]


class StrictBody(BaseModel):
    """Request bodies take JSON types as the schema states them: no `false` for an integer, no `"1"` for a
    number (pydantic's lax mode would accept both, which the schema does not say)."""

    model_config = ConfigDict(strict=True)


class ApiError(HTTPException):
    """An error response: `raise ApiError(404, "run x does not exist", field="run_id", hint="...")`; several
    problems at once with `items=[ErrorItem(...), ...]`."""

    def __init__(self, status_code: int, message: str = "", *, field: str | None = None, hint: str | None = None,
                 items: list[ErrorItem] | None = None, headers: dict[str, str] | None = None):
        self.items = items or [ErrorItem(field=field, message=message, hint=hint)]
        super().__init__(status_code, summary(self.items), headers)


def refused(e: RunRefused) -> ApiError:
    """A run shared/clients/run_commands.py refused, answered with its status and every problem as an error item."""
    return ApiError(e.status, items=[ErrorItem(**p.model_dump()) for p in e.problems])


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` documenting error statuses with the one error body."""
    return {code: {"model": ErrorBody, "description": DESCRIPTIONS.get(code, "error")} for code in codes}


DESCRIPTIONS = {
    400: "the body is not valid JSON, or the request cannot work as given (the message says why and how to fix it)",
    401: "missing, invalid or revoked bearer token", 403: "the token lacks the scope this route needs",
    404: "the resource, or one the request names, does not exist", 405: "method not allowed",
    409: "conflicts with the resource's current state", 413: "the upload is too large",
    422: "the request does not match the schema", 502: "a service the request was forwarded to refused it",
    503: "a dependency (Redis, the job queue, the controller) is unreachable or did not answer",
}


def summary(items: list[ErrorItem]) -> str:
    return "; ".join((f"{i.field}: " if i.field else "") + i.message + (f" ({i.hint})" if i.hint else "")
                     for i in items)


def _body(items: list[ErrorItem]) -> dict[str, Any]:
    return ErrorBody(message=summary(items), detail=items).model_dump()


def _field(loc: tuple | list) -> str | None:
    parts = [str(p) for p in loc]
    if parts and parts[0] == "body":
        parts = parts[1:]
    return ".".join(parts) or None


def validation_items(errors_: list[dict], body: Any = None) -> list[ErrorItem]:
    """pydantic errors as items; a model validator's ValueError reads "field: message", which names its field.
    With the request body's type, an unknown field's hint names the closest valid one."""
    items = []
    for e in errors_:
        field, message = _field(e.get("loc", ())), str(e.get("msg", "")).removeprefix("Value error, ")
        head, sep, rest = message.partition(": ")
        if sep and field in (None, "") and " " not in head:
            field, message = head, rest
        hint = None
        loc = list(e.get("loc", ()))
        if e.get("type") == "extra_forbidden" and body is not None and loc[:1] == ["body"] and len(loc) > 1:
            message, hint = "unknown field", unknown_field_hint(str(loc[-1]), field_names(body, loc[1:-1]))
        items.append(ErrorItem(field=field, message=message, hint=hint))
    return items


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (itself, or inside Optional / Union / list / Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def field_names(annotation: Any, path: list) -> list[str]:
    """The field names (and aliases) valid at `path` (a pydantic error location) inside `annotation`. Parts that
    are no field (list indexes, union tags) leave the level as it is."""
    models = _models_in(annotation)
    for part in path:
        fields = {k: f for m in models for k, f in m.model_fields.items()}
        fields |= {f.alias: f for f in list(fields.values()) if f.alias}
        if part in fields:
            models = _models_in(fields[part].annotation)
    names = {k for m in models for k in m.model_fields} | {f.alias for m in models for f in m.model_fields.values()
                                                           if f.alias}
    return sorted(names)


def unknown_field_hint(key: str, names: list[str]) -> str | None:
    """"did you mean 'samples_per_task'?" for the closest valid name, else the valid names."""
    if not names:
        return None
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6) or \
        difflib.get_close_matches(key.lower(), [n.lower() for n in names], n=1, cutoff=0.6)
    if close:
        return f"did you mean {next(n for n in names if n.lower() == close[0].lower())!r}?"
    return f"remove it; valid fields here: {', '.join(names)}"


def _allowed_methods(request: Request) -> set[str]:
    """Every method the schema lists at this path (Starlette's 405 names only the first matching route's)."""
    path, paths = request.scope.get("path", ""), request.app.openapi()["paths"]
    if path in paths:  # a literal path (/v1/jobs/gc) is its own resource, not a value of /v1/jobs/{job_id}
        return {m.upper() for m in paths[path]}
    return {m.upper() for template, ops in paths.items()
            if re.fullmatch(re.sub(r"\{[^}]+\}", "[^/]+", template), path) for m in ops}


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        items = getattr(exc, "items", None) or [ErrorItem(message=str(exc.detail))]
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = ", ".join(sorted(_allowed_methods(request)))
        return JSONResponse(_body(items), status_code=exc.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        route_body = getattr(request.scope.get("route"), "body_field", None)
        body_type = getattr(getattr(route_body, "field_info", None), "annotation", None)
        return JSONResponse(_body(validation_items(list(exc.errors()), body_type)), status_code=422)

    @app.exception_handler(DataError)
    async def bad_value(request: Request, exc: DataError) -> JSONResponse:
        # Values Postgres refuses (a NUL byte in text, a number out of range): the input's fault, not ours.
        reason = str(exc.orig).splitlines()[0] if exc.orig else str(exc)
        return JSONResponse(_body([ErrorItem(message=f"invalid value: {reason}",
                                             hint="remove NUL bytes and keep numbers in range")]), status_code=422)

    @app.exception_handler(IntegrityError)
    async def conflict(request: Request, exc: IntegrityError) -> JSONResponse:
        reason = str(exc.orig).splitlines()[0] if exc.orig else str(exc)
        return JSONResponse(_body([ErrorItem(message=f"conflicts with stored data: {reason}")]), status_code=409)
