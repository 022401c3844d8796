"""The operations this server does not serve yet: each answers 404 naming the operation (404 is what the SDK
neither retries nor treats as a broken client)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from services.api.auth import needs
from services.api.errors import ApiError
from services.api.routers.tinker.callers import Key

router = APIRouter()


# Every other route the SDK (0.38.0) calls: what it is, so the caller learns the operation is not served yet.
NOT_SERVED = {
    "/create_custom_loss": "create_custom_loss",
}


def _not_served(operation: str):
    def not_served(request: Request, _: Key) -> None:
        raise ApiError(404, f"Tinker operation {operation!r} ({request.method} {request.url.path}) is not supported "
                       "by this flywheel server yet", hint="docs/tinker.md lists the operations served")
    not_served.__name__ = "tinker_not_served"
    return needs("read")(not_served)  # any key learns what is missing (a 403 would break the SDK's start)


for _path, _operation in NOT_SERVED.items():
    router.add_api_route(_path, _not_served(_operation), methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
