// Command k8s is a multi-call binary holding kube-apiserver, kube-controller-manager, kube-scheduler,
// kubelet and kube-proxy, built from k8s.io/kubernetes at the release pinned in go.mod. The component is
// chosen by the name it is invoked as (symlinks) or by the first argument:
//
//	k8s kube-apiserver --etcd-servers=...
package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	proxy "k8s.io/kubernetes/cmd/kube-proxy/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
)

func command(name string) *cobra.Command {
	switch name {
	case "kube-apiserver":
		return apiserver.NewAPIServerCommand()
	case "kube-controller-manager":
		return controllermanager.NewControllerManagerCommand()
	case "kube-scheduler":
		return scheduler.NewSchedulerCommand()
	case "kubelet":
		return kubelet.NewKubeletCommand(context.Background())
	case "kube-proxy":
		return proxy.NewProxyCommand()
	}
	return nil
}

func main() {
	name := filepath.Base(os.Args[0])
	cmd := command(name)
	if cmd == nil && len(os.Args) > 1 {
		if cmd = command(os.Args[1]); cmd != nil {
			os.Args = append([]string{os.Args[1]}, os.Args[2:]...)
		}
	}
	if cmd == nil {
		fmt.Fprintln(os.Stderr, "usage: k8s kube-apiserver|kube-controller-manager|kube-scheduler|kubelet|kube-proxy [flags]")
		os.Exit(2)
	}
	cmd.SetArgs(os.Args[1:])
	os.Exit(cli.Run(cmd))
}
