"""Run the app under uvicorn with a drain-aware SIGTERM: health 503, no new connections, open ones retired,
in-flight work finished, exit."""
from __future__ import annotations

import asyncio
import logging
import sys
import time

import uvicorn

from ..asgi import listening_socket
from ..core.model_info import ModelError
from ..settings import Settings, Tuning
from .app import create_app
from .http_limits import HttpLimits, LimitedHttpToolsProtocol

log = logging.getLogger(__name__)


RETIRE_SECONDS = 2.0  # after SIGTERM, how long pooled keep-alive connections get to be retired one by one


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT: /health answers 503 and the listener closes; for RETIRE_SECONDS every answer carries
    ``Connection: close`` (router/middleware.py's ConnectionCloseMiddleware), so each client's pooled connection is
    retired after its next request; then uvicorn closes what is left idle and waits for in-flight requests up
    to --graceful-shutdown-timeout.

    Requests on open connections are served, not refused: they come from clients' pools (a gateway's,
    through the Service's cluster IP, which conntrack keeps on this pod after its endpoint is gone) and the
    engine runs until the last request is done. Through Traefik in a rollout, refusing them with 503 lost 8 of
    4204 requests, and closing idle pooled connections at once lost 1 of 3438 (a POST sent on a connection
    as it closed, which no HTTP client resends)."""

    def __init__(self, config, state):
        super().__init__(config)
        self._state = state
        # Requests whose task uvicorn has made (headers read), running or not: the engine runs a lone query's
        # forward on the event loop only when it is the only one (see Engine.submit's `alone`).
        state.requests_in_flight = lambda: len(self.server_state.tasks)

    async def shutdown(self, sockets=None):
        for server in self.servers:  # no new connections (uvicorn's shutdown closes them again, harmlessly)
            server.close()
        for sock in sockets or []:
            sock.close()
        deadline = time.monotonic() + RETIRE_SECONDS
        while self.server_state.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await super().shutdown()

    def handle_exit(self, sig, frame):
        if not self._state.draining:
            log.info("signal %s: draining in-flight requests", sig)
        self._state.draining = True
        super().handle_exit(sig, frame)


EXIT_MODEL_ERROR = 3  # the model folder cannot be served (ModelError): restarting will not help
EXIT_LOAD_FAILED = 1  # loading failed otherwise (memory, disk, a bug): a restart may help


def write_termination_message(message: str, path: str | None = None) -> None:
    """Kubernetes shows this file's content as the container's termination message (pod status, and the
    EmbeddingService's status through the operator): Tuning.termination_log, the default terminationMessagePath."""
    path = path or Tuning().termination_log
    try:
        with open(path, "w") as f:
            f.write(message[:4000])  # the kubelet keeps at most 4096 bytes
    except OSError:
        pass  # not in a pod (or not writable): the log line already says it


def server_config(app, settings: Settings, **overrides) -> uvicorn.Config:
    """uvicorn's configuration of the server (the tests' servers use it too): the HTTP limits of `HttpLimits` on
    its httptools protocol, and at most --max-connections connections."""
    config = uvicorn.Config(
        app, **{"host": settings.hostname, "port": settings.port, "log_config": None, "access_log": False,
                "timeout_graceful_shutdown": settings.graceful_shutdown_timeout, "lifespan": "on",
                "backlog": max(2048, settings.max_concurrent_requests * 2), "timeout_keep_alive": 30,
                "http": LimitedHttpToolsProtocol, "limit_concurrency": settings.max_connections, **overrides})
    config.http_limits = HttpLimits(settings.max_header_bytes, settings.max_headers, settings.request_timeout)
    return config


def serve(settings: Settings, tuning: Tuning | None = None) -> None:
    """Run the server until it is stopped. ``tuning``: the EMBEDOPS_* switches read once at the start."""
    tuning = tuning if tuning is not None else Tuning()
    failed: list[BaseException] = []
    server: DrainingServer | None = None

    def model_error(e: BaseException) -> None:  # logged by the app in one line; stop and exit non-zero
        failed.append(e)
        if server is not None:
            server.should_exit = True

    app = create_app(settings, on_model_error=model_error, tuning=tuning)
    server = DrainingServer(server_config(app, settings), app.fastapi.state.embedops)
    # the batch lane's own address (AppState.lane) and the metrics' (MetricsPortMiddleware): one server, more ports
    ports = [p for p in (settings.batch_port, settings.prometheus_port) if p]
    if ports:
        server.run(sockets=[listening_socket(settings.hostname, p) for p in (settings.port, *ports)])
    else:
        server.run()
    if failed:
        e = failed[0]
        write_termination_message(f"model loading failed: {e}" if isinstance(e, ModelError)
                                  else f"model loading failed: {type(e).__name__}: {e}", tuning.termination_log)
        sys.exit(EXIT_MODEL_ERROR if isinstance(e, ModelError) else EXIT_LOAD_FAILED)
