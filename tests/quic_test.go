package tests

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/quic-go/quic-go"
	"github.com/quic-go/quic-go/http3"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/internal/privtest"
	"github.com/egressd/egressd/internal/redistest"
	"github.com/egressd/egressd/pkg/control"
	"github.com/egressd/egressd/pkg/sdk"
	"github.com/egressd/egressd/pkg/sdk/sdkhttp"
	"github.com/egressd/egressd/pkg/sdk/sdkquic"
	"github.com/egressd/egressd/pkg/verdict"
)

// The ALPN protocols the test server speaks: HTTP/3, and "hold", where
// each stream's byte is echoed after the server's hold time and the
// connection kept until the client closes it.
const (
	alpnH3   = http3.NextProtoH3
	alpnHold = "egressd-hold"
)

// serverTLS is a self-signed certificate for the test servers. The clients
// skip its verification: what is tested is which flows the kernel admits,
// not TLS.
var serverTLS = sync.OnceValues(func() (*tls.Config, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		Subject:      pkix.Name{CommonName: "egressd-test"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		DNSNames:     []string{"egressd-test"},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert := tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
	return &tls.Config{Certificates: []tls.Certificate{cert}, NextProtos: []string{alpnH3, alpnHold}}, nil
})

func clientTLS(alpn string) *tls.Config {
	return &tls.Config{InsecureSkipVerify: true, NextProtos: []string{alpn}}
}

// quicServer serves HTTP/3 and the hold protocol on a UDP port.
type quicServer struct {
	port     int
	accepted atomic.Int64
}

// newQUICServer listens on UDP in ns (the test's own namespace if nil) at
// addr ("0.0.0.0:0" for any port) until the test ends.
func newQUICServer(t *testing.T, ns *privtest.NetNS, addr string, hold time.Duration) *quicServer {
	t.Helper()
	conf, err := serverTLS()
	if err != nil {
		t.Fatal(err)
	}
	var pc net.PacketConn
	listen := func() (err error) { pc, err = net.ListenPacket("udp4", addr); return err }
	if ns != nil {
		err = ns.Do(listen)
	} else {
		err = listen()
	}
	if err != nil {
		t.Fatal(err)
	}
	ln, err := quic.Listen(pc, conf, &quic.Config{MaxIncomingStreams: 16})
	if err != nil {
		t.Fatal(err)
	}
	s := &quicServer{port: pc.LocalAddr().(*net.UDPAddr).Port}
	h3 := &http3.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "ok")
	})}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() {
		cancel()
		h3.Close()
		ln.Close()
		pc.Close()
		wg.Wait()
	})
	wg.Go(func() {
		for {
			c, err := ln.Accept(ctx)
			if err != nil {
				return
			}
			s.accepted.Add(1)
			// A client whose datagrams the kernel refused cannot say
			// it closes: the test's end does.
			wg.Go(func() {
				select {
				case <-ctx.Done():
					c.CloseWithError(0, "server closed")
				case <-c.Context().Done():
				}
			})
			if c.ConnectionState().TLS.NegotiatedProtocol == alpnH3 {
				wg.Go(func() { h3.ServeQUICConn(c) })
				continue
			}
			wg.Go(func() { serveHold(c, hold) })
		}
	})
	return s
}

// serveHold echoes each stream's byte after hold, until the client closes
// the connection.
func serveHold(c *quic.Conn, hold time.Duration) {
	for {
		st, err := c.AcceptStream(c.Context())
		if err != nil {
			return
		}
		go func() {
			defer st.Close()
			buf := make([]byte, 1)
			if _, err := io.ReadFull(st, buf); err != nil {
				return
			}
			select {
			case <-time.After(hold):
			case <-c.Context().Done():
				return
			}
			st.Write(buf)
		}()
	}
}

// quicClientConf is the clients' QUIC configuration: a handshake that
// gets no answer gives up after 20 s (twice HandshakeIdleTimeout), so a
// dial that failed in less than 10 s failed at the kernel's refusal, not
// at a timeout.
var quicClientConf = &quic.Config{HandshakeIdleTimeout: 10 * time.Second}

// holdQUIC dials addr with the hold protocol through sdkquic and makes one
// round trip on a stream; the caller holds the connection until it closes
// it. With nothing more to send, the connection is silent: its flow idles.
func holdQUIC(ctx context.Context, addr string) (*quic.Conn, error) {
	return holdQUICWith(ctx, addr, quicClientConf)
}

// keptAlive is quicClientConf with a keep-alive every 200 ms: a connection
// that sends one five times a second keeps its flow from idling out.
var keptAlive = &quic.Config{HandshakeIdleTimeout: quicClientConf.HandshakeIdleTimeout, KeepAlivePeriod: 200 * time.Millisecond}

func holdQUICWith(ctx context.Context, addr string, conf *quic.Config) (*quic.Conn, error) {
	c, err := sdkquic.Dial(ctx, addr, clientTLS(alpnHold), conf)
	if err != nil {
		return nil, err
	}
	if err := roundTrip(ctx, c); err != nil {
		c.CloseWithError(0, "")
		return nil, err
	}
	return c, nil
}

func roundTrip(ctx context.Context, c *quic.Conn) error {
	st, err := c.OpenStreamSync(ctx)
	if err != nil {
		return err
	}
	defer st.Close()
	st.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := st.Write([]byte{1}); err != nil {
		return err
	}
	_, err = io.ReadFull(st, make([]byte, 1))
	return err
}

// runQUICRequester is the requester role on QUIC: each client dials on a
// socket of its own through sdkquic, makes one round trip on a stream and
// closes. The kernel holds the flow from the dial's first datagram to the
// socket's close, after the interval the client notes.
func runQUICRequester(args []string) error {
	return privtest.RunRequester("quicrequester", args, func(addr string) (privtest.Session, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		c, err := sdkquic.Dial(ctx, addr, clientTLS(alpnHold), quicClientConf)
		if err != nil {
			cancel()
			return nil, err
		}
		return quicSession{c, ctx, cancel}, nil
	})
}

// quicSession is a requester's QUIC connection.
type quicSession struct {
	c      *quic.Conn
	ctx    context.Context
	cancel context.CancelFunc
}

func (s quicSession) Port() uint16     { return uint16(s.c.LocalAddr().(*net.UDPAddr).Port) }
func (s quicSession) RoundTrip() error { return roundTrip(s.ctx, s.c) }
func (s quicSession) Close()           { s.c.CloseWithError(0, ""); s.cancel() }

// quicWorld is a QUIC (and TCP) server in a network namespace of its own,
// reached from the test's namespace over a veth, and a daemon whose
// cgroup the test joins.
type quicWorld struct {
	*env
	dep  *privtest.NetNS
	srv  *quicServer
	addr string // the server's address and UDP port
	ip   string
}

// newQUICWorld links a namespace at 10.216.N.2, starts a QUIC server
// there holding each stream hold, and writes policy, where DEST and PORT
// stand for the server's address and port, for a daemon started with
// args. The test's process joins the daemon's cgroup.
func newQUICWorld(t *testing.T, n int, hold time.Duration, policy string, args ...string) *quicWorld {
	t.Helper()
	e := newEnv(t)
	w := &quicWorld{env: e, dep: privtest.NewNetNS(t), ip: fmt.Sprintf("10.216.%d.2", n)}
	privtest.VethToHost(t, fmt.Sprintf("10.216.%d.1/24", n), w.dep, w.ip+"/24")
	w.srv = newQUICServer(t, w.dep, "0.0.0.0:0", hold)
	w.addr = net.JoinHostPort(w.ip, strconv.Itoa(w.srv.port))
	e.writePolicy(t, strings.NewReplacer("DEST", w.ip, "PORT", strconv.Itoa(w.srv.port)).Replace(policy))
	e.args = args
	e.start(t)
	privtest.Join(t, e.cg)
	return w
}

// TestQUICConcurrency: with concurrency 3 on a QUIC server's address,
// three quic-go clients on sockets of their own complete a round trip and
// the fourth fails at once with EPERM, which the SDK, through sdkquic,
// tells as the rule's refusal (Throttled, self-imposed, naming the rule);
// so does an HTTP/3 request through the SDK's executor. After one client
// closes, the next connects; after one idles out (udpIdle 1s, the
// recount every 200 ms), so does the one after, though the idle client's
// connection is still open - and its next datagram is refused. The others
// send keep-alives, which keep their flows.
func TestQUICConcurrency(t *testing.T) {
	w := newQUICWorld(t, 1, 0, "rules:\n  - {name: quic, destination: DEST, port: PORT, protocols: [udp], concurrency: 3, udpIdle: 1s}\n",
		"--recount-every", "200ms")
	ctx := context.Background()
	var held []*quic.Conn
	for i := range 3 {
		conf := keptAlive
		if i == 1 {
			conf = quicClientConf // the one that idles out
		}
		c, err := holdQUICWith(ctx, w.addr, conf)
		if err != nil {
			t.Fatalf("client %d: %v", i, err)
		}
		held = append(held, c)
		t.Cleanup(func() { c.CloseWithError(0, "") })
	}
	start := time.Now()
	_, err := holdQUIC(ctx, w.addr)
	took := time.Since(start)
	if !errors.Is(err, syscall.EPERM) {
		t.Fatalf("the 4th client: %v, want EPERM", err)
	}
	// A handshake that gets no answer takes 20 s to fail.
	if took > 10*time.Second {
		t.Errorf("the 4th client failed after %v: a timeout, not the kernel's refusal", took)
	}
	t.Logf("the 4th client failed after %v: %v", took, err)
	if l := w.limit(t, "quic"); l.Live != 3 || l.Admitted != 3 || l.Refused < 1 || !slices.Equal(l.Protocols, []string{"udp"}) {
		t.Errorf("rule: live %d admitted %d refused %d protocols %v; want 3, 3, at least 1, [udp]", l.Live, l.Admitted, l.Refused, l.Protocols)
	}

	t.Run("the SDK", func(t *testing.T) { checkSDKSeesQUICRefusal(t, w) })

	// One closes: the next connects.
	held[0].CloseWithError(0, "")
	var next *quic.Conn
	clocktest.Eventually(t, "a client after one closed", func() bool {
		next, err = holdQUICWith(ctx, w.addr, keptAlive)
		return err == nil
	})
	t.Cleanup(func() { next.CloseWithError(0, "") })

	// One idles out: after udpIdle and a recount, the next connects
	// beside it. Its connection is still open, with nothing sent.
	idle := held[1]
	var after *quic.Conn
	clocktest.Eventually(t, "a client after one idled out", func() bool {
		after, err = holdQUICWith(ctx, w.addr, keptAlive)
		return err == nil
	})
	t.Cleanup(func() { after.CloseWithError(0, "") })
	if idle.Context().Err() != nil {
		t.Fatalf("the idle client's connection ended: %v", context.Cause(idle.Context()))
	}
	if l := w.limit(t, "quic"); l.Live != 3 {
		t.Errorf("live %d after one flow idled out and another opened, want 3", l.Live)
	}
	// Its next datagram opens its flow again, and the rule is full.
	if err := roundTrip(ctx, idle); err == nil {
		t.Errorf("the idle client's round trip succeeded with 3 other flows open, want its send refused")
	}
}

// checkSDKSeesQUICRefusal makes one request of each kind through the SDK
// while the rule is full: a quic dial and an HTTP/3 GET through the SDK's
// HTTP stack over http3.Transport. Each is Throttled, self-imposed and
// names the rule; the retry budget is untouched.
func checkSDKSeesQUICRefusal(t *testing.T, w *quicWorld) {
	budget := sdk.NewRetryBudget(0.1, 10)
	policy := &sdk.Policy{
		MaxAttempts: 2,
		Backoff:     sdk.Backoff{Throttled: sdk.Curve{Initial: 5 * time.Millisecond, Multiplier: 1}, MaxDelay: 10 * time.Millisecond},
		Classifier:  sdk.DefaultClassifier().WithAttributor(sdk.DaemonAttributor(&control.Client{Socket: w.socket})),
		Budget:      budget,
	}
	tokens := budget.Tokens()
	r := sdk.Try(context.Background(), policy, func(ctx context.Context) (*quic.Conn, error) {
		return holdQUIC(ctx, w.addr)
	})
	if r.Err == nil {
		r.Value.CloseWithError(0, "")
		t.Fatal("a dial through the SDK was admitted past the limit")
	}
	for i, a := range r.Attempts {
		if a.Kind() != verdict.Throttled || !a.SelfImposed() {
			t.Errorf("dial attempt %d: %v, want a self-imposed refusal", i, a)
		}
	}
	if rl, ok := sdk.AsRateLimited(r.Err); !ok || rl.Limiter != "quic" {
		t.Errorf("dial: %v, want a *RateLimitedError naming rule quic", r.Err)
	}

	tr := &http3.Transport{TLSClientConfig: clientTLS(alpnH3), QUICConfig: quicClientConf, Dial: sdkquic.DialEarly}
	t.Cleanup(func() { tr.Close() })
	rt, err := sdkhttp.NewStack(tr).Retry(policy).Build()
	if err != nil {
		t.Fatal(err)
	}
	var res sdkhttp.Result
	req, err := http.NewRequestWithContext(sdkhttp.WithResult(context.Background(), &res), http.MethodGet, "https://"+w.addr+"/", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := (&http.Client{Transport: rt}).Do(req)
	if err == nil {
		resp.Body.Close()
		t.Fatal("an HTTP/3 request was admitted past the limit")
	}
	if len(res.Attempts) != 2 {
		t.Fatalf("HTTP/3: %v; attempt log %+v, want 2 attempts", err, res.Attempts)
	}
	for i, a := range res.Attempts {
		if a.Kind() != verdict.Throttled || !a.SelfImposed() {
			t.Errorf("HTTP/3 attempt %d: %v, want a self-imposed refusal", i, a)
		}
	}
	if rl, ok := sdk.AsRateLimited(err); !ok || rl.Limiter != "quic" {
		t.Errorf("HTTP/3: %v, want a *RateLimitedError naming rule quic", err)
	}
	if budget.Tokens() != tokens {
		t.Errorf("retry budget %v after refusals, want %v untouched", budget.Tokens(), tokens)
	}
}

// TestQUICPerSecond: a per-second rule bounds new QUIC connections' flows:
// one client dialling as fast as it can for 3 s, each connection closed
// after its round trip, gets at most the burst (a second's worth) and the
// rate's worth over the time it dialled; an HTTP/3 GET through the
// transport's own shared socket counts once.
func TestQUICPerSecond(t *testing.T) {
	const rate = 5
	w := newQUICWorld(t, 2, 0, fmt.Sprintf("rules:\n  - {name: quic, destination: DEST, port: PORT, protocols: [udp], perSecond: {permits: %d}}\n", rate))
	ctx := context.Background()
	var ok, refused int
	start := time.Now()
	for time.Since(start) < 3*time.Second {
		c, err := holdQUIC(ctx, w.addr)
		switch {
		case err == nil:
			ok++
			c.CloseWithError(0, "")
		case errors.Is(err, syscall.EPERM):
			refused++
		default:
			t.Fatalf("dial: %v", err)
		}
	}
	elapsed := time.Since(start)
	most := rate + int(float64(rate)*elapsed.Seconds()) + 1
	t.Logf("%d connections admitted and %d refused in %v, at most %d allowed", ok, refused, elapsed, most)
	if ok > most || ok < rate {
		t.Errorf("%d connections admitted in %v, want between %d and %d", ok, elapsed, rate, most)
	}
	if refused == 0 {
		t.Error("no connection refused: the client did not outrun the rate")
	}
	// Each refused dial sent one datagram: sdkquic sends nothing after a
	// refusal.
	if l := w.limit(t, "quic"); l.Admitted != uint64(ok) || l.Refused != uint64(refused) {
		t.Errorf("rule: admitted %d refused %d, the client saw %d and %d", l.Admitted, l.Refused, ok, refused)
	}
}

// TestTCPAndQUICOneBudget: one rule with [tcp, udp] and concurrency 4 on a
// server's address; three TCP clients and three QUIC clients, closed
// loops for 5 s. Together they never hold more than 4 at once, as the
// clients saw it, and both transports got through (neither side's three
// can take all four slots).
func TestTCPAndQUICOneBudget(t *testing.T) {
	const limit = 4
	dep := privtest.NewNetNS(t)
	w := &quicWorld{dep: dep, ip: "10.216.3.2"}
	privtest.VethToHost(t, "10.216.3.1/24", dep, w.ip+"/24")
	w.srv = newQUICServer(t, dep, "0.0.0.0:0", 20*time.Millisecond)
	tcp := newHoldServer(t, dep, 20*time.Millisecond)
	w.env = newEnv(t)
	w.writePolicy(t, fmt.Sprintf("rules:\n  - {name: both, destination: %s, protocols: [tcp, udp], concurrency: %d}\n", w.ip, limit))
	w.start(t)
	dir := t.TempDir()
	tcpLoad := privtest.Spawn(t, w.cg, "requester", fmt.Sprintf("%s:%d", w.ip, tcp.port), "3", "5s", dir+"/tcp")
	quicLoad := privtest.Spawn(t, w.cg, "quicrequester", fmt.Sprintf("%s:%d", w.ip, w.srv.port), "3", "5s", dir+"/quic")
	var all []privtest.Interval
	for _, l := range []*recordedLoad{{Child: tcpLoad, path: dir + "/tcp"}, {Child: quicLoad, path: dir + "/quic"}} {
		line := l.Line(t)
		var ok, refused, failed int
		if _, err := fmt.Sscanf(line, "done ok %d refused %d failed %d", &ok, &refused, &failed); err != nil {
			t.Fatalf("clients: %q", line)
		}
		l.Wait(t)
		ivs, err := privtest.ReadIntervals(l.path)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s: ok %d refused %d failed %d", l.path[len(dir)+1:], ok, refused, failed)
		if ok == 0 || failed > ok/10 {
			t.Errorf("%s clients: ok %d failed %d, want most to get through", l.path[len(dir)+1:], ok, failed)
		}
		all = append(all, ivs...)
	}
	most, at := privtest.MaxOverlap(all, 0, 1<<62)
	t.Logf("TCP connections and QUIC flows held at most %d at once (limit %d)", most, limit)
	if most > limit {
		t.Errorf("the clients held %d at once at %d, over the limit of %d", most, at, limit)
	}
	if l := w.limit(t, "both"); l.Live != 0 {
		t.Errorf("live %d once every client closed, want 0", l.Live)
	}
}

// busyQUIC starts QUIC clients on h, against port of the dependency's
// address, until stopAll.
func (w *world) busyQUIC(h *sharingHost, port, clients int) {
	path := filepath.Join(w.t.TempDir(), "intervals")
	c := h.ns.Spawn(w.t, h.cg, "quicrequester", fmt.Sprintf("%s:%d", h.dest, port), fmt.Sprint(clients), "10m", path)
	w.loads = append(w.loads, &recordedLoad{Child: c, path: path, host: slices.Index(w.hosts, h)})
}

// TestSharedBudgetTCPAndQUIC: two daemons as two hosts share a budget of
// 6 for a rule with [tcp, udp], one host's clients on TCP and the other's
// on QUIC, eight each, for 3 s. The sum the clients held never exceeds the
// budget, and both hosts got through.
func TestSharedBudgetTCPAndQUIC(t *testing.T) {
	rds := redistest.Start(t)
	w := newWorld(t, rds, 6)
	w.protocols = "[tcp, udp]"
	q := newQUICServer(t, w.dep, "0.0.0.0:0", 20*time.Millisecond)
	tcpHost := w.addHost(`key: "egressd-test:tcp-quic", lease: 3s`, false)
	quicHost := w.addHost(`key: "egressd-test:tcp-quic", lease: 3s`, false)
	w.thawed()
	start := privtest.Monotonic()
	w.busy(tcpHost, 8)
	w.busyQUIC(quicHost, q.port, 8)
	time.Sleep(3 * time.Second) // the load's length, not a wait for a condition
	slots := w.slots()
	w.stopAll()
	w.check("TCP on one host, QUIC on the other", start, privtest.Monotonic())
	t.Logf("slots at the end: TCP host %d, QUIC host %d; connections: TCP %d, QUIC %d", slots[0], slots[1], len(w.byHost[0]), len(w.byHost[1]))
	if len(w.byHost[0]) == 0 || len(w.byHost[1]) == 0 {
		t.Errorf("connections: TCP host %d, QUIC host %d; want both to get through", len(w.byHost[0]), len(w.byHost[1]))
	}
	if l := quicHost.rule(t, "pool"); !slices.Equal(l.Protocols, []string{"tcp", "udp"}) {
		t.Errorf("the QUIC host's rule counts %v, want [tcp udp]", l.Protocols)
	}
}
