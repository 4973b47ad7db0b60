//go:build tools

// The packages localcluster/build.py builds from this module; importing them keeps `go mod tidy` from dropping
// what they need.
package tools

import (
	_ "github.com/kedacore/keda/v2/cmd/adapter"
	_ "github.com/kedacore/keda/v2/cmd/operator"
)
