//go:build tools

// The packages localcluster/build.py builds from this module; importing them keeps `go mod tidy` from dropping
// what they need.
package tools

import (
	_ "github.com/prometheus-operator/prometheus-operator/cmd/operator"
	_ "github.com/prometheus-operator/prometheus-operator/cmd/prometheus-config-reloader"
)
