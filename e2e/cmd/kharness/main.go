// Command kharness runs a local Kubernetes control plane for ucm's e2e tests and `make run`:
// embedded etcd + in-process kube-apiserver, optionally kube-controller-manager as a child.
// Design: docs/operations.md, "The local control plane", and e2e/README-kharness.md.
//
//	kharness serve --dir D [--with-kcm] [--rm-dir] [--exit-on-stdin-eof] [--verbose] [-- apiserver flags]
//	kharness kcm --kubeconfig D/kubeconfig [kube-controller-manager flags...]
//	kharness forward --netns /run/netns/N --listen ADDR[,ADDR...] --to HOST:PORT
package main

import (
	"fmt"
	"log"
	"os"
	"strings"
	_ "time/tzdata" // as cmd/kube-apiserver: time zone support for CronJob

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"          // as cmd/kube-apiserver: JSON log format
	_ "k8s.io/component-base/metrics/prometheus/clientgo" // as cmd/kube-apiserver: client-go metrics
	_ "k8s.io/component-base/metrics/prometheus/version"  // as cmd/kube-apiserver: version metric
	kcmapp "k8s.io/kubernetes/cmd/kube-controller-manager/app"
)

const usage = `usage:
  kharness serve --dir D [--with-kcm] [--rm-dir] [--exit-on-stdin-eof] [--verbose] [-- apiserver flags]
  kharness kcm --kubeconfig D/kubeconfig [kube-controller-manager flags...]
  kharness forward --netns /run/netns/N --listen ADDR[,ADDR...] --to HOST:PORT
`

// logger writes to the real stderr: cli.Run redirects the standard log package into klog.
var logger = log.New(os.Stderr, "kharness: ", log.Ltime|log.Lmicroseconds)

// stdout is the real standard output, kept for the READY line (see quietLogFlags).
var stdout = os.Stdout

// quietLogFlags keeps stderr readable: ~150 info lines at apiserver start are noise in test logs.
// With text split-stream, klog sends info lines to os.Stdout as it is when logging is applied
// (component-base LoggingOptions default) and warnings/errors to stderr; we point os.Stdout at
// /dev/null first. KHARNESS_VERBOSE=1 (serve --verbose) keeps everything on stderr.
func quietLogFlags() []string {
	if os.Getenv("KHARNESS_VERBOSE") != "" {
		return nil
	}
	devnull, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
	if err != nil {
		return nil
	}
	os.Stdout = devnull
	return []string{"--feature-gates=LoggingAlphaOptions=true", "--log-text-split-stream=true"}
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	switch os.Args[1] {
	case "serve":
		os.Exit(serve(os.Args[2:]))
	case "kcm":
		os.Exit(kcm(os.Args[2:]))
	case "forward":
		os.Exit(forward(os.Args[2:]))
	case "-h", "--help", "help":
		fmt.Print(usage)
	default:
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
}

// kcmControllers are the only controllers ucm's tests need (e2e/README-kharness.md): never the
// workload controllers, which would overwrite statuses that tests set by hand. Names as in 1.37
// (cmd/kube-controller-manager/names). clusterrole-aggregation-controller fills the built-in
// aggregated roles (view, edit, admin), which otherwise have no rules.
const kcmControllers = "garbage-collector-controller,namespace-controller,serviceaccount-controller," +
	"root-ca-certificate-publisher-controller,clusterrole-aggregation-controller"

// kcm runs kube-controller-manager in this process. It must be its own process: the apiserver
// and KCM share process-global state (feature gates, logging, metrics registries).
func kcm(args []string) int {
	cmd := kcmapp.NewControllerManagerCommand()
	// Defaults first so that caller flags given later win. --controllers is a list flag whose
	// second occurrence appends, so a caller's list replaces ours instead of following it.
	defaults := []string{"--leader-elect=false", "--secure-port=0"}
	if !hasFlag(args, "--controllers") {
		defaults = append(defaults, "--controllers="+kcmControllers)
	}
	cmd.SetArgs(append(append(defaults, quietLogFlags()...), args...))
	cmd.SetOut(os.Stderr)
	return cli.Run(cmd)
}

// hasFlag reports whether args set the long flag name (as "name=v" or "name v").
func hasFlag(args []string, name string) bool {
	for _, a := range args {
		if a == name || strings.HasPrefix(a, name+"=") {
			return true
		}
	}
	return false
}
