"""OpenTelemetry traces of the requests (TEI's `--otlp-endpoint`, `--otlp-service-name`; issue 54).

One SERVER span per HTTP request, and under it one span per stage the request went through, from the same
timeline `Server-Timing` reports (router/timing.py): parse, tokenize, queue, slot, forward, wake, respond. The
spans are made when the response starts, with the times the engine recorded, so nothing is done on the request's
path while it runs, and nothing at all when tracing is off (`Tracing.of` returns None: the middleware checks one
attribute). A W3C `traceparent` (and `tracestate`) from the caller makes the request's span a child of the
caller's, so the server's stages appear in the caller's trace; without one the request starts a trace.
`/health` and `/metrics` (probes and scrapes) are not traced. Attributes: the route, the status, the inputs and
tokens, the lane, and the batch it rode in (`embedops.batch.inputs`: inputs in its largest forward,
`embedops.batch.beside`: a forward ran beside it), `embedops.cache.hits`. Export: the OpenTelemetry SDK's batch
processor (a bounded queue, a background thread; spans dropped, never waited for, when the collector is slow) to
the OTLP endpoint over gRPC (TEI's, port 4317) or HTTP/protobuf (`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` or
`OTEL_EXPORTER_OTLP_PROTOCOL` = `http/protobuf`, port 4318). The SDK's own variables apply (sampler, resource
attributes, batch sizes).
"""
from __future__ import annotations

import logging
import os
import time

from .timing import stages

log = logging.getLogger(__name__)

# the kubelet's probes and Prometheus' scrapes: a span each per pod every few seconds, which no trace is about
UNTRACED = frozenset({"/health", "/metrics"})
HTTP_PROTOBUF = "http/protobuf"


def protocol() -> str:
    return (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "grpc").strip().lower()


class Tracing:
    """The tracer and its exporter, set up once per process."""

    def __init__(self, endpoint: str, service_name: str):
        # imported here: a server without --otlp-endpoint never loads the SDK
        from opentelemetry.propagators.textmap import DefaultGetter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if protocol() == HTTP_PROTOBUF:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            url = endpoint.rstrip("/")
            exporter = OTLPSpanExporter(endpoint=url if url.endswith("/v1/traces") else url + "/v1/traces")
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            # TEI's endpoints are written http://host:4317; plaintext unless https
            exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.processor = BatchSpanProcessor(exporter)
        self.provider.add_span_processor(self.processor)
        self.scope = InstrumentationScope("embedops_server")
        self.tracer = self.provider.get_tracer(self.scope.name)
        self.propagator = TraceContextTextMapPropagator()
        self._getter = DefaultGetter()
        self._server, self._internal, self._status, self._error = SpanKind.SERVER, SpanKind.INTERNAL, Status, \
            StatusCode.ERROR
        self._readable, self._context = ReadableSpan, SpanContext
        # perf_counter seconds -> epoch nanoseconds (the engine's timeline is perf_counter's)
        self._offset_ns = time.time_ns() - time.perf_counter_ns()

    @classmethod
    def of(cls, endpoint: str | None, service_name: str) -> "Tracing | None":
        if not endpoint:
            return None
        tracing = cls(endpoint, service_name)
        log.info("tracing: OTLP %s to %s as service %s", protocol(), endpoint, service_name)
        return tracing

    def _ns(self, t: float) -> int:
        return int(t * 1e9) + self._offset_ns

    def record(self, scope, status: int, req, t_received: float, now: float) -> None:
        """The request's span and its stages' (``req``: the engine request, None when the route ran none)."""
        if req is None and scope.get("path") in UNTRACED:
            return
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())
                   if k in (b"traceparent", b"tracestate")}
        parent = self.propagator.extract(carrier, getter=self._getter) if carrier else None
        method, path = scope.get("method", "GET"), scope.get("path", "")
        attributes = {"http.request.method": method, "url.path": path, "http.response.status_code": status}
        if req is not None:
            attributes.update({"embedops.inputs": req.n, "embedops.tokens": req.tokens,
                               "embedops.batch.inputs": req.batch_rows, "embedops.batch.beside": bool(req.beside)})
            if req.lane:
                attributes["embedops.lane"] = req.lane
            if req.cached is not None:
                attributes["embedops.cache.hits"] = req.cached.hits
        # a path nothing serves is not a span name (a scanner's paths would each be one)
        name = f"{method} {path}" if status != 404 else f"{method}"
        span = self.tracer.start_span(name, context=parent, kind=self._server, attributes=attributes,
                                      start_time=self._ns(t_received))
        if status >= 500:
            span.set_status(self._status(self._error))
        if req is not None and span.is_recording():  # a caller's unsampled trace: no stages either
            self._stages(span.get_span_context(), req, t_received, now)
        span.end(end_time=self._ns(now))

    def _stages(self, parent, req, t_received: float, now: float) -> None:
        """The stages as finished spans handed straight to the exporter's processor: they start and end in the
        past, so the SDK's live-span machinery (a lock, the sampler, the context each) would only cost: 10 us a
        stage against 33 (measured), with the same trace, parent, times and resource."""
        new_id = self.provider.id_generator.generate_span_id
        for stage, start, end in stages(req, t_received, now):
            context = self._context(parent.trace_id, new_id(), False, parent.trace_flags, parent.trace_state)
            self.processor.on_end(self._readable(
                name=stage, context=context, parent=parent, resource=self.provider.resource, kind=self._internal,
                start_time=self._ns(start), end_time=self._ns(end), instrumentation_scope=self.scope))

    def shutdown(self) -> None:
        """Export what is queued (the SDK waits up to its export timeout), then stop."""
        self.provider.shutdown()
