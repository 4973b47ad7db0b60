// Command coredns is CoreDNS (the release pinned in go.mod) with only the plugins the local real node's
// cluster DNS needs: the kubernetes plugin answers cluster.local (and reverse lookups of the pod and
// Service ranges) from the API server; there is deliberately no forward plugin, so names outside the
// cluster are refused and no query ever leaves the machine. Built by localcluster/build.py (component `coredns`).
package main

import (
	"fmt"
	"os"

	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

// Execution order, as in CoreDNS's own plugin.cfg (a subset of it).
var directives = []string{
	"bind",
	"ready",
	"health",
	"errors",
	"log",
	"cache",
	"kubernetes",
}

func main() {
	if err := dnsserver.SetDirectives(directives); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	coremain.Run()
}
