// Package k8stest runs a real Kubernetes API server for tests: Debian's
// etcd (etcd-server) and kube-apiserver built from the module in
// ./apiserver, both on free loopback ports, stopped when the test ends.
package k8stest

import (
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/internal/testport"
)

// Server is an API server a test started.
type Server struct {
	// URL is where it serves, https://127.0.0.1:PORT.
	URL string
	// Token is a bearer token of a member of system:masters.
	Token string
	// CA is the certificate it serves with (self-signed).
	CA *x509.CertPool
	// Kubeconfig is a file kubectl reaches it with, as the admin.
	Kubeconfig string

	t        testing.TB // Start's, which outlives the subtests using s
	dir, bin string
	args     []string
	api      *proc
}

// Start starts etcd and kube-apiserver and stops them in t.Cleanup. The
// first call on a machine builds kube-apiserver (minutes); later ones
// reuse the build while ./apiserver's go.sum is the same.
func Start(t testing.TB) *Server {
	t.Helper()
	if _, err := exec.LookPath("etcd"); err != nil {
		t.Skip("etcd not installed: these tests need a real one (apt-get install etcd-server)")
	}
	bin := build(t)
	dir := t.TempDir()
	client, peer := testport.Free(t), testport.Free(t)
	etcdURL := "http://127.0.0.1:" + strconv.Itoa(client)
	start(t, dir, "etcd.log", "etcd", "--data-dir", filepath.Join(dir, "etcd"),
		"--listen-client-urls", etcdURL, "--advertise-client-urls", etcdURL,
		"--listen-peer-urls", "http://127.0.0.1:"+strconv.Itoa(peer))

	s := &Server{Token: "egressd-test-admin", t: t, dir: dir, bin: bin}
	tokens := filepath.Join(dir, "tokens.csv")
	if err := os.WriteFile(tokens, []byte(s.Token+",admin,admin,system:masters\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	saKey := filepath.Join(dir, "sa.key")
	if out, err := exec.Command("openssl", "genrsa", "-out", saKey, "2048").CombinedOutput(); err != nil {
		t.Fatalf("service account key: %v: %s", err, out)
	}
	port := testport.Free(t)
	s.URL = "https://127.0.0.1:" + strconv.Itoa(port)
	certs := filepath.Join(dir, "certs")
	// Its address stays on loopback: the endpoint reconciler refuses a
	// loopback address, and without one would take the host's.
	s.args = []string{"--etcd-servers", etcdURL,
		"--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1", "--endpoint-reconciler-type", "none", "--secure-port", strconv.Itoa(port),
		"--cert-dir", certs, "--token-auth-file", tokens, "--authorization-mode", "RBAC",
		"--service-account-issuer", "https://kubernetes.default.svc",
		"--service-account-key-file", saKey, "--service-account-signing-key-file", saKey}
	s.api = start(t, dir, "kube-apiserver.log", bin, s.args...)

	var pem []byte
	clocktest.Eventually(t, "kube-apiserver's certificate", func() bool {
		var err error
		if pem, err = os.ReadFile(filepath.Join(certs, "apiserver.crt")); err != nil {
			return false
		}
		s.CA = x509.NewCertPool()
		return s.CA.AppendCertsFromPEM(pem)
	})
	s.Kubeconfig = filepath.Join(dir, "kubeconfig")
	kubeconfig := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters: [{name: test, cluster: {server: %q, certificate-authority-data: %q}}]
users: [{name: admin, user: {token: %q}}]
contexts: [{name: test, context: {cluster: test, user: admin}}]
current-context: test
`, s.URL, base64.StdEncoding.EncodeToString(pem), s.Token)
	if err := os.WriteFile(s.Kubeconfig, []byte(kubeconfig), 0o600); err != nil {
		t.Fatal(err)
	}
	s.waitReady(t)
	return s
}

func (s *Server) waitReady(t testing.TB) {
	t.Helper()
	clocktest.Eventually(t, "kube-apiserver ready", func() bool {
		resp, err := s.Get("/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
}

// StopAPI kills kube-apiserver, as a control plane that goes away does;
// etcd keeps what it stored.
func (s *Server) StopAPI() { s.api.stop() }

// StartAPI starts kube-apiserver again, on the same address and with the
// same certificate, and waits until it is ready. Its log goes on where
// the last one ended; it is stopped when Start's test ends.
func (s *Server) StartAPI(t testing.TB) {
	t.Helper()
	s.api = start(s.t, s.dir, "kube-apiserver.log", s.bin, s.args...)
	s.waitReady(t)
}

// Kubectl runs kubectl against the server as the admin, and returns
// what it wrote.
func (s *Server) Kubectl(args ...string) (string, error) {
	cmd := exec.Command("kubectl", append([]string{"--kubeconfig", s.Kubeconfig}, args...)...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// Get asks the server for path as the admin.
func (s *Server) Get(path string) (*http.Response, error) {
	req, err := http.NewRequest(http.MethodGet, s.URL+path, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Authorization", "Bearer "+s.Token)
	c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: s.CA}}}
	return c.Do(req)
}

// proc is a server process a test started.
type proc struct {
	cmd  *exec.Cmd
	log  *os.File
	once sync.Once
}

// stop kills it and waits for it, once.
func (p *proc) stop() {
	p.once.Do(func() {
		p.cmd.Process.Kill()
		p.cmd.Wait()
		p.log.Close()
	})
}

// start runs a server process with its output appended to dir/log, and
// stops it when the test ends.
func start(t testing.TB, dir, log, bin string, args ...string) *proc {
	t.Helper()
	f, err := os.OpenFile(filepath.Join(dir, log), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	p := &proc{cmd: exec.Command(bin, args...), log: f}
	p.cmd.Stdout, p.cmd.Stderr = f, f
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", bin, err)
	}
	t.Cleanup(func() {
		p.stop()
		if t.Failed() {
			if out, err := os.ReadFile(f.Name()); err == nil && len(out) > 0 {
				t.Logf("%s, its end:\n%s", log, tail(out, 4000))
			}
		}
	})
	return p
}

func tail(b []byte, n int) []byte {
	if len(b) > n {
		return b[len(b)-n:]
	}
	return b
}

// build builds kube-apiserver from ./apiserver into the user's cache, once
// per go.sum of that module.
func build(t testing.TB) string {
	t.Helper()
	_, file, _, _ := runtime.Caller(0)
	src := filepath.Join(filepath.Dir(file), "apiserver")
	sum, err := os.ReadFile(filepath.Join(src, "go.sum"))
	if err != nil {
		t.Fatal(err)
	}
	h := sha256.Sum256(sum)
	cache, err := os.UserCacheDir()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(cache, "egressd-test", "kube-apiserver-"+hex.EncodeToString(h[:8]))
	if _, err := os.Stat(bin); err == nil {
		return bin
	}
	tmp := fmt.Sprintf("%s.%d", bin, os.Getpid())
	cmd := exec.Command("go", "build", "-o", tmp, ".")
	cmd.Dir = src
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build kube-apiserver: %v\n%s", err, out)
	}
	// A rename: a build of another test package at the same time
	// leaves one whole binary either way.
	if err := os.Rename(tmp, bin); err != nil {
		t.Fatal(err)
	}
	return bin
}
