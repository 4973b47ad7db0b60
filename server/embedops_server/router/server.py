"""Run the app under an HTTP server with a drain-aware SIGTERM: stop admitting, finish in-flight work, exit.

uvicorn (the default) or granian (`--http-server granian`: a Rust HTTP/1.1 server embedded in this process's
event loop; the sockets and HTTP parsing run on a Rust thread, the app on the same asyncio loop as with
uvicorn). Both serve the one ASGI app; docs/bench.md compares them side by side.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import os
import sys
from typing import Callable

import uvicorn

from ..core.model_info import ModelError
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
        _drain(self._state, sig)  # admission refuses from now on
        super().handle_exit(sig, frame)


EXIT_MODEL_ERROR = 3  # the model folder cannot be served (ModelError): restarting will not help
EXIT_LOAD_FAILED = 1  # loading failed otherwise (memory, disk, a bug): a restart may help
# Kubernetes shows this file's content as the container's termination message (pod status, and the
# EmbeddingService's status through the operator); the default terminationMessagePath.
TERMINATION_LOG = "/dev/termination-log"


def write_termination_message(message: str, path: str | None = None) -> None:
    path = path or os.environ.get("EMBEDOPS_TERMINATION_LOG", TERMINATION_LOG)
    try:
        with open(path, "w") as f:
            f.write(message[:4000])  # the kubelet keeps at most 4096 bytes
    except OSError:
        pass  # not in a pod (or not writable): the log line already says it


def _backlog(settings: Settings) -> int:
    return max(2048, settings.max_concurrent_requests * 2)


def _drain(state, sig) -> None:
    if not state.draining:
        log.info("signal %s: draining in-flight requests", sig)
    state.draining = True
    if state.service is not None:
        state.service.engine.draining = True


def _run_uvicorn(settings: Settings, app):
    config = uvicorn.Config(
        app, host=settings.hostname, port=settings.port, log_config=None, access_log=False,
        timeout_graceful_shutdown=settings.graceful_shutdown_timeout, lifespan="on",
        backlog=_backlog(settings), timeout_keep_alive=30,
    )
    server = DrainingServer(config, app.fastapi.state.embedops)
    return lambda: setattr(server, "should_exit", True), server.run


def _run_granian(settings: Settings, app):
    from granian.constants import HTTPModes, Interfaces
    from granian.server.embed import Server

    server = Server(app, address=settings.hostname, port=settings.port, interface=Interfaces.ASGI,
                    http=HTTPModes.http1, websockets=False, backlog=_backlog(settings), log_enabled=False)
    server.workers_kill_timeout = settings.graceful_shutdown_timeout  # in-flight requests get this long
    state = app.fastapi.state.embedops

    async def main():
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda sig=sig: (_drain(state, sig), server.stop()))
        await server.serve()

    def stop():  # from the event loop (a model that cannot load)
        server.stop()

    return stop, lambda: asyncio.run(main())


HTTP_SERVERS = {"uvicorn": _run_uvicorn, "granian": _run_granian}


def serve(settings: Settings) -> None:
    failed: list[BaseException] = []
    stop: Callable[[], None] | None = None

    def model_error(e: BaseException) -> None:  # logged by the app in one line; stop and exit non-zero
        failed.append(e)
        if stop is not None:
            stop()

    app = create_app(settings, on_model_error=model_error)
    stop, run = HTTP_SERVERS[settings.http_server](settings, app)
    run()
    if failed:
        e = failed[0]
        write_termination_message(f"model loading failed: {e}" if isinstance(e, ModelError)
                                  else f"model loading failed: {type(e).__name__}: {e}")
        sys.exit(EXIT_MODEL_ERROR if isinstance(e, ModelError) else EXIT_LOAD_FAILED)
