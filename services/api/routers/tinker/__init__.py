"""The Tinker protocol (the `tinker` SDK's routes under /api/v1): client config, sessions, server capabilities,
LoRA training models, their training operations (sent to the trainer on `tinker.ops.<model id>`) and the futures
their operations return. Auth is the SDK's `X-API-Key: tml-<token>`,
a flywheel token (API_TOKEN or an api_tokens row) behind `tml-`. Operations this server does not serve yet
answer 404 naming the operation (404 is what the SDK neither retries nor treats as a broken client).
More: docs/tinker.md"""

from fastapi import APIRouter

from services.api.routers.tinker import (
    audit,
    billing,
    checkpoints,
    not_served,
    sampling,
    sessions,
    traces,
    training,
)

router = APIRouter(prefix="/api/v1", tags=["tinker"], include_in_schema=False)
# not_served last: FastAPI matches routes in order, and a catch-all path there must not take a served route.
for part in (sessions, training, sampling, checkpoints, traces, audit, billing, not_served):
    router.include_router(part.router)
