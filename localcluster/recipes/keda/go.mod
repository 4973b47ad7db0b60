// Pins KEDA for `go build <package>` (go install refuses its module: it has a replace directive). The replace
// and exclude below are KEDA v2.21.0's own, copied from its go.mod: a wrapper module must repeat them.
module embedops.local/keda

go 1.26.0

require github.com/kedacore/keda/v2 v2.21.0

replace github.com/nexus-rpc/nexus-proto-annotations v0.1.0 => github.com/nexus-rpc/nexus-proto-annotations v0.1.1-0.20260629224316-835bd8d49cb4

exclude github.com/go-chi/chi/v5 v5.2.3
