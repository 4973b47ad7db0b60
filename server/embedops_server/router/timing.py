"""`Server-Timing` on every answered inference request: where its time went, stage by stage.

A pure-ASGI middleware outside the routes and the guard (only the after-response and connection-close wrappers,
which do no work before the app, are outside it), so that its clock starts when the HTTP server hands the request
to the app.
The route's engine request (stashed in the scope by AppState.run) carries the engine's timeline; the header is
added as the response starts, so `respond` includes the route's post-processing and JSON serialization.
What is left out is the HTTP server's own time (accept, header parsing, the socket write): a client measures it
as its latency minus `total`. Costs a few microseconds per request; the bench reads it (bench/loadgen.py) to
break the slowest 1% of requests down against the median.

Stages, in milliseconds (W3C Server-Timing `dur`):
  parse     ASGI entry -> engine submit (body read, JSON parsing, validation, admission)
  tokenize  submit -> tokenized (the tokenizer thread hop or the inline encode)
  queue     tokenized -> the request's last input taken into a batch
  slot      batch formed -> its forward starts (a look-ahead batch waiting for a free forward, padding)
  forward   its forward starts -> its (last) forward ends (the backend, with pooling)
  wake      forward end -> the event loop resumes the handler (post-processing of the batch, the loop hop)
  respond   handler resumed -> response headers sent (normalization, serialization)
  total     ASGI entry -> response headers sent
and `batch;desc=<inputs in its largest forward>`, `beside;desc=1` when a forward ran beside another one,
`cache;desc=<inputs>` when the answer cache answered some of its inputs (all of them: no stage after `tokenize`).
The stages are consecutive and add up to `total`: for a request spread over several forwards, `queue` ends when its
last input is taken into a batch, so its earlier forwards fall inside `queue` and `forward` counts from there.
"""
from __future__ import annotations

import time

ENGINE_REQUEST_KEY = "embedops.engine_request"  # request.scope: the core Request behind this response


STAGES = ("parse", "tokenize", "queue", "slot", "forward", "wake", "respond")


def stages(req, t_received: float, now: float) -> list[tuple[str, float, float]]:
    """(stage, start, end) of an engine request answered at `now` (perf_counter seconds): consecutive, from
    `t_received` to `now`; a stage not reached (an error answered before it) and those after it are left out,
    no figure rather than a wrong one. Server-Timing and the trace (router/tracing.py) are both made from it."""
    points = (req.t_start, req.t_tokenized, req.t_batched, req.t_forward, req.t_forwarded, req.t_done, now)
    out = []
    prev = t_received
    for name, t in zip(STAGES, points):
        if not t:
            break
        end = max(prev, t)
        out.append((name, prev, end))
        prev = end
    return out


def server_timing(req, t_received: float, now: float) -> bytes:
    """The header value for an engine request answered at `now` (perf_counter seconds)."""
    parts = [f"{name};dur={(end - start) * 1000:.3f}" for name, start, end in stages(req, t_received, now)]
    parts.append(f"total;dur={(now - t_received) * 1000:.3f}")
    if req.batch_rows:
        parts.append(f"batch;desc={req.batch_rows}")
    if req.beside:
        parts.append("beside;desc=1")
    if req.cached is not None and req.cached.hits:
        parts.append(f"cache;desc={req.cached.hits}")
    return ", ".join(parts).encode()


class TimingMiddleware:
    """Adds `Server-Timing`, and the `embedding-space` header (core/space.py) that every response the model
    answered carries: `space()` gives its value (None before the model is loaded). With ``tracing``
    (router/tracing.py) every request's span and its stages' are recorded from the same timeline."""

    def __init__(self, app, space=None, tracing=None):
        self.app = app
        self.space = space or (lambda: None)
        self.tracing = tracing

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t_received = time.perf_counter()

        async def send_timed(message):
            if message["type"] == "http.response.start":
                req = scope.get(ENGINE_REQUEST_KEY)
                now = time.perf_counter()
                if req is not None:
                    message = dict(message)
                    headers = [*message.get("headers", ()), (b"server-timing", server_timing(req, t_received, now))]
                    space = self.space()
                    if space is not None:
                        headers.append((b"embedding-space", space))
                    message["headers"] = headers
                if self.tracing is not None:
                    self.tracing.record(scope, message["status"], req, t_received, now)
            await send(message)

        return await self.app(scope, receive, send_timed)
