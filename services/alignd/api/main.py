"""Run the control API with uvicorn: ``python -m alignd.api.main``.

Settings come from ``ALIGN_*`` variables (``ALIGN_API_HOST``, ``ALIGN_API_PORT``,
``ALIGN_API_TOKEN``, ``ALIGN_REDIS_URL``, ...). Without ``ALIGN_REDIS_URL`` the API talks
to the embedded in-process Redis, which only threads of this same process can share.
The server is :func:`alignd.api.server.build_server`'s: header deadline, connection limits,
descriptor limit and bounded logs come from the settings there.
"""

from __future__ import annotations

import logging

import redis

from alignd.api.app import create_app
from alignd.api.server import bound_logs, build_server
from alignd.infra.service_main import load_settings
from alignd.infra.settings import ApiSettings

log = logging.getLogger("alignd.api")


def serve(settings: ApiSettings | None = None, *, client: redis.Redis | None = None) -> None:
    """Serve the API on ``settings.api_host:api_port`` until interrupted."""
    settings = settings or ApiSettings()
    server = build_server(create_app(settings, client=client), settings)
    bound_logs()  # after uvicorn.Config, which (re)configures uvicorn's handlers
    server.run()


def main() -> int:
    """Entry point of ``python -m alignd.api.main``: 0 after a clean stop, 2 for bad settings."""
    settings = load_settings(log, ApiSettings)
    if settings is None:
        return 2
    serve(settings)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
