"""The Grafana dashboard the chart ships for embedops services, built with Grafana's foundation SDK.

    python -m scripts.dashboard > charts/embedops-operator/dashboards/embedops.json

The chart puts the JSON in a ConfigMap labelled ``grafana_dashboard: "1"`` (``dashboards.enabled``), which
kube-prometheus-stack's Grafana sidecar loads. ``PANELS`` is plain data (no SDK needed to read it): the e2e
test evaluates every query on a live Prometheus under load. The SDK (``grafana-foundation-sdk``, a dev
dependency) is needed only to regenerate the file; ``tests/unit/test_dashboard.py`` fails when the file and
this module disagree.
"""
from __future__ import annotations

import json
import sys

UID = "embedops-services"
SEL = 'namespace="$namespace",service="$service"'
RATE = "$__rate_interval"


def _q(quantile: str, metric: str) -> str:
    return f"histogram_quantile({quantile}, sum by (le) (rate({metric}_bucket{{{SEL}}}[{RATE}])))"


def _mean(metric: str) -> str:
    return f"sum(rate({metric}_sum{{{SEL}}}[{RATE}])) / sum(rate({metric}_count{{{SEL}}}[{RATE}]))"


# (row, title, unit, [(PromQL, legend)], description)
PANELS: list[tuple[str, str, str, list[tuple[str, str]], str]] = [
    ("Traffic", "Requests", "reqps",
     [(f"sum by (method) (rate(te_request_count{{{SEL}}}[{RATE}]))", "{{method}}")],
     "Requests received per second, single-input and batch (te_request_count counts failures too)."),
    ("Traffic", "Failures by cause", "reqps",
     [(f"sum by (err) (rate(te_request_failure{{{SEL}}}[{RATE}]))", "{{err}}")],
     "overloaded = 429 (over maxConcurrentRequests); inference = 424; unhealthy = 503; validation, "
     "tokenization, batch_size = 4xx from the client; dropped = the client went away."),
    ("Traffic", "Refused with 429", "percentunit",
     [(f'sum(rate(te_request_failure{{{SEL},err="overloaded"}}[{RATE}])) / sum(rate(te_request_count{{{SEL}}}[{RATE}]))',
       "share of requests")],
     "Share of requests refused by the admission limit: the EmbeddingServiceOverloaded alert's ratio."),
    ("Traffic", "Inputs answered", "ops",
     [(f"sum(rate(te_embed_success{{{SEL}}}[{RATE}]))", "embedded"),
      (f"sum(rate(te_predict_success{{{SEL}}}[{RATE}]))", "scored (rerank, predict)")],
     "Inputs per second (a batch request carries many)."),
    ("Latency", "Request duration", "s",
     [(_q("0.5", "te_request_duration"), "p50"), (_q("0.99", "te_request_duration"), "p99")],
     "End to end, from the request to its answer."),
    ("Latency", "Queue and inference time", "s",
     [(_q("0.99", "te_request_queue_duration"), "queue p99"),
      (_q("0.99", "te_request_inference_duration"), "inference p99"),
      (_q("0.5", "te_request_queue_duration"), "queue p50"),
      (_q("0.5", "te_request_inference_duration"), "inference p50")],
     "Where the time goes: waiting for a batch vs. the forward pass (per-input averages of each request)."),
    ("Latency", "Duration by lane", "s",
     [(f"histogram_quantile(0.99, sum by (le, lane) (rate(embedops_lane_request_duration_bucket{{{SEL}}}[{RATE}])))",
       "{{lane}} p99"),
      (f"histogram_quantile(0.5, sum by (le, lane) (rate(embedops_lane_request_duration_bucket{{{SEL}}}[{RATE}])))",
       "{{lane}} p50")],
     "Interactive (queries) and batch (ingestion) lanes, from submission to the engine to the answer: a query's "
     "should not follow ingestion's up."),
    ("Batching", "Batch size", "short",
     [(_mean("te_batch_next_size"), "inputs per batch (mean)"), (_q("0.99", "te_batch_next_size"), "p99")],
     "Inputs per forward pass: how much fixed cost is shared."),
    ("Batching", "Tokens per batch", "short",
     [(_mean("te_batch_next_tokens"), "tokens per batch (mean)"), (_q("0.99", "te_batch_next_tokens"), "p99")],
     "Real (unpadded) tokens per forward pass, against batching.maxBatchTokens."),
    ("Capacity", "Queue size per pod", "short",
     [(f"sum by (pod) (te_queue_size{{{SEL}}})", "{{pod}}")],
     "Inputs waiting for a forward pass: what the ScaledObject scales on."),
    ("Capacity", "Queue by lane", "short",
     [(f"sum by (lane) (embedops_lane_queue_size{{{SEL}}})", "{{lane}}"),
      (f"sum by (lane) (rate(embedops_lane_overloaded{{{SEL}}}[{RATE}]))", "{{lane}} refused (429/s)")],
     "Inputs waiting per lane (KEDA scales on the interactive one when spec.lanes is set), and each lane's 429s: "
     "the batch lane is refused first."),
    ("Capacity", "In-flight inputs per pod", "short",
     [(f"sum by (pod) (te_in_flight_inputs{{{SEL}}})", "{{pod}}")],
     "Admitted inputs not yet answered."),
    ("Capacity", "Replicas", "short",
     [(f'max by (state) (embedops_service_replicas{{{SEL}}})', "{{state}}")],
     "Desired (the Deployment's, the autoscaler's choice) vs. ready, from the operator's metrics."),
    ("Capacity", "Container restarts", "short",
     [(f"max(embedops_service_pod_restarts{{{SEL}}})", "restarts of current pods")],
     "A rising count: a model that cannot load, OOM kills, a crash loop."),
    ("Answer cache", "Hit ratio", "percentunit",
     [(f"sum(rate(embedops_answer_cache_hits{{{SEL}}}[{RATE}])) / (sum(rate(embedops_answer_cache_hits{{{SEL}}}"
       f"[{RATE}])) + sum(rate(embedops_answer_cache_misses{{{SEL}}}[{RATE}])))", "hits / cacheable inputs")],
     "spec.answerCache: the share of inputs answered without a forward (empty when the cache is off)."),
    ("Answer cache", "Cache size", "bytes",
     [(f"sum by (pod) (embedops_answer_cache_bytes{{{SEL}}})", "{{pod}}")],
     "Bytes each replica's cache holds: up to spec.answerCache.size, which the replica's memory limit counts."),
    ("Answer cache", "Evictions", "short",
     [(f"sum(rate(embedops_answer_cache_evictions{{{SEL}}}[{RATE}]))", "answers dropped/s")],
     "Answers dropped to stay within the size, least recently used first: steady evictions with a low hit ratio "
     "say the size is too small for the repeats."),
]


def build() -> dict:
    """The dashboard as Grafana's JSON model."""
    from grafana_foundation_sdk.builders import dashboard as db
    from grafana_foundation_sdk.builders import prometheus, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

    ds = DataSourceRef(type_val="prometheus", uid="${datasource}")
    d = (db.Dashboard("embedops services").uid(UID).tags(["embedops", "embeddings"]).refresh("30s")
         .time("now-1h", "now").timezone("browser")
         .description("One EmbeddingService: traffic, failures, latency by stage, batching, queue and replicas. "
                      "Generated by scripts/dashboard.py.")
         .with_variable(db.DatasourceVariable("datasource").label("Data source").type("prometheus"))
         .with_variable(db.QueryVariable("namespace").label("Namespace").datasource(ds)
                        .query("label_values(te_request_count, namespace)").refresh(VariableRefresh.ON_TIME_RANGE_CHANGED))
         .with_variable(db.QueryVariable("service").label("Service").datasource(ds)
                        .query('label_values(te_request_count{namespace="$namespace"}, service)')
                        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)))
    row = None
    for row_title, title, unit, queries, description in PANELS:
        if row_title != row:
            d = d.with_row(db.Row(row_title))
            row = row_title
        panel = (timeseries.Panel().title(title).description(description).unit(unit).datasource(ds)
                 .min(0).span(8).height(8))
        for i, (expr, legend) in enumerate(queries):
            panel = panel.with_target(prometheus.Dataquery().expr(expr).legend_format(legend).ref_id("ABCD"[i]))
        d = d.with_panel(panel)
    return json.loads(JSONEncoder(sort_keys=True, indent=2).encode(d.build()))


def main() -> int:
    sys.stdout.write(json.dumps(build(), indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
