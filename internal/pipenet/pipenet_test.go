package pipenet_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/internal/pipenet"
)

// An HTTP server and client on a Network run in a bubble: the handler's
// second of fake time passes at once, and a dial to an address nobody
// listens on is refused.
func TestHTTPInABubble(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var n pipenet.Network
		l, err := n.Listen("api.test:80")
		if err != nil {
			t.Fatal(err)
		}
		srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if clocktest.Latency(r.Context(), time.Second) == nil {
				io.WriteString(w, "ok")
			}
		})}
		go srv.Serve(l)
		defer srv.Close()
		tr := &http.Transport{DialContext: n.DialContext}
		defer tr.CloseIdleConnections()
		c := &http.Client{Transport: tr}

		start := time.Now()
		resp, err := c.Get("http://api.test/")
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || string(b) != "ok" || time.Since(start) != time.Second {
			t.Fatalf("GET = %q, %v after %v; want ok after 1s", b, err, time.Since(start))
		}
		if _, err := c.Get("http://other.test/"); !errors.Is(err, syscall.ECONNREFUSED) {
			t.Fatalf("GET of an address nobody listens on = %v; want ECONNREFUSED", err)
		}
		if _, err := n.Listen("api.test:80"); !errors.Is(err, syscall.EADDRINUSE) {
			t.Fatalf("a second Listen on the address = %v; want EADDRINUSE", err)
		}
		l.Close()
		if _, err := n.DialContext(context.Background(), "tcp", "api.test:80"); !errors.Is(err, syscall.ECONNREFUSED) {
			t.Fatalf("dial once the listener is closed = %v; want ECONNREFUSED", err)
		}
	})
}
