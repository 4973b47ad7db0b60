"""Leaves out the KEDA scalers this project's clusters never use, in a writable copy of KEDA's module.

    python3 trim.py <copy of github.com/kedacore/keda/v2>

KEDA compiles all of its ~70 scalers into one package (pkg/scalers) and builds them from one switch
(pkg/scaling/scalers_builder.go, between its TRIGGERS-START/-END markers). Each brings its client library: the
Elasticsearch typed API alone is ~960 Go packages, and Kafka, MongoDB, Temporal, every cloud's queues and
databases follow. Built whole, KEDA was the longest build of a cold `.ci/run`. KEDA has no build tags for this
(unlike Prometheus' service discovery), so this keeps the scalers in KEEP, drops the other files and the switch's
cases that named them; a ScaledObject with any other trigger type gets KEDA's own "no scaler found for type"
error. The operator writes `prometheus` and `metrics-api` triggers (operator/embedops_operator/render/autoscaling.py);
cpu, memory, cron, external and kubernetes-workload stay because they cost nothing and are KEDA's generic ones.
Everything else of KEDA (controllers, metrics server, resolver, fallback, HPA handling) is built unchanged.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

KEEP = ("cpu_memory", "cron", "external", "kubernetes_workload", "metrics_api", "prometheus")
# package-level names the kept scalers use that upstream declares in a dropped scaler's file
SHARED = 'const externalMetricType = "External" // declared in azure_queue_scaler.go upstream\n'


def trim(module: Path) -> list[str]:
    scalers = module / "pkg" / "scalers"
    dropped = [f for f in scalers.glob("*_scaler.go") if f.name.removesuffix("_scaler.go") not in KEEP]
    if len(dropped) < 40 or not all((scalers / f"{k}_scaler.go").exists() for k in KEEP):
        raise SystemExit(f"trim.py: {scalers} is not the layout this script knows (KEDA v2.21.0)")
    for f in dropped:
        f.unlink()
    (scalers / "trimmed_build.go").write_text("package scalers\n\n" + SHARED)
    defined = set()
    for f in scalers.glob("*.go"):
        if not f.name.endswith("_test.go"):
            defined |= set(re.findall(r"^func (New\w+)\(", f.read_text(), re.M))
    builder = module / "pkg" / "scaling" / "scalers_builder.go"
    text = builder.read_text()
    start, end = text.index("\tswitch triggerType {\n"), text.index("\t// TRIGGERS-END")
    head, *cases = re.split(r"(?m)^(?=\t(?:case |default:))", text[start:end])
    kept = [c for c in cases if all(n in defined for n in re.findall(r"scalers\.(New\w+)", c))]
    builder.write_text(text[:start] + head + "".join(kept) + text[end:])
    return [re.match(r"\t(case [^:]*|default)", c).group(1) for c in kept]


if __name__ == "__main__":
    print("kept:", ", ".join(trim(Path(sys.argv[1]))))
