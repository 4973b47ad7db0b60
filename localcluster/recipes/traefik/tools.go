//go:build tools

// The package localcluster/build.py builds from this module; importing it keeps `go mod tidy` from dropping
// what it needs.
package tools

import (
	_ "github.com/traefik/traefik/v3/cmd/traefik"
)
