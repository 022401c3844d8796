"""`flywheel-api` (or `python -m services.api.main`): the REST API and dashboard on API_HOST:API_PORT (default
0.0.0.0:8000), served by the service runtime (signals, heartbeat, graceful shutdown bounded by a timeout)."""

from __future__ import annotations

import sys

from services.api.settings import ApiSettings
from shared.platform.service import Loops, ServiceRuntime, run_service


def main() -> int:
    return run_service(ApiSettings(), build)


async def build(config: ApiSettings, runtime: ServiceRuntime) -> Loops:
    from services.api.app import create_app

    app = create_app(config)
    runtime.on_stop(app.state.engine.dispose)
    runtime.on_stop(app.state.gateway_http.aclose)
    runtime.app = app  # the API's own /healthz, /readyz and /metrics replace the runtime's bare ones
    return []  # HTTP is all it serves


if __name__ == "__main__":
    sys.exit(main())
