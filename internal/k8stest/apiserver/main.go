// Command apiserver is kube-apiserver, built for the tests from the
// release the k8s.io modules of egressd use. It is a module of its own:
// k8s.io/kubernetes brings a dependency graph the daemon must not carry.
package main

import (
	"os"

	"k8s.io/component-base/cli"
	"k8s.io/kubernetes/cmd/kube-apiserver/app"
)

func main() { os.Exit(cli.Run(app.NewAPIServerCommand())) }
