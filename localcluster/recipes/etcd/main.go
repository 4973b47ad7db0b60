// Command etcd is the upstream etcd server (go.etcd.io/etcd/server/v3's own main), built from its Go
// module because no package here ships an etcd new enough for Kubernetes 1.34: with etcd 3.5.1 the API
// server turns off RequestWatchProgress, so clients that stream lists (kwok's client-go) lose their
// watches, see pod deletions and lease updates tens of seconds late, and fake nodes go NotReady.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
