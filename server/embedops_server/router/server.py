"""Run the app under uvicorn with a drain-aware SIGTERM: stop admitting, finish in-flight work, exit."""
from __future__ import annotations

import logging
import sys

import uvicorn

from ..settings import Settings
from .app import create_app

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT flip the app to draining (health 503, new work 503), then let uvicorn close the
    listener and wait for in-flight requests up to --graceful-shutdown-timeout."""

    def __init__(self, config, state):
        super().__init__(config)
        self._state = state

    def handle_exit(self, sig, frame):
        if not self._state.draining:
            log.info("signal %s: draining in-flight requests", sig)
        self._state.draining = True
        if self._state.service is not None:
            self._state.service.engine.draining = True  # admission refuses from now on
        super().handle_exit(sig, frame)


EXIT_MODEL_ERROR = 3  # the model folder cannot be served (ModelError): restarting will not help


def serve(settings: Settings) -> None:
    failed: list[BaseException] = []
    server: DrainingServer | None = None

    def model_error(e: BaseException) -> None:  # logged by the app in one line; stop and exit non-zero
        failed.append(e)
        if server is not None:
            server.should_exit = True

    app = create_app(settings, on_model_error=model_error)
    config = uvicorn.Config(
        app, host=settings.hostname, port=settings.port, log_config=None, access_log=False,
        timeout_graceful_shutdown=settings.graceful_shutdown_timeout, lifespan="on",
        backlog=max(2048, settings.max_concurrent_requests * 2), timeout_keep_alive=30,
    )
    server = DrainingServer(config, app.fastapi.state.embedops)
    server.run()
    if failed:
        sys.exit(EXIT_MODEL_ERROR)
