package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"io"
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
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"k8s.io/component-base/cli"
	"k8s.io/klog/v2"
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
	ctx                        context.Context
	cancel                     context.CancelFunc // called with close(stop): aborts in-flight probes
	etcd                       *embed.Etcd
	etcdLevel                  zap.AtomicLevel // error; raised to fatal before Close, which logs closed listeners as errors
	apiExited                  chan struct{}   // nil until the apiserver goroutine runs
	apiCode                    int
	kcmCmd                     *exec.Cmd
	kcmExited                  chan struct{}
	client                     *http.Client
	kubeconfig, kubeconfigUser string
}

var errStopped = errors.New("stopped by signal")

func serve(args []string) int {
	h := &harness{stop: make(chan struct{}), etcdLevel: zap.NewAtomicLevelAt(zapcore.ErrorLevel)}
	h.ctx, h.cancel = context.WithCancel(context.Background())
	// A signal during startup cancels the apiserver's context; a post-start hook then fails and
	// the apiserver calls klog.Fatal, i.e. klog.OsExit(255), skipping our shutdown. Still leave no
	// child or D behind; ports die with the process. Exit 0 if a stop was requested.
	klog.OsExit = func(code int) {
		if h.kcmCmd != nil {
			_ = h.kcmCmd.Process.Kill()
		}
		if h.rmDir && h.dir != "" {
			_ = os.RemoveAll(h.dir)
		}
		if h.stopped() {
			logger.Printf("apiserver aborted while stopping during startup; exit 0")
			code = 0
		}
		os.Exit(code)
	}

	// Register our own channel before anything else: until the apiserver installs its handler a
	// signal would otherwise kill us with the default action and leak D with --rm-dir. We never
	// call SetupSignalContext ourselves: the apiserver's NewAPIServerCommand does, and a second one panics.
	sig := make(chan os.Signal, 4)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		s := <-sig
		h.signalled.Store(true)
		logger.Printf("received %v, shutting down", s)
		close(h.stop)
		h.cancel()
		for s := range sig {
			logger.Printf("received %v again (the apiserver handler exits with 1 on a second signal)", s)
		}
	}()

	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.StringVar(&h.dir, "dir", "", "state directory D (created 0700, reused if it exists)")
	fs.BoolVar(&h.withKCM, "with-kcm", false, "also run kube-controller-manager (GC, namespaces, ServiceAccounts)")
	fs.BoolVar(&h.rmDir, "rm-dir", false, "remove D on exit")
	fs.BoolVar(&h.stdinEOF, "exit-on-stdin-eof", false, "shut down when stdin reaches EOF")
	verbose := fs.Bool("verbose", false, "keep info-level apiserver/KCM logs (sets KHARNESS_VERBOSE=1 for the KCM child)")
	fs.Usage = func() {
		fmt.Fprintln(os.Stderr, "usage: kharness serve --dir D [--with-kcm] [--rm-dir] [--exit-on-stdin-eof] [--verbose] [-- extra apiserver flags]")
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
	if *verbose {
		_ = os.Setenv("KHARNESS_VERBOSE", "1")
	}

	if h.stdinEOF {
		go func() {
			_, _ = io.Copy(io.Discard, os.Stdin)
			logger.Printf("stdin closed")
			h.requestStop() // same path as an external SIGTERM
		}()
	}

	code := 0
	if err := h.run(); err != nil {
		if errors.Is(err, errStopped) {
			logger.Printf("stopped during startup")
		} else {
			logger.Printf("error: %v", err)
			code = 1
		}
	}
	if !h.shutdown() && code == 0 {
		code = 1
	}
	logger.Printf("exit %d", code)
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
	logger.Printf("apiserver ready on https://127.0.0.1:%d after %.1fs", h.p.APIServer, time.Since(start).Seconds())

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
		logger.Printf("kube-controller-manager ready (controllers running) after %.1fs", time.Since(start).Seconds())
	}
	fmt.Fprintf(stdout, "READY %s\n", h.kubeconfig) // the only stdout line

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
		cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(zap.New(zapcore.NewCore(
			zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig()), zapcore.Lock(os.Stderr), h.etcdLevel)))
		client := url.URL{Scheme: "http", Host: "127.0.0.1:" + strconv.Itoa(p.EtcdClient)}
		peer := url.URL{Scheme: "http", Host: "127.0.0.1:" + strconv.Itoa(p.EtcdPeer)}
		cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{client}, []url.URL{client}
		cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{peer}, []url.URL{peer}
		cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
		e, err := embed.StartEtcd(cfg)
		if err != nil {
			if fresh && attempt < 5 {
				logger.Printf("etcd failed on fresh ports (%v), retrying", err)
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
			logger.Printf("etcd: %v", err)
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
	args = append(args, quietLogFlags()...)
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
		req, _ := http.NewRequestWithContext(h.ctx, "GET", fmt.Sprintf("https://127.0.0.1:%d%s", h.p.APIServer, path), nil)
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
	// On a reused D the `default` ServiceAccount already exists and proves nothing. Deleting
	// kube-public/kube-root-ca.crt before KCM starts and waiting for it to be published again shows
	// that KCM's controllers run, on any start. The ConfigMap is recreated with the same CA.
	const rootCA = "/api/v1/namespaces/kube-public/configmaps/kube-root-ca.crt"
	if err := h.deleteIfExists(rootCA); err != nil {
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
				logger.Printf("kube-controller-manager exited unexpectedly: %v", err)
			}
		}
		close(h.kcmExited)
	}()
	if err := <-started; err != nil {
		return fmt.Errorf("start kube-controller-manager: %w", err)
	}
	h.kcmCmd = cmd
	deadline := time.Now().Add(120 * time.Second)
	for _, path := range []string{"/api/v1/namespaces/default/serviceaccounts/default", rootCA} {
		if err := h.waitOK(path, deadline); err != nil {
			return err
		}
	}
	return nil
}

func (h *harness) deleteIfExists(path string) error {
	req, _ := http.NewRequestWithContext(h.ctx, "DELETE", fmt.Sprintf("https://127.0.0.1:%d%s", h.p.APIServer, path), nil)
	req.Header.Set("Authorization", "Bearer "+h.tok.admin)
	resp, err := h.client.Do(req)
	if err != nil {
		return err
	}
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK && resp.StatusCode != http.StatusNotFound {
		return fmt.Errorf("DELETE %s: %s: %s", path, resp.Status, body)
	}
	return nil
}

// shutdown, in this order (e2e/README-kharness.md): KCM (SIGTERM, 10 s, SIGKILL), apiserver
// (≤ 30 s), etcd, D.
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
			logger.Printf("kube-controller-manager ignored SIGTERM for 10s, killing it")
			_ = h.kcmCmd.Process.Kill()
			<-h.kcmExited
		}
	}
	if h.apiExited != nil {
		select {
		case <-h.apiExited:
		case <-time.After(30 * time.Second):
			logger.Printf("apiserver did not stop within 30s")
			ok = false
		}
	}
	if h.etcd != nil {
		done := make(chan struct{})
		h.etcdLevel.SetLevel(zapcore.FatalLevel)
		go func() { h.etcd.Close(); close(done) }()
		select {
		case <-done:
		case <-time.After(15 * time.Second):
			logger.Printf("etcd did not close within 15s")
			ok = false
		}
	}
	if h.rmDir && h.dir != "" {
		if err := os.RemoveAll(h.dir); err != nil {
			logger.Printf("remove %s: %v", h.dir, err)
			ok = false
		}
	}
	return ok
}
