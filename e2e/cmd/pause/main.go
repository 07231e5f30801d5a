// Command pause is the local node's Pod sandbox image (hack/node/node.sh): a static program that
// sleeps as PID 1 of each Pod until it is told to stop, like registry.k8s.io/pause, which cannot
// be pulled where no container registry is reachable.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	// PID 1 gets no default signal actions, so stopping needs handlers. Nothing to reap: the
	// Pod's containers have PID namespaces of their own unless shareProcessNamespace is set.
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	<-stop
}
