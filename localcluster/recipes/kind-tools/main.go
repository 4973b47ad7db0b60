// Command kind-tools is a multi-call binary holding kubeadm and kubectl, built from k8s.io/kubernetes at the
// release pinned in go.mod (the same as the k8s multi-call binary's). They go into the kind node image
// (localcluster/kindnode.py): kind runs kubeadm to start each node and kubectl inside the control-plane node
// to install the CNI and the storage class. The tool is chosen by the name it is invoked as (symlinks) or by
// the first argument:
//
//	kind-tools kubeadm init ...
package main

import (
	"fmt"
	"os"
	"path/filepath"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	kubectl "k8s.io/kubectl/pkg/cmd"
	kubectlutil "k8s.io/kubectl/pkg/cmd/util"
	kubeadm "k8s.io/kubernetes/cmd/kubeadm/app"
)

func run(name string) (int, bool) {
	switch name {
	case "kubeadm":
		if err := kubeadm.Run(); err != nil {
			return 1, true
		}
		return 0, true
	case "kubectl":
		if err := cli.RunNoErrOutput(kubectl.NewDefaultKubectlCommand()); err != nil {
			kubectlutil.CheckErr(err) // prints the error as kubectl does and exits non-zero
		}
		return 0, true
	}
	return 0, false
}

func main() {
	if code, ok := run(filepath.Base(os.Args[0])); ok {
		os.Exit(code)
	}
	if len(os.Args) > 1 {
		name := os.Args[1]
		os.Args = append([]string{name}, os.Args[2:]...)
		if code, ok := run(name); ok {
			os.Exit(code)
		}
	}
	fmt.Fprintln(os.Stderr, "usage: kind-tools kubeadm|kubectl [flags]")
	os.Exit(2)
}
