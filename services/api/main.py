"""`flywheel-api` (or `python -m services.api.main`): the REST API and dashboard on API_PORT (default 8000).

uvicorn serves the app; it owns signals (SIGTERM/SIGINT: graceful shutdown, bounded by a timeout)."""

from __future__ import annotations

from services.api.config import ApiConfig
from shared.logs import get_logger, setup_logging

log = get_logger(__name__)


def main() -> None:
    config = ApiConfig()
    setup_logging(config.service_name, config.log_level, config.log_format)
    log.info("api config: %s", config.loggable())
    import uvicorn

    from services.api.app import create_app

    uvicorn.run(create_app(config), host=config.api_host, port=config.api_port, log_level="warning",
                timeout_graceful_shutdown=10)


if __name__ == "__main__":
    main()
