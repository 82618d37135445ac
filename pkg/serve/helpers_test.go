package serve_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/egressd/egressd/pkg/serve"
)

func newMiddleware(t *testing.T, opts serve.Options) *serve.Middleware {
	t.Helper()
	m, err := serve.New(opts)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// listen serves h on loopback until the test ends.
func listen(t *testing.T, h http.Handler) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv
}

// inProcess returns a client whose requests h serves on the calling
// goroutine, through no network, so that a test can make them inside a
// synctest bubble: on its fake clock, which a loopback connection would
// keep from moving. The handler sees a server's request, from 192.0.2.1.
func inProcess(h http.Handler) *http.Client {
	return &http.Client{Transport: handlerTransport{h}}
}

// handlerTransport is inProcess's RoundTripper.
type handlerTransport struct{ h http.Handler }

func (ht handlerTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	r := req.Clone(req.Context())
	r.RemoteAddr, r.RequestURI = "192.0.2.1:1234", req.URL.RequestURI()
	if r.Body == nil {
		r.Body = http.NoBody
	}
	w := httptest.NewRecorder()
	ht.h.ServeHTTP(w, r)
	return w.Result(), nil
}

// inProcessURL is the URL of inProcess's requests: any would do.
const inProcessURL = "http://serve.test/"

// clientFrom returns a client whose connections come from the loopback
// address ip, so that one test can be several clients to ByClientIP. All
// of 127.0.0.0/8 is this host's on Linux; elsewhere the test is skipped.
func clientFrom(t *testing.T, ip string) *http.Client {
	t.Helper()
	ln, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		t.Skipf("%s is not an address of this host: %v", ip, err)
	}
	ln.Close()
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}, Timeout: 5 * time.Second}
	tr := &http.Transport{DialContext: d.DialContext}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

// response is what a test reads of one exchange.
type response struct {
	code       int
	retryAfter string
	hasRetry   bool
	body       string
}

// fetch makes a GET to url with headers as name, value pairs, and reads
// the whole response. It does not fail the test, so that goroutines and
// handlers may call it; the test goroutine uses get.
func fetch(c *http.Client, ctx context.Context, url string, headers ...string) (response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return response{}, err
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Add(headers[i], headers[i+1])
	}
	resp, err := c.Do(req)
	if err != nil {
		return response{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return response{}, fmt.Errorf("read %s: %w", url, err)
	}
	ra, has := resp.Header["Retry-After"]
	r := response{code: resp.StatusCode, hasRetry: has, body: string(b)}
	if has {
		r.retryAfter = ra[0]
	}
	return r, nil
}

// get is fetch on the test goroutine, failing the test on an error.
func get(t *testing.T, c *http.Client, url string, headers ...string) response {
	t.Helper()
	r, err := fetch(c, context.Background(), url, headers...)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	return r
}

// background is fetch in a goroutine: the response, or an error, arrives
// on the channel.
func background(c *http.Client, url string, headers ...string) <-chan response {
	ch := make(chan response, 1)
	go func() {
		r, err := fetch(c, context.Background(), url, headers...)
		if err != nil {
			r.body = "error: " + err.Error()
		}
		ch <- r
	}()
	return ch
}

var ok = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })

// recorder is a serve.Observer that counts.
type recorder struct {
	mu         sync.Mutex
	requests   map[string]map[serve.Outcome]int // by policy
	partitions map[string]int
	headers    map[serve.Header]map[serve.HeaderResult]int
}

func newRecorder() *recorder {
	return &recorder{
		requests:   map[string]map[serve.Outcome]int{},
		partitions: map[string]int{},
		headers:    map[serve.Header]map[serve.HeaderResult]int{},
	}
}

func (r *recorder) Policy(name string) serve.PolicyObserver {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.requests[name] = map[serve.Outcome]int{}
	return &policyRecorder{r: r, name: name}
}

func (r *recorder) OnHeader(h serve.Header, res serve.HeaderResult) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.headers[h] == nil {
		r.headers[h] = map[serve.HeaderResult]int{}
	}
	r.headers[h][res]++
}

func (r *recorder) count(policy string, o serve.Outcome) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.requests[policy][o]
}

func (r *recorder) header(h serve.Header, res serve.HeaderResult) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.headers[h][res]
}

type policyRecorder struct {
	r    *recorder
	name string
}

func (p *policyRecorder) OnRequest(o serve.Outcome, _ time.Duration) {
	p.r.mu.Lock()
	defer p.r.mu.Unlock()
	p.r.requests[p.name][o]++
}

func (p *policyRecorder) OnPartitions(n int) {
	p.r.mu.Lock()
	defer p.r.mu.Unlock()
	p.r.partitions[p.name] = n
}
