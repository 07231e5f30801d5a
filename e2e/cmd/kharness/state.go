package main

// Persistent state under D: ports, keys, tokens, certificates. Everything is created once and
// reused when D is kept, so a restarted cluster has the same address and old kubeconfigs work.

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"
)

type ports struct {
	EtcdClient int `json:"etcdClient"`
	EtcdPeer   int `json:"etcdPeer"`
	APIServer  int `json:"apiserver"`
}

// loadOrPickPorts returns the ports in D/ports.json, or picks free loopback ports (fresh=true).
// The file is written only by savePorts, after etcd started on them.
func loadOrPickPorts(path string) (p ports, fresh bool, err error) {
	b, err := os.ReadFile(path)
	if err == nil {
		err = json.Unmarshal(b, &p)
		return p, false, err
	}
	if !errors.Is(err, os.ErrNotExist) {
		return p, false, err
	}
	p, err = pickPorts()
	return p, true, err
}

// pickPorts holds all listeners open at once so the three ports are distinct.
func pickPorts() (ports, error) {
	var got []int
	for range 3 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return ports{}, err
		}
		defer l.Close()
		got = append(got, l.Addr().(*net.TCPAddr).Port)
	}
	return ports{EtcdClient: got[0], EtcdPeer: got[1], APIServer: got[2]}, nil
}

func savePorts(path string, p ports) error {
	b, _ := json.MarshalIndent(p, "", "  ")
	return writeFileAtomic(path, append(b, '\n'))
}

func writeFileAtomic(path string, data []byte) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

func exists(path string) bool { _, err := os.Stat(path); return err == nil }

func randToken() string {
	b := make([]byte, 24)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

type tokens struct{ admin, user string }

// ensureTokens reads or creates D/tokens.csv (format token,user,uid,"groups").
func ensureTokens(path string) (tokens, error) {
	if !exists(path) {
		t := tokens{admin: randToken(), user: randToken()}
		csv := fmt.Sprintf("%s,admin,admin,\"system:masters\"\n%s,e2e-user,e2e-user\n", t.admin, t.user)
		if err := writeFileAtomic(path, []byte(csv)); err != nil {
			return t, err
		}
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return tokens{}, err
	}
	var t tokens
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Split(line, ",")
		if len(f) < 2 {
			continue
		}
		switch f[1] {
		case "admin":
			t.admin = f[0]
		case "e2e-user":
			t.user = f[0]
		}
	}
	if t.admin == "" || t.user == "" {
		return t, fmt.Errorf("%s lacks admin or e2e-user", path)
	}
	return t, nil
}

func newKey() (*ecdsa.PrivateKey, []byte, error) {
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	der, err := x509.MarshalECPrivateKey(k)
	return k, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der}), err
}

// ensureSAKey creates D/sa.key (ECDSA P-256): it both signs and verifies ServiceAccount tokens.
func ensureSAKey(path string) error {
	if exists(path) {
		return nil
	}
	_, pemKey, err := newKey()
	if err != nil {
		return err
	}
	return writeFileAtomic(path, pemKey)
}

// ensurePKI creates our own CA (pki/ca.crt) and a serving cert signed by it (pki/apiserver.crt,
// leaf followed by the CA). We do not let the apiserver self-sign: clients such as rustls/webpki
// need a real v3 CA (basicConstraints CA:true) as trust anchor and a non-CA leaf with IP SANs.
func ensurePKI(dir string) error {
	caCrt, crt, key := filepath.Join(dir, "ca.crt"), filepath.Join(dir, "apiserver.crt"), filepath.Join(dir, "apiserver.key")
	if exists(caCrt) && exists(crt) && exists(key) {
		return nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	now := time.Now()
	caKey, caKeyPEM, err := newKey()
	if err != nil {
		return err
	}
	caTmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: "kharness-ca"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.AddDate(10, 0, 0),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return err
	}
	ca, _ := x509.ParseCertificate(caDER)
	leafKey, leafKeyPEM, err := newKey()
	if err != nil {
		return err
	}
	leafTmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: "kube-apiserver"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.AddDate(10, 0, 0),
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
		DNSNames: []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
			"kubernetes.default.svc.cluster.local"},
		// 10.0.0.1: first IP of --service-cluster-ip-range, the in-cluster `kubernetes` Service.
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1"), net.ParseIP("::1"), net.ParseIP("10.0.0.1")},
	}
	leafDER, err := x509.CreateCertificate(rand.Reader, leafTmpl, ca, &leafKey.PublicKey, caKey)
	if err != nil {
		return err
	}
	caPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER})
	leafPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: leafDER})
	for _, f := range []struct {
		path string
		data []byte
	}{
		{filepath.Join(dir, "ca.key"), caKeyPEM},
		{caCrt, caPEM},
		{key, leafKeyPEM},
		{crt, append(leafPEM, caPEM...)},
	} {
		if err := writeFileAtomic(f.path, f.data); err != nil {
			return err
		}
	}
	return nil
}

func serial() *big.Int {
	n, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	return n
}

// writeKubeconfig writes a token kubeconfig; certificate-authority is a path to D/pki/ca.crt.
func writeKubeconfig(path, server, caFile, user, token string) error {
	cfg := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: kharness
  cluster:
    server: %s
    certificate-authority: %s
users:
- name: %s
  user:
    token: %s
contexts:
- name: kharness
  context:
    cluster: kharness
    user: %s
current-context: kharness
`, server, caFile, user, token, user)
	return writeFileAtomic(path, []byte(cfg))
}
