//go:build linux

package loader

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/internal/privtest"
)

// TestInFlightRequests follows an HTTP/1.1 keep-alive client through
// requests that each take the server at least 50ms.
func TestInFlightRequests(t *testing.T) {
	d, cg := open(t)
	const work = 50 * time.Millisecond
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	// The server answers when the test says so, after it has looked.
	arrived, respond := make(chan struct{}), make(chan struct{})
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case arrived <- struct{}{}:
		case <-r.Context().Done():
			return
		}
		select {
		case <-respond:
			io.WriteString(w, "done")
		case <-r.Context().Done():
		}
	})}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	dest := netip.MustParseAddrPort(ln.Addr().String())
	put(t, d, Rule{Name: "http", Dests: []netip.Prefix{netip.PrefixFrom(dest.Addr(), 32)}, Port: dest.Port(), Limit: 10, Requests: true, Samples: true})
	samples := openSamples(t, d)

	privtest.Join(t, cg)
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1}}
	t.Cleanup(client.CloseIdleConnections)
	const requests = 20
	var took []time.Duration // each request as the client saw it
	for i := range requests {
		done := make(chan error, 1)
		start := time.Now()
		go func() {
			resp, err := client.Get("http://" + dest.String() + "/")
			if err == nil {
				_, err = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
			done <- err
		}()
		select {
		case <-arrived:
		case err := <-done:
			t.Fatalf("request %d ended before the server saw it: %v", i, err)
		case <-time.After(10 * time.Second):
			t.Fatalf("request %d: the server saw nothing in 10s", i)
		}
		during := stats(t, d, "http")
		// The kernel stamps request and answer on its clock: the least a request takes must pass on it.
		time.Sleep(work)
		select {
		case respond <- struct{}{}:
		case err := <-done:
			t.Fatalf("request %d ended before the answer: %v", i, err)
		}
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		took = append(took, time.Since(start))
		after := stats(t, d, "http")
		if during.InFlight != 1 || after.InFlight != 0 || after.Requests != uint64(i+1) || after.Responses != uint64(i+1) {
			t.Fatalf("request %d: in flight %d during and %d after; requests %d responses %d", i, during.InFlight, after.InFlight, after.Requests, after.Responses)
		}
		// Counts reads the responses of a rule that sent requests.
		if c := counted(t, d, "http"); c.InFlight != 0 || c.Responses != after.Responses {
			t.Fatalf("request %d: Counts says in flight %d, responses %d; Stats %d, %d", i, c.InFlight, c.Responses, after.InFlight, after.Responses)
		}
	}

	var requestSamples, connectSamples []time.Duration
	samples.SetDeadline(time.Now().Add(time.Second))
	for len(requestSamples) < requests || len(connectSamples) < 1 {
		s, err := samples.Read()
		if err != nil {
			t.Fatalf("after %d request and %d connect samples: %v", len(requestSamples), len(connectSamples), err)
		}
		if s.Rule != "http" {
			t.Fatalf("sample of rule %q", s.Rule)
		}
		switch s.Kind {
		case SampleRequest:
			requestSamples = append(requestSamples, s.Latency)
		case SampleConnect:
			connectSamples = append(connectSamples, s.Latency)
		}
	}
	t.Logf("request samples %v; connect %v", requestSamples, connectSamples)
	for i, l := range requestSamples {
		if l < work || l > took[i] {
			t.Errorf("request sample %v, want between %v and the %v the client saw", l, work, took[i])
		}
	}
	s := stats(t, d, "http")
	if s.Admitted != 1 || s.RequestLatency.Count != requests || s.ConnectLatency.Count != 1 {
		t.Fatalf("one keep-alive connection, %d requests: %+v", requests, s)
	}
	lost, err := d.Lost()
	if err != nil || lost != (Lost{}) {
		t.Fatalf("lost %+v, %v", lost, err)
	}

	// Closing mid-request counts an abort and leaves nothing in flight.
	go client.Get("http://" + dest.String() + "/")
	select {
	case <-arrived:
	case <-time.After(10 * time.Second):
		t.Fatal("the request to abort: the server saw nothing in 10s")
	}
	srv.Close()
	s = waitLive(t, d, "http", 0)
	if s.InFlight != 0 || s.Aborted != 1 || s.Requests != requests+1 {
		t.Fatalf("in flight after close: %+v", s)
	}
}

// A request on a connection whose rule was deleted, and whose slot a new
// rule took: neither it nor its answer moves the new rule's in-flight
// count.
func TestInFlightStaysWithItsRule(t *testing.T) {
	privtest.RequireRoot(t)
	cg := privtest.Cgroup(t, "inflight-reuse")
	d, err := Open(&Config{Cgroup: cg, PinDir: privtest.PinDir(t), MaxRules: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Uninstall() })
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	accepted := make(chan net.Conn, 1)
	go func() {
		if c, err := ln.Accept(); err == nil {
			accepted <- c
		}
	}()
	dest := netip.MustParseAddrPort(ln.Addr().String())
	rule := func(name string) Rule {
		return Rule{Name: name, Dests: []netip.Prefix{netip.PrefixFrom(dest.Addr(), 32)}, Port: dest.Port(), Limit: 5, Requests: true}
	}
	put(t, d, rule("old"))
	privtest.Join(t, cg)
	c, err := net.Dial("tcp4", dest.String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var sc net.Conn
	select {
	case sc = <-accepted:
	case <-time.After(10 * time.Second):
		t.Fatal("no connection accepted in 10s")
	}
	defer sc.Close()
	buf := make([]byte, 16)
	roundTrip := func(from, to net.Conn, what string) {
		t.Helper()
		if _, err := io.WriteString(from, what); err != nil {
			t.Fatal(err)
		}
		to.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.ReadFull(to, buf[:len(what)]); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	roundTrip(c, sc, "request")
	if s := stats(t, d, "old"); s.InFlight != 1 {
		t.Fatalf("old rule: in flight %d, want 1 (%+v)", s.InFlight, s)
	}

	if err := d.Delete("old"); err != nil {
		t.Fatal(err)
	}
	put(t, d, rule("new"))
	roundTrip(sc, c, "answer")
	roundTrip(c, sc, "another request")
	c.Close()
	// The client's FIN reaches the server after every program its close
	// runs has run.
	sc.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.Copy(io.Discard, sc); err != nil {
		t.Fatalf("the server waiting for the client's close: %v", err)
	}
	if s := stats(t, d, "new"); s.InFlight != 0 || s.Requests != 0 || s.Responses != 0 || s.Aborted != 0 {
		t.Fatalf("new rule counted the old rule's connection: %+v", s)
	}
}

// Responses are counted apart from the rule's other counters: the totals
// add the rule state's own count, which is what a build before that
// counted (an upgrade keeps it), and a resize carries both.
func TestResponsesCountedApart(t *testing.T) {
	d, cg := open(t)
	echo := echoServer(t)
	put(t, d, Rule{Name: "echo", Dests: []netip.Prefix{netip.PrefixFrom(echo.Addr(), 32)}, Port: echo.Port(), Limit: 10, Requests: true})
	idx := d.t.byName["echo"]
	var st egressdRuleState
	if err := d.objs.RuleStates.Lookup(idx, &st); err != nil {
		t.Fatal(err)
	}
	st.Counters[egressdCounterCOUNTER_REQUESTS] += 5
	st.Counters[egressdCounterCOUNTER_RESPONSES] += 5
	if err := d.objs.RuleStates.Update(idx, &st, ebpf.UpdateExist); err != nil {
		t.Fatal(err)
	}

	privtest.Join(t, cg)
	c, err := net.Dial("tcp4", echo.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	roundTrips := func(n int) {
		t.Helper()
		buf := []byte{1}
		for range n {
			if _, err := c.Write(buf); err != nil {
				t.Fatal(err)
			}
			if _, err := io.ReadFull(c, buf); err != nil {
				t.Fatal(err)
			}
		}
	}
	check := func(when string, want uint64) {
		t.Helper()
		// The response's count follows its read by the program's run.
		var s Stats
		clocktest.Eventually(t, fmt.Sprintf("%s: %d responses", when, want), func() bool {
			s = stats(t, d, "echo")
			return s.Responses == want
		})
		if s.Requests != want || s.Responses != want || s.InFlight != 0 {
			t.Fatalf("%s: requests %d, responses %d, in flight %d; want %d, %d, 0", when, s.Requests, s.Responses, s.InFlight, want, want)
		}
	}
	roundTrips(3)
	check("beside an earlier build's 5", 8)
	if err := d.Resize(128); err != nil {
		t.Fatal(err)
	}
	check("after a resize", 8)
	roundTrips(2)
	check("counted in the resized tables", 10)
}
