// Pins Prometheus Operator for `go build <package>` (go install refuses its module: it has replace directives,
// local ones only, which the published sub-modules below stand in for).
module embedops.local/prometheus-operator

go 1.24.0

require (
	github.com/prometheus-operator/prometheus-operator v0.85.0
	github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring v0.85.0
	github.com/prometheus-operator/prometheus-operator/pkg/client v0.85.0
)
