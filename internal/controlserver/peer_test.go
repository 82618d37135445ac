//go:build linux

package controlserver_test

import (
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/egressd/egressd/internal/controlserver"
)

const (
	nobody    = 65534
	testGroup = 4242 // numeric, so that no /etc/group entry is needed
)

// helperBinary copies the test binary where an unprivileged user can run
// it (go test builds it in a directory only its owner can enter).
func helperBinary(t *testing.T, dir string) string {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	src, err := os.Open(exe)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	bin := filepath.Join(dir, "control.test")
	dst, err := os.OpenFile(bin, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(dst, src); err != nil {
		t.Fatal(err)
	}
	if err := dst.Close(); err != nil {
		t.Fatal(err)
	}
	return bin
}

// callAs runs one client call in a child process with the given
// credentials and returns its result and pid.
func callAs(t *testing.T, bin string, cred *syscall.Credential, sock, method, route string, body ...string) (callResult, int) {
	t.Helper()
	cmd := exec.Command(bin, append([]string{sock, method, route}, body...)...)
	cmd.Env = append(os.Environ(), helperEnv+"=call")
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred, Pdeathsig: syscall.SIGKILL}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("helper as uid %d: %v\n%s", cred.Uid, err, stderr.String())
	}
	var res callResult
	if err := json.Unmarshal(out, &res); err != nil {
		t.Fatalf("helper output %q: %v", out, err)
	}
	return res, cmd.Process.Pid
}

// Real processes under other uids, through the kernel's credentials: the
// path a non-root operator and a service's SDK take.
func TestRealNonRootPeers(t *testing.T) {
	requireRoot(t)
	dir := sockDir(t)
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	bin := helperBinary(t, dir)
	sock := func(name string) string { return filepath.Join(dir, name) }

	// Mode widened to 0666: anyone connects and reads; nobody may write.
	open := start(t, controlserver.Config{Socket: sock("open.sock"), Mode: 0o666})
	nobodyCred := &syscall.Credential{Uid: nobody, Gid: nobody}

	res, pid := callAs(t, bin, nobodyCred, open.sock, "GET", "whoami")
	var who whoami
	if res.Kind != "ok" || json.Unmarshal(res.Body, &who) != nil {
		t.Fatalf("whoami as nobody: %+v", res)
	}
	if who.Peer.UID != nobody || who.Peer.GID != nobody || who.Peer.PID != int32(pid) || who.Access != "read" {
		t.Errorf("whoami as nobody (pid %d) = %+v, want uid/gid %d, that pid, read", pid, who, nobody)
	}
	if len(who.Peer.Groups) != 0 {
		t.Errorf("nobody's supplementary groups = %v, want none", who.Peer.Groups)
	}
	res, _ = callAs(t, bin, nobodyCred, open.sock, "POST", "echo", `{"name":"x"}`)
	if res.Kind != "denied" || !strings.Contains(res.Err, "needs root") {
		t.Errorf("write as nobody: %+v, want denied saying who may write", res)
	}
	if n := open.routes.called("echo"); n != 0 {
		t.Errorf("write handler ran %d times for a read-only peer", n)
	}

	// Default mode 0660 with a group: members connect and write, primary
	// or supplementary; others cannot even connect.
	grouped := start(t, controlserver.Config{Socket: sock("grouped.sock"), Group: "4242"})
	fi, err := os.Stat(grouped.sock)
	if err != nil {
		t.Fatal(err)
	}
	if st := fi.Sys().(*syscall.Stat_t); fi.Mode().Perm() != 0o660 || st.Gid != testGroup {
		t.Errorf("socket mode %v gid %d, want 0660 gid %d", fi.Mode().Perm(), st.Gid, testGroup)
	}
	var many []uint32 // more than fit SO_PEERGROUPS's first buffer
	for g := range uint32(100) {
		many = append(many, 5000+g)
	}
	members := map[string]*syscall.Credential{
		"supplementary": {Uid: nobody, Gid: nobody, Groups: []uint32{100, testGroup}},
		"primary":       {Uid: nobody, Gid: testGroup},
		"many groups":   {Uid: nobody, Gid: nobody, Groups: append(many, testGroup)},
	}
	for name, cred := range members {
		t.Run(name, func(t *testing.T) {
			res, _ := callAs(t, bin, cred, grouped.sock, "GET", "whoami")
			if res.Kind != "ok" || json.Unmarshal(res.Body, &who) != nil || who.Access != "write" {
				t.Errorf("whoami as group member: %+v, want write access", res)
			}
			res, _ = callAs(t, bin, cred, grouped.sock, "POST", "echo", `{"name":"x"}`)
			if res.Kind != "ok" || !strings.Contains(string(res.Body), `"name":"x"`) {
				t.Errorf("write as group member: %+v", res)
			}
		})
	}
	res, _ = callAs(t, bin, nobodyCred, grouped.sock, "GET", "whoami")
	if res.Kind != "denied" || !strings.Contains(res.Err, "permission denied on egressd's socket "+grouped.sock) {
		t.Errorf("connect as non-member: %+v, want denied by the socket's permissions", res)
	}
}
