package main

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"sync/atomic"
	"syscall"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
	"k8s.io/component-base/cli"
	apiserverapp "k8s.io/kubernetes/cmd/kube-apiserver/app"
)

type harness struct {
	dir                        string
	withKCM, rmDir, stdinEOF   bool
	extra                      []string // apiserver flags after "--"
	p                          ports
	tok                        tokens
	signalled                  atomic.Bool   // a SIGTERM/SIGINT reached the process (or we sent one)
	stop                       chan struct{} // closed on the first signal
	etcd                       *embed.Etcd
	apiExited                  chan struct{} // nil until the apiserver goroutine runs
	apiCode                    int
	kcmCmd                     *exec.Cmd
	kcmExited                  chan struct{}
	client                     *http.Client
	kubeconfig, kubeconfigUser string
}

var errStopped = errors.New("stopped by signal")

func serve(args []string) int {
	log.SetFlags(log.Ltime | log.Lmicroseconds)
	log.SetPrefix("kharness: ")
	h := &harness{stop: make(chan struct{})}

	// Register our own channel before anything else: until the apiserver installs its handler a
	// signal would otherwise kill us with the default action and leak D with --rm-dir. We never
	// call SetupSignalContext ourselves: the apiserver's NewAPIServerCommand does, and a second one panics.
	sig := make(chan os.Signal, 4)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		s := <-sig
		h.signalled.Store(true)
		log.Printf("received %v, shutting down", s)
		close(h.stop)
		for s := range sig {
			log.Printf("received %v again (the apiserver handler exits with 1 on a second signal)", s)
		}
	}()

	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.StringVar(&h.dir, "dir", "", "state directory D (created 0700, reused if it exists)")
	fs.BoolVar(&h.withKCM, "with-kcm", false, "also run kube-controller-manager (GC, namespaces, ServiceAccounts)")
	fs.BoolVar(&h.rmDir, "rm-dir", false, "remove D on exit")
	fs.BoolVar(&h.stdinEOF, "exit-on-stdin-eof", false, "shut down when stdin reaches EOF")
	fs.Usage = func() {
		fmt.Fprintln(os.Stderr, "usage: kharness serve --dir D [--with-kcm] [--rm-dir] [--exit-on-stdin-eof] [-- extra apiserver flags]")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if h.dir == "" {
		fs.Usage()
		return 2
	}
	h.extra = fs.Args()

	if h.stdinEOF {
		go func() {
			_, _ = io.Copy(io.Discard, os.Stdin)
			log.Printf("stdin closed")
			h.requestStop() // same path as an external SIGTERM
		}()
	}

	code := 0
	if err := h.run(); err != nil {
		if errors.Is(err, errStopped) {
			log.Printf("stopped during startup")
		} else {
			log.Printf("error: %v", err)
			code = 1
		}
	}
	if !h.shutdown() && code == 0 {
		code = 1
	}
	log.Printf("exit %d", code)
	return code
}

// requestStop sends SIGTERM to ourselves unless a signal already arrived, so that every trigger
// (signal, stdin EOF, startup failure) reaches the apiserver's handler exactly once.
func (h *harness) requestStop() {
	if h.signalled.CompareAndSwap(false, true) {
		_ = syscall.Kill(os.Getpid(), syscall.SIGTERM)
	}
}

func (h *harness) stopped() bool {
	select {
	case <-h.stop:
		return true
	default:
		return false
	}
}

func (h *harness) path(p ...string) string { return filepath.Join(append([]string{h.dir}, p...)...) }

func (h *harness) run() error {
	start := time.Now()
	var err error
	if h.dir, err = filepath.Abs(h.dir); err != nil {
		return err
	}
	if err := os.MkdirAll(h.dir, 0o700); err != nil {
		return err
	}
	_ = os.Chmod(h.dir, 0o700)
	if h.tok, err = ensureTokens(h.path("tokens.csv")); err != nil {
		return err
	}
	if err := ensureSAKey(h.path("sa.key")); err != nil {
		return err
	}
	if err := ensurePKI(h.path("pki")); err != nil {
		return err
	}
	if err := h.startEtcd(); err != nil {
		return err
	}
	if err := h.startAPIServer(); err != nil {
		return err
	}
	log.Printf("apiserver ready on https://127.0.0.1:%d after %.1fs", h.p.APIServer, time.Since(start).Seconds())

	server := fmt.Sprintf("https://127.0.0.1:%d", h.p.APIServer)
	h.kubeconfig, h.kubeconfigUser = h.path("kubeconfig"), h.path("kubeconfig-user")
	if err := writeKubeconfig(h.kubeconfig, server, h.path("pki", "ca.crt"), "admin", h.tok.admin); err != nil {
		return err
	}
	if err := writeKubeconfig(h.kubeconfigUser, server, h.path("pki", "ca.crt"), "e2e-user", h.tok.user); err != nil {
		return err
	}
	if h.withKCM {
		if err := h.startKCM(); err != nil {
			return err
		}
		log.Printf("kube-controller-manager ready (default ServiceAccount exists) after %.1fs", time.Since(start).Seconds())
	}
	fmt.Printf("READY %s\n", h.kubeconfig) // the only stdout line

	select {
	case <-h.stop:
		return nil
	case <-h.apiExited:
		return fmt.Errorf("apiserver exited unexpectedly with code %d", h.apiCode)
	}
}

// startEtcd mirrors k8s.io/apiserver/pkg/storage/etcd3/testserver (which needs a testing.TB).
// At first start the ports are free ones picked now (retried on bind failure); later the ones in ports.json.
func (h *harness) startEtcd() error {
	for attempt := 1; ; attempt++ {
		p, fresh, err := loadOrPickPorts(h.path("ports.json"))
		if err != nil {
			return err
		}
		cfg := embed.NewConfig()
		cfg.Name = "kharness"
		cfg.Dir = h.path("etcd")
		cfg.UnsafeNoFsync = true // test data only; much faster on slow disks
		cfg.LogLevel = "error"
		cfg.LogOutputs = []string{"stderr"}
		client := url.URL{Scheme: "http", Host: "127.0.0.1:" + strconv.Itoa(p.EtcdClient)}
		peer := url.URL{Scheme: "http", Host: "127.0.0.1:" + strconv.Itoa(p.EtcdPeer)}
		cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{client}, []url.URL{client}
		cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{peer}, []url.URL{peer}
		cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
		e, err := embed.StartEtcd(cfg)
		if err != nil {
			if fresh && attempt < 5 {
				log.Printf("etcd failed on fresh ports (%v), retrying", err)
				_ = os.RemoveAll(cfg.Dir)
				continue
			}
			return fmt.Errorf("start etcd: %w", err)
		}
		h.etcd, h.p = e, p
		break
	}
	select {
	case <-h.etcd.Server.ReadyNotify():
	case <-time.After(60 * time.Second):
		return errors.New("etcd not ready after 60s")
	case <-h.stop:
		return errStopped
	}
	go func() {
		if err := <-h.etcd.Err(); err != nil {
			log.Printf("etcd: %v", err)
		}
	}()
	// Record the ports only once etcd runs on them (the apiserver port was checked free with them).
	return savePorts(h.path("ports.json"), h.p)
}

func (h *harness) startAPIServer() error {
	if h.stopped() {
		return errStopped
	}
	args := []string{
		"--etcd-servers=http://127.0.0.1:" + strconv.Itoa(h.p.EtcdClient),
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file=" + h.path("sa.key"),
		"--service-account-signing-key-file=" + h.path("sa.key"),
		"--advertise-address=127.0.0.1", // else the server needs a default route
		"--bind-address=127.0.0.1",
		"--secure-port=" + strconv.Itoa(h.p.APIServer),
		"--endpoint-reconciler-type=none", // lease/master-count reject a loopback address
		"--cert-dir=" + h.path("pki"),
		"--tls-cert-file=" + h.path("pki", "apiserver.crt"),
		"--tls-private-key-file=" + h.path("pki", "apiserver.key"),
		"--token-auth-file=" + h.path("tokens.csv"),
		"--authorization-mode=Node,RBAC",
		"--service-cluster-ip-range=10.0.0.0/24",
		"--allow-privileged=true",
		"--v=0",
	}
	if !h.withKCM {
		// Only KCM creates the `default` ServiceAccount that this plugin requires for Pods.
		args = append(args, "--disable-admission-plugins=ServiceAccount")
	}
	args = append(args, h.extra...)

	cmd := apiserverapp.NewAPIServerCommand() // installs the process signal handler
	cmd.SetArgs(args)
	cmd.SetOut(os.Stderr) // stdout carries only the READY line
	cmd.SetErr(os.Stderr)
	h.apiExited = make(chan struct{})
	go func() {
		h.apiCode = cli.Run(cmd)
		close(h.apiExited)
	}()
	if h.stopped() {
		// A signal that arrived before the handler existed never reached it.
		_ = syscall.Kill(os.Getpid(), syscall.SIGTERM)
		return errStopped
	}

	pool := x509.NewCertPool()
	ca, err := os.ReadFile(h.path("pki", "ca.crt"))
	if err != nil {
		return err
	}
	pool.AppendCertsFromPEM(ca)
	// Verifies the CA file that the kubeconfigs name, for https://127.0.0.1:P.
	h.client = &http.Client{
		Timeout:   5 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}},
	}
	deadline := time.Now().Add(120 * time.Second)
	for _, path := range []string{"/readyz", "/api/v1/namespaces/default"} {
		if err := h.waitOK(path, deadline); err != nil {
			return err
		}
	}
	return nil
}

// waitOK polls GET path with the admin token until 200, a signal, the apiserver exiting, or deadline.
func (h *harness) waitOK(path string, deadline time.Time) error {
	last := "no response"
	for {
		req, _ := http.NewRequest("GET", fmt.Sprintf("https://127.0.0.1:%d%s", h.p.APIServer, path), nil)
		req.Header.Set("Authorization", "Bearer "+h.tok.admin)
		resp, err := h.client.Do(req)
		if err != nil {
			last = err.Error()
		} else {
			body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			last = fmt.Sprintf("%s: %s", resp.Status, body)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("GET %s not OK after 120s; last response: %s", path, last)
		}
		select {
		case <-h.stop:
			return errStopped
		case <-h.apiExited:
			return fmt.Errorf("apiserver exited with code %d during startup", h.apiCode)
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// startKCM runs `kharness kcm` as a child and waits for the `default` ServiceAccount.
func (h *harness) startKCM() error {
	self, err := os.Executable()
	if err != nil {
		return err
	}
	cmd := exec.Command(self, "kcm", "--kubeconfig="+h.kubeconfig, "--root-ca-file="+h.path("pki", "ca.crt"))
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	// Pdeathsig: the child dies with us even if we are SIGKILLed.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	started := make(chan error, 1)
	h.kcmExited = make(chan struct{})
	go func() {
		// Pdeathsig fires when the forking OS *thread* exits, not the process: lock this goroutine
		// to its thread and keep it alive (in Wait) for the child's whole life.
		runtime.LockOSThread()
		err := cmd.Start()
		started <- err
		if err == nil {
			err = cmd.Wait()
			if !h.stopped() {
				log.Printf("kube-controller-manager exited unexpectedly: %v", err)
			}
		}
		close(h.kcmExited)
	}()
	if err := <-started; err != nil {
		return fmt.Errorf("start kube-controller-manager: %w", err)
	}
	h.kcmCmd = cmd
	return h.waitOK("/api/v1/namespaces/default/serviceaccounts/default", time.Now().Add(120*time.Second))
}

// shutdown follows spec §2.8: KCM (SIGTERM, 10 s, SIGKILL), apiserver (≤ 30 s), etcd, D.
// It returns false if something did not stop in time.
func (h *harness) shutdown() bool {
	ok := true
	if h.apiExited != nil {
		select {
		case <-h.apiExited:
		default:
			h.requestStop() // startup failure: stop the apiserver through its own handler
		}
	}
	if h.kcmCmd != nil {
		_ = h.kcmCmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-h.kcmExited:
		case <-time.After(10 * time.Second):
			log.Printf("kube-controller-manager ignored SIGTERM for 10s, killing it")
			_ = h.kcmCmd.Process.Kill()
			<-h.kcmExited
		}
	}
	if h.apiExited != nil {
		select {
		case <-h.apiExited:
		case <-time.After(30 * time.Second):
			log.Printf("apiserver did not stop within 30s")
			ok = false
		}
	}
	if h.etcd != nil {
		done := make(chan struct{})
		go func() { h.etcd.Close(); close(done) }()
		select {
		case <-done:
		case <-time.After(15 * time.Second):
			log.Printf("etcd did not close within 15s")
			ok = false
		}
	}
	if h.rmDir && h.dir != "" {
		if err := os.RemoveAll(h.dir); err != nil {
			log.Printf("remove %s: %v", h.dir, err)
			ok = false
		}
	}
	return ok
}
