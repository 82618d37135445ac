package controlserver_test

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/controlserver"
	"github.com/egressd/egressd/pkg/control"
)

func TestClientNotRunning(t *testing.T) {
	dir := sockDir(t)
	stale := filepath.Join(dir, "stale.sock")
	staleSocket(t, stale)
	tests := []struct {
		name   string
		client *control.Client
		socket string
	}{
		{"missing socket", &control.Client{Socket: filepath.Join(dir, "missing.sock")}, filepath.Join(dir, "missing.sock")},
		{"nobody listening", &control.Client{Socket: stale}, stale},
	}
	if _, err := os.Lstat(control.DefaultSocket); os.IsNotExist(err) {
		tests = append(tests, struct {
			name   string
			client *control.Client
			socket string
		}{"zero value", &control.Client{}, control.DefaultSocket})
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.client.Get(context.Background(), "status", nil)
			if !errors.Is(err, control.ErrNotRunning) {
				t.Fatalf("error %v, want ErrNotRunning", err)
			}
			var nr *control.NotRunningError
			if !errors.As(err, &nr) || nr.Socket != tt.socket {
				t.Errorf("error %#v, want *NotRunningError for %s", err, tt.socket)
			}
			if want := "is the daemon running? (socket " + tt.socket + ")"; !strings.Contains(err.Error(), want) {
				t.Errorf("message %q, want it to contain %q", err, want)
			}
			if errors.Is(err, control.ErrAccessDenied) {
				t.Errorf("not running also matches access denied")
			}
		})
	}
}

func TestClientCustomDial(t *testing.T) {
	h := start(t, controlserver.Config{})
	var dials atomic.Int32
	c := &control.Client{Dial: func(ctx context.Context) (net.Conn, error) {
		dials.Add(1)
		var d net.Dialer
		return d.DialContext(ctx, "unix", h.sock)
	}}
	defer c.CloseIdleConnections()
	var got whoami
	if err := c.Get(context.Background(), "whoami", &got); err != nil {
		t.Fatal(err)
	}
	if dials.Load() == 0 || got.Access == "" {
		t.Errorf("dials %d, answer %+v", dials.Load(), got)
	}
	refused := &control.Client{Dial: func(context.Context) (net.Conn, error) {
		return nil, &net.OpError{Op: "dial", Net: "unix", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}
	}}
	if err := refused.Get(context.Background(), "whoami", nil); !control.IsNotRunning(err) {
		t.Errorf("custom dial refused: %v, want not running", err)
	}
}

func TestClientTimeout(t *testing.T) {
	h := start(t, controlserver.Config{})
	c := &control.Client{Socket: h.sock, Timeout: 100 * time.Millisecond}
	defer c.CloseIdleConnections()
	begin := time.Now()
	err := c.Get(context.Background(), "slow", nil)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("error %v, want deadline exceeded", err)
	}
	if d := time.Since(begin); d > 5*time.Second {
		t.Errorf("call took %v with a 100ms timeout", d)
	}
}

func TestClientContextCancelled(t *testing.T) {
	h := start(t, controlserver.Config{})
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(50*time.Millisecond, cancel)
	if err := h.client.Get(ctx, "slow", nil); !errors.Is(err, context.Canceled) {
		t.Errorf("error %v, want context canceled", err)
	}
}

func TestClientLenientAnswers(t *testing.T) {
	h := start(t, controlserver.Config{})
	// The answer has fields this type lacks (peer, access): a newer daemon
	// adding fields must not break an older client.
	var partial struct {
		Access string `json:"access"`
	}
	if err := h.client.Get(context.Background(), "whoami", &partial); err != nil || partial.Access == "" {
		t.Errorf("partial decode: %v %+v", err, partial)
	}
	var raw json.RawMessage
	if err := h.client.Do(context.Background(), "GET", "/whoami", nil, &raw); err != nil || !json.Valid(raw) {
		t.Errorf("raw answer with a leading slash in the route: %v %q", err, raw)
	}
}

func TestStream(t *testing.T) {
	h := start(t, controlserver.Config{})
	var seqs []int
	err := h.client.Stream(context.Background(), "events", func(m json.RawMessage) error {
		var ev struct{ Seq int }
		if err := json.Unmarshal(m, &ev); err != nil {
			return err
		}
		seqs = append(seqs, ev.Seq)
		return nil
	})
	if err != nil || len(seqs) != 3 || seqs[0] != 0 || seqs[2] != 2 {
		t.Errorf("stream: %v, got %v, want [0 1 2]", err, seqs)
	}
}

// TestLimitsQueryValues: a query comes back as it was sent, and a max
// that is no count of rules is refused.
func TestLimitsQueryValues(t *testing.T) {
	for _, q := range []control.LimitsQuery{
		{},
		{State: control.StatePending, Shape: "per_second", Name: "pay-*", Dest: "10.0.0.0/8", Source: "cli", Sort: control.SortBusy, Max: 20},
	} {
		got, err := control.ParseLimitsQuery(q.Values())
		if err != nil || got != q {
			t.Errorf("ParseLimitsQuery(%v) = %+v, %v; want %+v", q.Values(), got, err, q)
		}
	}
	for _, bad := range []string{"-1", "x", "1.5"} {
		if _, err := control.ParseLimitsQuery(url.Values{"max": {bad}}); !errors.Is(err, control.ErrInvalid) {
			t.Errorf("max %q: %v, want invalid", bad, err)
		}
	}
}

// TestStreamSkipsKeepalives: the empty lines a stream sends to find a
// peer that left are no values to the client; values queued without a
// flush reach it when the handler returns.
func TestStreamSkipsKeepalives(t *testing.T) {
	h := start(t, controlserver.Config{})
	for _, route := range []string{"events?keepalive=1", "events?queue=1"} {
		var got []string
		err := h.client.Stream(context.Background(), route, func(m json.RawMessage) error {
			got = append(got, string(m))
			return nil
		})
		if want := []string{`{"seq":0}`, `{"seq":1}`, `{"seq":2}`}; err != nil || !slices.Equal(got, want) {
			t.Errorf("%s: %v, got %q, want %q", route, err, got, want)
		}
	}
}

func TestStreamFollowUntilCancelled(t *testing.T) {
	h := start(t, controlserver.Config{})
	h.routes.streamDone = make(chan error, 1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	n := 0
	err := h.client.Stream(ctx, "events?follow=1", func(json.RawMessage) error {
		if n++; n == 5 {
			cancel()
		}
		return nil
	})
	if !errors.Is(err, context.Canceled) || n < 5 {
		t.Errorf("stream: %v after %d values, want context canceled after 5", err, n)
	}
	select {
	case <-h.routes.streamDone: // the handler saw the client go
	case <-time.After(5 * time.Second):
		t.Fatal("stream handler still running after the client left")
	}
}

func TestStreamCallbackStops(t *testing.T) {
	h := start(t, controlserver.Config{})
	stop := errors.New("seen enough")
	err := h.client.Stream(context.Background(), "events?follow=1", func(json.RawMessage) error { return stop })
	if err != stop {
		t.Errorf("stream: %v, want the callback's error", err)
	}
}

func TestStreamBroken(t *testing.T) {
	h := start(t, controlserver.Config{})
	n := 0
	err := h.client.Stream(context.Background(), "events?break=1", func(json.RawMessage) error { n++; return nil })
	if err == nil || !strings.Contains(err.Error(), "stream broken") || n != 1 {
		t.Errorf("stream: %v after %d values, want broken after 1", err, n)
	}
}

func TestStreamErrorBeforeStart(t *testing.T) {
	h := start(t, controlserver.Config{})
	err := h.client.Stream(context.Background(), "events?missing=payments", func(json.RawMessage) error { return nil })
	if !errors.Is(err, control.ErrNotFound) || !strings.Contains(err.Error(), `no such rule "payments"`) {
		t.Errorf("stream: %v, want not found", err)
	}
}

func TestShutdownEndsStreams(t *testing.T) {
	h := start(t, controlserver.Config{})
	got := make(chan struct{}, 1)
	result := make(chan error, 1)
	go func() {
		result <- h.client.Stream(context.Background(), "events?follow=1", func(json.RawMessage) error {
			select {
			case got <- struct{}{}:
			default:
			}
			return nil
		})
	}()
	<-got
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := h.srv.Shutdown(ctx); err != nil {
		t.Fatalf("shutdown with a stream open: %v", err)
	}
	select {
	case err := <-result:
		if err != nil {
			t.Errorf("stream ended by shutdown: %v, want a clean end", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("stream still open after shutdown")
	}
}

// syncBuffer is a log sink for the server's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// A client leaving a stream, or Shutdown ending one, is not a failure:
// no error is logged and, on shutdown, the client sees a clean end even
// when the handler returns its context's error.
func TestStreamEndsQuietly(t *testing.T) {
	var logs syncBuffer
	h := start(t, controlserver.Config{Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelError}))})
	h.routes.streamDone = make(chan error, 2)

	ctx, cancel := context.WithCancel(context.Background())
	n := 0
	err := h.client.Stream(ctx, "events?follow=1&ctxerr=1", func(json.RawMessage) error {
		if n++; n == 3 {
			cancel()
		}
		return nil
	})
	if !errors.Is(err, context.Canceled) {
		t.Errorf("client cancel: %v", err)
	}
	<-h.routes.streamDone

	result := make(chan error, 1)
	started := make(chan struct{})
	go func() {
		var once sync.Once
		result <- h.client.Stream(context.Background(), "events?follow=1&ctxerr=1", func(json.RawMessage) error {
			once.Do(func() { close(started) })
			return nil
		})
	}()
	<-started
	sctx, scancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer scancel()
	if err := h.srv.Shutdown(sctx); err != nil {
		t.Fatal(err)
	}
	if err := <-result; err != nil {
		t.Errorf("stream ended by shutdown: %v, want a clean end", err)
	}
	<-h.routes.streamDone
	if s := logs.String(); s != "" {
		t.Errorf("errors logged for streams that ended normally:\n%s", s)
	}
}
