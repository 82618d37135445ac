package daemon

import (
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/egressd/egressd/pkg/control"
)

// Peers as the control server sees them when the daemon runs as root:
// uid 0 writes, any other uid without the socket's group only reads.
var (
	writerPeer = control.Peer{PID: 4241, UID: 0, GID: 0}
	readerPeer = control.Peer{PID: 4242, UID: 1234, GID: 1234}
)

// serveAs answers a GET of route for peer, through the control server's
// access checks, and returns the status and body.
func (td *testDaemon) serveAs(t *testing.T, peer control.Peer, route string) (int, string) {
	t.Helper()
	srv, err := control.NewServer(control.Config{Routes: td.routes(), Logger: td.log})
	if err != nil {
		t.Fatal(err)
	}
	rec := httptest.NewRecorder()
	req := httptest.NewRequest("GET", control.Prefix+route, nil)
	srv.ServeHTTP(rec, req.WithContext(control.WithPeer(req.Context(), peer)))
	return rec.Code, rec.Body.String()
}

// TestLimitsHideRedisPasswordsFromReaders: a shared rule's Redis
// passwords, the user's and a Sentinel primary's, are hidden from a caller
// who may only read; a writer sees the rule whole, to set it again.
func TestLimitsHideRedisPasswordsFromReaders(t *testing.T) {
	td := newTestDaemon(t)
	td.apply(t, "rules:\n  - {name: s, destination: 10.0.0.1, port: 80, concurrency: 10, shared: {redis: \"redis+sentinel://user:s3cret@127.0.0.1:1/0?master_name=m&password=pr1mary\", key: k, replicas: 1}}\n")
	tests := []struct {
		name, route  string
		peer         control.Peer
		want, hidden string
	}{
		{"reader, every rule", "limits", readerPeer, "user:xxxxx@", "s3cret"},
		{"reader, every rule, the primary's", "limits", readerPeer, "password=xxxxx", "pr1mary"},
		{"reader, one rule", "limit?name=s", readerPeer, "user:xxxxx@", "s3cret"},
		{"reader, one rule, the primary's", "limit?name=s", readerPeer, "password=xxxxx", "pr1mary"},
		{"writer, every rule", "limits", writerPeer, "user:s3cret@", "xxxxx"},
		{"writer, one rule", "limit?name=s", writerPeer, "password=pr1mary", "xxxxx"},
	}
	for _, tt := range tests {
		status, body := td.serveAs(t, tt.peer, tt.route)
		if status != 200 || !strings.Contains(body, tt.want) || strings.Contains(body, tt.hidden) {
			t.Errorf("%s: status %d, body %s; want %q in it and no %q", tt.name, status, body, tt.want, tt.hidden)
		}
	}
}
